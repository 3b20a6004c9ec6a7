"""lm-eval integration: the ``oscar`` model, the offline tasks and ``eval tasks`` (tiny random models, offline)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from oscar_hf import METHODS, OscarCache, bits_per_element  # noqa: E402
from oscar_hf.cli.main import build_parser  # noqa: E402
from oscar_hf.core.compat import cache_keyword  # noqa: E402
from oscar_hf.evaluation.data import data_dir  # noqa: E402
from oscar_hf.evaluation.lm_eval_model import OscarLM, StopAfterThinking  # noqa: E402
from oscar_hf.evaluation.task_eval import run_tasks  # noqa: E402
from oscar_hf.evaluation.task_summary import RunKey, run_path  # noqa: E402
from oscar_hf.evaluation.tasks import available_tasks, write_task_configs  # noqa: E402
from oscar_hf.evaluation.tasks.scoring import gpqa_letter, humaneval_program, run_program  # noqa: E402
from oscar_hf.provenance import provenance
from tests.conftest import TINY, tiny_model  # noqa: E402

TINY_HEAD_DIM = TINY["head_dim"]

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHARED_DATA = data_dir() or Path("$OSCAR_HF_DATA_DIR")  # CI passes the data folder there


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0-2 are <pad>, <eos>, <bos> (as in the tiny models' config)."""
    chars = ["\n", *map(chr, range(32, 127))]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture()
def model(tok):
    return tiny_model("qwen3", vocab_size=len(tok))


class GenerateRecorder:
    """Wraps ``model.generate`` (transformers' method) and notes what each call received."""

    def __init__(self, model):
        self.model, self.inner, self.calls = model, model.generate, []
        model.generate = self

    def __call__(self, *args, **kwargs):
        key = cache_keyword(self.model)
        cache = kwargs.get(key)
        self.calls.append(
            {
                "keyword_used": key in kwargs,
                "other_keyword": ({"cache", "past_key_values"} - {key}) & set(kwargs),
                "cache": cache,
                "cache_length_at_call": cache.get_seq_length() if cache is not None else None,
                "stopping_criteria": kwargs.get("stopping_criteria"),
            }
        )
        return self.inner(*args, **kwargs)


def write_tiny_task(tmp_path: Path) -> tuple[Path, Path]:
    """A two-question task whose data the test writes itself (one YAML, one JSONL)."""
    data = tmp_path / "data"
    (data / "tiny").mkdir(parents=True)
    rows = [
        {"question": "what is one plus one, spelled out in full as a word please?" * 2, "answer": "two"},
        {"question": "name a colour of the sky on a clear day at noon, one word" * 2, "answer": "blue"},
    ]
    (data / "tiny" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text(
        "oscar:\n  name: tiny\n  data_files: {test: tiny/test.jsonl}\n  metric: exact_match,none\n"
        "task: oscar_tiny\noutput_type: generate_until\ntest_split: test\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["Question:"]\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return data, tasks


def test_model_is_registered():
    assert get_model("oscar") is OscarLM


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_installed_plugin_registers_oscar_lazily_in_a_fresh_process():
    # the installed oscar_hf_lm_eval.pth registers a placeholder: no oscar_hf or torch import until asked
    out = run_python(
        "import sys, lm_eval.models\n"
        "from lm_eval.api.registry import get_model, model_registry\n"
        "print('oscar' in model_registry, 'oscar_hf' in sys.modules)\n"
        "print(get_model('oscar').__module__)"
    )
    assert out.split() == ["True", "False", "oscar_hf.evaluation.lm_eval_model"]


def test_stock_lm_eval_command_runs_the_oscar_model_offline(tmp_path, tok):
    # CI's smoke test of the wrapper: lm-eval's own command line, one task, two examples
    data, tasks = write_tiny_task(tmp_path)
    model_dir, include, out = tmp_path / "model", tmp_path / "include", tmp_path / "out"
    tiny_model("qwen3", vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    oscar_hf = Path(sys.executable).with_name("oscar-hf")
    subprocess.run(
        [str(oscar_hf), "lm-eval-tasks", "--data-dir", str(data), "--task-dir", str(tasks), "--out", str(include)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    command = [
        str(Path(sys.executable).with_name("lm_eval")),
        "--model",
        "oscar",
        "--model_args",
        f"pretrained={model_dir},method=quarot-int2,sink=4,recent=8,max_gen_toks=8,dtype=float32",
        "--include_path",
        str(include),
        "--tasks",
        "oscar_tiny",
        "--limit",
        "2",
        "--output_path",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [results_file] = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["oscar_tiny"]["effective"] == 2
    assert "exact_match,none" in results["results"]["oscar_tiny"]
    assert results["config"]["model_args"]["method"] == "quarot-int2"
    assert results["model_source"] == "oscar"


def test_eval_tasks_end_to_end_fresh_cache_resume_and_table(tmp_path, model, tok):
    data, tasks = write_tiny_task(tmp_path)
    recorder = GenerateRecorder(model)
    out = tmp_path / "out"
    common = dict(
        tasks=["tiny"],
        seeds=1,
        out_dir=out,
        limit=2,
        data_dir=data,
        max_gen_toks=12,
        sink=4,
        recent=8,
        task_dirs=[str(tasks)],
        progress=False,
        environment=provenance("test"),
    )
    summary = run_tasks(model, tok, methods=["none", "quarot-int2"], **common)

    # batch_size 1 and two questions: two generate calls per method, each with its own empty cache
    assert len(recorder.calls) == 4
    assert all(c["keyword_used"] and not c["other_keyword"] for c in recorder.calls)
    assert all(isinstance(c["cache"], OscarCache) for c in recorder.calls)
    assert all(c["cache_length_at_call"] == 0 for c in recorder.calls)
    assert len({id(c["cache"]) for c in recorder.calls}) == 4
    assert [c["cache"].oscar_config.method for c in recorder.calls] == ["none", "none", "quarot-int2", "quarot-int2"]
    # the prompts (~130 tokens) are longer than sink + recent, so quarot-int2 did quantize history
    assert recorder.calls[-1]["cache"].get_seq_length() > 4 + 8

    for method in ("none", "quarot-int2"):
        record = json.loads(run_path(out, RunKey(method, "tiny", 0)).read_text())
        assert record["lm_eval_task"] == "oscar_tiny" and record["n_samples"]["effective"] == 2
        assert [s["doc_id"] for s in record["samples"]] == [0, 1]
        assert record["command"] == "test"
    assert (out / "accuracy.png").stat().st_size > 0
    assert "| none |" in summary["table"] and "| quarot-int2 |" in summary["table"]

    # resume: finished runs are read back, not rerun; only the new method generates
    path = run_path(out, RunKey("quarot-int2", "tiny", 0))
    record = json.loads(path.read_text())
    record["score"] = 0.5
    path.write_text(json.dumps(record))
    recorder.calls.clear()
    summary = run_tasks(model, tok, methods=["none", "quarot-int2", "naive-int2"], **common)
    assert [c["cache"].oscar_config.method for c in recorder.calls] == ["naive-int2", "naive-int2"]
    rows = {r["method"]: r for r in summary["rows"]}
    assert rows["quarot-int2"]["tasks"]["tiny"]["mean"] == pytest.approx(50.0)
    assert rows["quarot-int2"]["drop_vs_bf16"] == pytest.approx(50.0 - rows["none"]["average"])
    table = (out / "table.md").read_text()
    assert "| quarot-int2 | 50.0 |" in table and "| naive-int2 |" in table
    assert rows["naive-int2"]["bpe"] == pytest.approx(
        bits_per_element(METHODS["naive-int2"].with_overrides(sink=4, recent=8), 131072, 16)
    )
    assert rows["none"]["bpe"] == 16
    assert rows["none"]["same_output_as_bf16"] == 1.0 and 0 <= rows["naive-int2"]["same_output_as_bf16"] <= 1

    # resuming with other settings would mix incomparable runs into one table
    with pytest.raises(ValueError, match="other settings"):
        run_tasks(model, tok, methods=["none"], **{**common, "max_gen_toks": 13})


def test_eval_tasks_gives_each_calibrated_method_its_own_set(tmp_path, model, tok):
    """The command line passes one rotation set per method (the bundled sets differ by recipe)."""
    from oscar_hf.rotations.rotation_set import RotationSet

    data, tasks = write_tiny_task(tmp_path)
    recorder = GenerateRecorder(model)
    sets = {
        "oscar-int2": RotationSet.hadamard(TINY_HEAD_DIM, [0, 1]),
        "oscar-k3v2": RotationSet.hadamard(TINY_HEAD_DIM, [0, 1]),
    }
    run_tasks(
        model,
        tok,
        methods=["oscar-int2", "oscar-k3v2"],
        tasks=["tiny"],
        seeds=1,
        out_dir=tmp_path / "out",
        limit=1,
        data_dir=data,
        max_gen_toks=4,
        rotations=sets,
        sink=4,
        recent=8,
        task_dirs=[str(tasks)],
        progress=False,
    )
    used = {c["cache"].oscar_config.method: c["cache"].rotations for c in recorder.calls}
    assert used["oscar-int2"] is sets["oscar-int2"] and used["oscar-k3v2"] is sets["oscar-k3v2"]


def test_stop_strings_only_after_think_end(tok):
    prompt = tok("Question: q\nAnswer:", return_tensors="pt")["input_ids"]
    text = "<think>Question: is it\n</think>The answer is 4.\nQuestion: next"
    ids = tok(text, return_tensors="pt")["input_ids"]
    criteria = StopAfterThinking(tok, ["Question:"], "</think>", prompt.shape[1], 1)
    stopped_at = None
    for n in range(1, ids.shape[1] + 1):
        if criteria(torch.cat([prompt, ids[:, :n]], dim=1), None)[0]:
            stopped_at = n
            break
    assert stopped_at is not None
    assert tok.decode(ids[0, :stopped_at]).endswith("Question:")
    assert tok.decode(ids[0, :stopped_at]).count("Question:") == 2  # the one inside <think> did not stop it
    # without the think-end token the first "Question:" would have stopped it
    plain = StopAfterThinking(tok, ["Question:"], "</never>", prompt.shape[1], 1)
    assert not any(bool(plain(torch.cat([prompt, ids[:, :n]], dim=1), None)[0]) for n in range(1, ids.shape[1] + 1))


def test_generate_until_with_think_end_token(model, tok):
    lm = OscarLM(
        pretrained=model,
        tokenizer=tok,
        method="quarot-int2",
        sink=4,
        recent=8,
        think_end_token="</think>",
        max_gen_toks=8,
    )
    recorder = GenerateRecorder(model)
    requests = [
        Instance(
            "generate_until",
            {},
            ("Question: hi\nAnswer:", {"until": ["Question:"], "max_gen_toks": 500}),
            idx,
            ("t", idx, 1),
        )
        for idx in range(2)
    ]
    out = lm.generate_until(requests, disable_tqdm=True)
    assert len(out) == 2 and lm.caches_created == 2 and len(recorder.calls) == 2
    assert all(isinstance(c["stopping_criteria"][0], StopAfterThinking) for c in recorder.calls)
    assert requests[0].args[1]["max_gen_toks"] == 8  # the cap wins over the task's 500


def test_loglikelihood_uses_a_fresh_cache_per_forward(model, tok):
    lm = OscarLM(pretrained=model, tokenizer=tok, method="quarot-int2", sink=4, recent=8)
    requests = [
        Instance(
            "loglikelihood", {}, ("Question: what colour is the sky on a clear day?\nAnswer:", " blue"), 0, ("t", 0, 1)
        )
    ]
    ((logprob, _),) = lm.loglikelihood(requests, disable_tqdm=True)
    assert lm.caches_created == 1 and logprob < 0
    ids = torch.tensor([tok("x" * 40 + "abc" * 20)["input_ids"]])
    with torch.no_grad():
        exact = model(ids).logits
    teacher = lm._model_call(ids)
    lm.loglikelihood_mode = "prefill"
    prefill = lm._model_call(ids)
    assert lm.caches_created == 3
    torch.testing.assert_close(prefill, exact, rtol=1e-4, atol=1e-4)  # a prompt sees its own K/V unquantized
    assert not torch.allclose(teacher[:, 20:], exact[:, 20:], atol=1e-3)  # later queries see INT2 history


def test_cli_parses_eval_tasks():
    args = build_parser().parse_args(
        [
            "eval",
            "tasks",
            "--methods",
            "none,oscar-int2",
            "--tasks",
            "gsm8k,aime25",
            "--limit",
            "3",
            "--seeds",
            "2",
            "--out",
            "x",
            "--temperature",
            "0.6",
        ]
    )
    assert args.methods == ["none", "oscar-int2"] and args.tasks == ["gsm8k", "aime25"]
    assert args.limit == 3 and args.seeds == 2 and args.temperature == 0.6


def test_gpqa_letter_and_code_runner():
    assert gpqa_letter("so... The answer is (C).") == "C"
    assert gpqa_letter("the answer is a number; (B) fits") == "B"
    assert gpqa_letter("no idea") == "[invalid]"
    assert run_program("assert 1 + 1 == 2\n") and not run_program("assert 1 + 1 == 3\n")
    assert not run_program("while True: pass\n", timeout_s=1)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="needs the evaluation data ($OSCAR_HF_DATA_DIR)")
def test_bundled_tasks_render_against_local_data(tmp_path):
    specs = available_tasks()
    assert {"aime25", "gpqa_diamond", "math500", "gsm8k", "humaneval"} <= set(specs)
    names = write_task_configs(list(specs.values()), SHARED_DATA, tmp_path)
    assert names["gsm8k"] == "oscar_gsm8k"
    for name in names.values():
        text = (tmp_path / f"{name}.yaml").read_text()
        assert "dataset_path: json" in text and str(SHARED_DATA.resolve()) in text
    # the HumanEval runner passes the canonical solution of problem 0 and fails an empty body
    with gzip.open(SHARED_DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as handle:
        doc = json.loads(handle.readline())
    assert run_program(humaneval_program(doc, doc["canonical_solution"]))
    assert not run_program(humaneval_program(doc, "    return None\n"))
