"""Needle in a haystack: exact-length prompts with the needle at the asked depth, scoring, reports, CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from oscar_hf import OscarCache
from oscar_hf.cli.main import main
from oscar_hf.evaluation.data import data_dir
from oscar_hf.evaluation.haystack import (
    ANSWER_PREFIX,
    INSTRUCTION,
    NEEDLE,
    QUESTION,
    Haystack,
    Needle,
    NeedleError,
    build_prompt,
    extract_number,
    haystack_files,
    is_correct,
    read_haystack,
)
from oscar_hf.evaluation.niah import (
    Trial,
    accuracy_table,
    check_lengths,
    niah_markdown,
    niah_result,
    parse_depths,
    parse_lengths,
    plot_niah,
    run_niah,
    summary,
)
from oscar_hf.evaluation.report import write_outputs
from oscar_hf.provenance import provenance, provenance_line
from tests.conftest import tiny_model

DATA = data_dir()  # CI passes the data folder as $OSCAR_HF_DATA_DIR
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 264  # 256 bytes + 3 special tokens, rounded up


def byte_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    """A real (offline) byte-level tokenizer: one token per byte, digits included, and a chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "pad_token": "<pad>"})
    tokenizer.eos_token = "<|im_end|>"
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_essays(root: Path) -> Path:
    """A data dir with a synthetic essays folder: numbered sentences, so depth is easy to read off."""
    folder = root / "niah_paul_graham_essays"
    folder.mkdir(parents=True)
    for part in range(2):
        sentences = [f"Sentence {part}-{k} says nothing much." for k in range(150)]
        (folder / f"essay{part}.txt").write_text(" ".join(sentences) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture
def haystack(tmp_path, tokenizer):
    return Haystack(tokenizer, read_haystack(haystack_files(write_essays(tmp_path), "essays")))


@pytest.mark.parametrize("length", [500, 777, 1500])
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_prompt_has_exact_length_and_needle_at_depth(tokenizer, haystack, length, depth):
    prompt = build_prompt(tokenizer, haystack, length, depth, seed=3)
    ids = prompt.input_ids
    assert len(ids) == length
    needle = Needle.from_seed(3)
    assert tokenizer.decode(ids[prompt.needle_start : prompt.needle_end]) == " " + NEEDLE.format(
        key=needle.key, value=needle.value
    )
    assert prompt.haystack_start <= prompt.needle_start < prompt.needle_end <= prompt.haystack_end
    haystack_tokens = prompt.haystack_end - prompt.haystack_start - (prompt.needle_end - prompt.needle_start)
    # snapped back to a sentence boundary: at most one sentence (~40 bytes here) before the asked depth
    assert depth - 100 * 45 / haystack_tokens <= prompt.actual_depth <= depth
    if depth > 0:
        assert tokenizer.decode(ids[prompt.needle_start - 1 : prompt.needle_start]) == "."
    else:
        assert prompt.needle_start == prompt.haystack_start
    # instruction in the user turn before the haystack; question and answer prefix after it
    assert tokenizer.decode(ids[: prompt.haystack_start]) == f"<|im_start|>user\n{INSTRUCTION}\n"
    assert tokenizer.decode(ids[prompt.haystack_end :]) == (
        f"\n{QUESTION.format(key=needle.key)}<|im_end|>\n<|im_start|>assistant\n{ANSWER_PREFIX.format(key=needle.key)}"
    )


def test_same_seed_same_needle_and_haystack_other_seeds_differ(tokenizer, haystack):
    a = build_prompt(tokenizer, haystack, 500, 50, seed=1)
    b = build_prompt(tokenizer, haystack, 900, 90, seed=1)
    assert a.needle == b.needle
    assert (
        a.input_ids[a.haystack_start : a.haystack_start + 50] == b.input_ids[b.haystack_start : b.haystack_start + 50]
    )
    needles = {Needle.from_seed(s) for s in range(8)}
    assert len({n.value for n in needles}) == 8
    assert all(len(n.value) == 7 for n in needles)


def test_plain_prompt_without_chat_template(haystack):
    plain = byte_tokenizer(chat=False)
    prompt = build_prompt(plain, haystack, 600, 50, seed=0)
    assert len(prompt.input_ids) == 600
    assert plain.decode(prompt.input_ids).startswith(INSTRUCTION + "\n")
    assert plain.decode(prompt.input_ids).endswith(ANSWER_PREFIX.format(key=prompt.needle.key))


def test_haystack_wraps_around_a_short_text(tokenizer):
    short = Haystack(tokenizer, "One sentence. Another one.")
    prompt = build_prompt(tokenizer, short, 600, 50, seed=0)
    assert len(prompt.input_ids) == 600


def test_bad_prompts_raise_clear_errors(tokenizer, haystack, tmp_path):
    with pytest.raises(NeedleError, match="too short"):
        build_prompt(tokenizer, haystack, 100, 50, seed=0)
    with pytest.raises(NeedleError, match="depth"):
        build_prompt(tokenizer, haystack, 600, 120, seed=0)
    with pytest.raises(NeedleError, match="--data-dir"):
        haystack_files(None)
    with pytest.raises(NeedleError, match="no .txt files"):
        haystack_files(tmp_path / "elsewhere")
    with pytest.raises(NeedleError, match="unknown haystack"):
        haystack_files(tmp_path, "poems")


def test_number_extraction_and_exact_match():
    needle = Needle(key="Oslo", value="1234567")
    assert extract_number(" 1234567.") == "1234567"
    assert extract_number("is: 1,234,567, I think") == "1234567"
    assert extract_number("nothing here") is None
    assert is_correct("1234567", needle)
    assert not is_correct("123456", needle)
    assert not is_correct("12345678", needle)
    assert not is_correct("7654321 or 1234567", needle)  # only the first number counts


def test_parsers_and_context_check():
    assert parse_lengths("2K,4096, 8k") == [2048, 4096, 8192]
    assert parse_depths("0,12.5,100") == [0.0, 12.5, 100.0]
    for bad in ("2M", "x", ""):
        with pytest.raises(NeedleError):
            parse_lengths(bad)
    with pytest.raises(NeedleError):
        parse_depths("50,101")
    check_lengths([8180], 8192, 12)
    with pytest.raises(NeedleError, match="context of 8192"):
        check_lengths([2048, 8192], 8192, 12)


def _trial(method, length, depth, seed, correct):
    return Trial(method, length, depth, seed, "Oslo", "1234567", "x", None, correct, 10, float(depth), 0.1)


def test_accuracy_tables():
    trials = [_trial("none", 512, 50, s, c) for s, c in enumerate([True, True, False, True])]
    trials += [_trial("none", 1024, 50, 0, False), _trial("int4", 512, 50, 0, True)]
    assert accuracy_table(trials) == {"none": {"512": {"50": 0.75}, "1024": {"50": 0.0}}, "int4": {"512": {"50": 1.0}}}
    assert summary(trials)["none"] == {"512": 0.75, "1024": 0.0, "all": 0.6}


@pytest.fixture(scope="module")
def tiny_llm():
    return tiny_model("llama", vocab_size=VOCAB)


def test_run_niah_on_a_tiny_model_writes_json_markdown_and_png(tmp_path, tokenizer, haystack, tiny_llm):
    methods, lengths, depths, seeds = ["none", "int4", "naive-int2"], [560, 620], [0.0, 50.0], [0, 1]
    trials = run_niah(tiny_llm, tokenizer, haystack, methods, lengths, depths, seeds, max_new_tokens=4, progress=False)
    assert len(trials) == len(methods) * len(lengths) * len(depths) * len(seeds)
    for t in trials:
        assert t.correct == (t.extracted == t.expected)
        assert len(t.expected) == 7
    settings = {
        "model": "tiny",
        "haystack": "synthetic",
        "methods": methods,
        "lengths": lengths,
        "depths": depths,
        "seeds": seeds,
        "max_new_tokens": 4,
        "chat": True,
    }
    meta = {**provenance("pytest"), "seconds": 1}
    result = niah_result(trials, meta, settings)
    paths = write_outputs(result, tmp_path / "out" / "niah.json", niah_markdown(result), plot_niah)
    assert [p.name for p in paths] == ["niah.json", "niah.md", "niah.png"]
    loaded = json.loads(paths[0].read_text())
    assert set(loaded["accuracy"]) == set(methods)
    assert set(loaded["accuracy"]["int4"]) == {"560", "620"}
    assert set(loaded["accuracy"]["int4"]["620"]) == {"0", "50"}
    assert len(loaded["trials"]) == len(trials) and loaded["command"] == "pytest"
    markdown = paths[1].read_text()
    assert "| naive-int2 | 620 | " in markdown and provenance_line(meta) in markdown
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fresh_cache_per_generation_gives_the_same_answer_twice(tokenizer, haystack, tiny_llm):
    trials = run_niah(
        tiny_llm, tokenizer, haystack, ["int4", "int4"], [600], [50.0], [5], max_new_tokens=6, progress=False
    )
    assert trials[0].answer == trials[1].answer  # no state carried from one generation to the next


def test_run_niah_refuses_prompts_beyond_the_context(tokenizer, haystack, tiny_llm):
    with pytest.raises(NeedleError, match="context of 2048"):
        run_niah(tiny_llm, tokenizer, haystack, ["none"], [2040], [50.0], [0], max_new_tokens=12, progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llm, tokenizer):
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_llm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_cli_writes_outputs(tmp_path, model_dir, capsys):
    data = write_essays(tmp_path / "data")
    stem = tmp_path / "results" / "niah_tiny"
    main(
        [
            "eval",
            "niah",
            "--model",
            str(model_dir),
            "--data-dir",
            str(data),
            "--lengths",
            "600",
            "--depths",
            "0,50",
            "--needles",
            "1",
            "--methods",
            "none,int4",
            "--max-new-tokens",
            "4",
            "--out",
            str(stem),
        ]
    )
    result = json.loads(stem.with_suffix(".json").read_text())
    assert result["command"].startswith("oscar-hf eval niah") and result["lengths"] == [600]
    assert result["chat"] is True and len(result["trials"]) == 4
    assert stem.with_suffix(".png").is_file() and "| int4 | 600 | " in stem.with_suffix(".md").read_text()
    assert "| none |" in capsys.readouterr().out


def test_cli_errors(tmp_path, model_dir, capsys, monkeypatch):
    data = write_essays(tmp_path / "data")
    base = ["eval", "niah", "--model", str(model_dir), "--data-dir", str(data)]
    with pytest.raises(SystemExit) as error:
        main([*base, "--methods", "none,oscar-int3"])
    assert error.value.code == 2 and "unknown method(s) ['oscar-int3']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        main([*base, "--lengths", "2K,lots"])
    assert error.value.code == 2 and "bad length 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        main([*base, "--depths", "50,150"])
    assert error.value.code == 2 and "[0, 100]" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="exceed the model's context of 2048"):
        main([*base, "--lengths", "4K"])
    with pytest.raises(SystemExit, match="is not a folder"):
        main(["eval", "niah", "--model", str(model_dir), "--data-dir", str(tmp_path / "missing")])
    monkeypatch.delenv("OSCAR_HF_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # no data folder around either
    with pytest.raises(SystemExit, match="no data directory"):
        main(["eval", "niah", "--model", str(model_dir)])


@pytest.mark.skipif(
    DATA is None or not (DATA / "niah_paul_graham_essays").is_dir(),
    reason="needs the Paul Graham essays (set OSCAR_HF_DATA_DIR to the shared data folder)",
)
def test_real_essays_build_exact_prompts(tokenizer):
    files = haystack_files(DATA, "essays")
    assert len(files) == 49
    haystack = Haystack(tokenizer, read_haystack(files))
    prompt = build_prompt(tokenizer, haystack, 3000, 40, seed=0)
    assert len(prompt.input_ids) == 3000 and 35 <= prompt.actual_depth <= 40


@pytest.mark.skipif(
    DATA is None or not (DATA / "gutenberg_books").is_dir(),
    reason="needs the Gutenberg books (set OSCAR_HF_DATA_DIR to the shared data folder)",
)
def test_real_gutenberg_haystack_has_no_carriage_returns(tokenizer):
    files = haystack_files(DATA, "gutenberg")
    text = read_haystack(files[:1])
    assert "\r" not in text and len(text) > 100_000


def test_oscar_methods_run_with_rotations(tokenizer, haystack, tiny_llm):
    from oscar_hf import RotationSet

    generator = torch.Generator().manual_seed(0)
    head_dim = tiny_llm.config.head_dim

    def orthogonal():
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()

    layers = range(tiny_llm.config.num_hidden_layers)
    rotations = RotationSet(head_dim, {i: orthogonal() for i in layers}, {i: orthogonal() for i in layers}, "random")
    OscarCache(tiny_llm, "oscar-int2", rotations=rotations)  # accepted for this model
    trials = run_niah(
        tiny_llm,
        tokenizer,
        haystack,
        ["oscar-int2", "oscar-k4v2"],
        [600],
        [50.0],
        [0],
        rotations,
        max_new_tokens=3,
        progress=False,
    )
    assert [t.method for t in trials] == ["oscar-int2", "oscar-k4v2"]
