"""The real default model (SmolLM2-135M-Instruct, CPU) with OSCAR INT2."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_hf import METHODS, OscarCache
from oscar_hf.cli.common import rotations_for
from oscar_hf.cli.main import main
from oscar_hf.core.memory import bits_per_element
from oscar_hf.core.models import load_model
from oscar_hf.evaluation.data import WIKITEXT2_TEST, data_dir
from oscar_hf.evaluation.demo import PROJECTED_TOKENS, demo_prompt, first_difference, format_demo, run_demo, run_method
from oscar_hf.evaluation.kl import evaluate_methods
from tests.conftest import generate, tiny_model

pytestmark = pytest.mark.slow
DATA = data_dir()  # CI passes the data folder as $OSCAR_HF_DATA_DIR


@pytest.fixture(scope="module")
def smollm():
    model, tokenizer = load_model("default")
    return model, tokenizer, rotations_for("default", None, methods=["oscar-int2"])["oscar-int2"]


def chat(tokenizer, text):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def test_answers_a_factual_question_with_oscar_int2(smollm):
    model, tokenizer, rotations = smollm
    ids = chat(tokenizer, "What is the capital of France?")
    # small windows, so that the question itself is stored at 2 bits
    cache = OscarCache(model, "oscar-int2", rotations=rotations, sink=4, recent=8)
    out = generate(model, ids, cache, max_new_tokens=12, min_new_tokens=1)
    assert cache.layers[0].history_length > 10
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_retrieves_a_fact_from_the_int2_history(smollm):
    model, tokenizer, rotations = smollm
    prompt = demo_prompt(tokenizer)
    # the demo's claim: the fact sits in the 2-bit history, past the sink and before the recent window
    fact = tokenizer(" Biscuit", add_special_tokens=False)["input_ids"]
    ids = prompt[0].tolist()
    first = next(i for i in range(len(ids)) if ids[i : i + len(fact)] == fact)
    config = METHODS["oscar-int2"]
    assert config.sink < first < len(ids) - config.recent - len(fact)
    run = run_method(model, tokenizer, prompt, "oscar-int2", rotations, max_new_tokens=20)
    assert "Biscuit" in run.answer
    assert run.memory.summary()["tokens"] == prompt.shape[1] and run.memory.compression_vs_dynamic > 3


@pytest.mark.skipif(DATA is None, reason="needs the WikiText-2 test file (set OSCAR_HF_DATA_DIR)")
def test_kl_ranks_oscar_below_quarot_below_naive_on_wikitext(smollm):
    model, tokenizer, rotations = smollm
    text = (DATA / WIKITEXT2_TEST).read_text(encoding="utf-8")[:200_000]
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    scores = {
        s.method: s
        for s in evaluate_methods(
            model, ids, ["naive-int2", "quarot-int2", "oscar-int2"], rotations, context=2048, windows=1, progress=False
        )
    }
    assert scores["oscar-int2"].kl_from_none < scores["quarot-int2"].kl_from_none < scores["naive-int2"].kl_from_none
    assert scores["oscar-int2"].perplexity < scores["quarot-int2"].perplexity


def test_cli_eval_kl_json(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Sentence number {i} is about the sea and the harbour." for i in range(120)))
    main(
        [
            "eval",
            "kl",
            "--model",
            "default",
            "--text",
            str(text),
            "--ctx",
            "512",
            "--windows",
            "2",
            "--methods",
            "none,naive-int2",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert [s["method"] for s in result["scores"]] == ["none", "naive-int2"]
    assert result["scores"][0]["kl_from_none"] == 0 and result["scores"][1]["kl_from_none"] > 0
    assert result["command"].startswith("oscar-hf eval kl")


def test_cli_demo_json(capsys):
    main(["demo", "--json", "--max-new-tokens", "4", "--methods", "oscar-int2"])
    result = json.loads(capsys.readouterr().out)
    none, oscar = result["runs"]
    assert (none["method"], oscar["method"]) == ("none", "oscar-int2")
    assert oscar["same_answer_as_none"] == (first_difference(none["answer"], oscar["answer"]) is None)
    assert result["warmup_seconds"] == {}  # CPU: nothing compiles
    assert result["prompt_tokens"] > 1400 and all(r["decode_tokens_per_second"] > 0 for r in result["runs"])
    # BF16 windows and baseline whatever the model dtype (float32 here): 30 layers x K,V x 3 heads x 64 x 2 bytes
    rows = result["kv_memory_bf16"]
    assert [row["tokens"] for row in rows] == [result["prompt_tokens"], *PROJECTED_TOKENS]
    assert all(row["bytes"]["none"] == row["tokens"] * 30 * 2 * 3 * 64 * 2 for row in rows)
    assert rows[0]["bytes"]["none"] / rows[0]["bytes"]["oscar-int2"] > 2.5
    assert rows[-1]["bytes"]["none"] / rows[-1]["bytes"]["oscar-int2"] == pytest.approx(
        16 / bits_per_element(METHODS["oscar-int2"], 128 * 1024, 64), rel=1e-6
    )


def test_demo_report_with_a_warm_up(smollm):
    """A random two-layer model with the default tokenizer: the report's parts, warm-up included."""
    _, tokenizer, _ = smollm
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=None)
    demo = run_demo(model, tokenizer, ["quarot-int2"], None, max_new_tokens=6, warm_up=True)
    assert list(demo.warmup_seconds) == ["none", "quarot-int2"] and all(s > 0 for s in demo.warmup_seconds.values())
    none, int2 = demo.runs
    # on CPU nothing is captured: every decode step after the first token is timed
    assert none.new_tokens == int2.new_tokens == 6 and int2.setup_seconds is None and int2.decode_tokens_per_second > 0
    text = format_demo(demo)
    same = first_difference(none.answer, int2.answer) is None
    assert none.answer in text and int2.answer in text
    assert ("Same answer as none: yes." if same else "Same answer as none: NO. Word") in text
    assert (
        "after a warm-up run of each cache" in text
        and "131,072 tokens (projected)" in text
        and "dequantizes the history" in text
    )
    short = run_demo(model, tokenizer, ["quarot-int2"], None, max_new_tokens=1)
    assert short.warmup_seconds == {} and short.runs[1].decode_tokens_per_second is None
    assert "too few tokens to time decoding" in format_demo(short)


def test_from_zoo_with_the_default_model_id(smollm):
    model, tokenizer, _ = smollm
    cache = OscarCache.from_zoo("default", sink=4, recent=8)
    ids = chat(tokenizer, "What is the capital of France?")
    out = generate(model, ids, cache, max_new_tokens=12, min_new_tokens=1)
    assert cache.layers[0].history_length > 10 and "Paris" in tokenizer.decode(out[0, ids.shape[1] :])
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError, match="attn_implementation='oscar'"):
            generate(model, ids, OscarCache.from_zoo("default"), max_new_tokens=2)
    finally:
        model.set_attn_implementation("oscar")
