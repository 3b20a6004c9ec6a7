"""Every ``oscar-hf`` command and the README's Quickstart, run as a user without Triton runs them.

Each command runs in its own Python process on the real default model (SmolLM2-135M-Instruct,
CPU), with the smallest real arguments, for ``none`` and a calibrated method, and with Triton
hidden: the README's install (the CPU wheel of torch) has no Triton, while the test environment
does. A command passes when it exits 0 with no traceback and prints what it exists to print.
Data the commands read (a haystack, GSM8K-style questions) is written here, in the formats of
the public sets, so that the test needs no data folder.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

# Makes every import of triton fail as it does where Triton is not installed.
HIDE_TRITON = """
import importlib.abc, sys

class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTriton())
"""
CHECK_NO_TRITON = """
from oscar_hf.kernels import _triton
assert not _triton.HAS_TRITON and not any(m.split(".")[0] == "triton" for m in sys.modules), "Triton was imported"
"""
RUN_OSCAR_HF = "from oscar_hf.cli.main import main\nmain(sys.argv[1:])\n"
RUN_LM_EVAL = "import runpy\nsys.argv[0] = 'lm_eval'\nrunpy.run_module('lm_eval', run_name='__main__')\n"


def run_without_triton(code: str, *args: str, cwd: Path) -> str:
    """Run ``code`` (with ``args`` as ``sys.argv[1:]``) in a new interpreter without Triton; its stdout."""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TRITON_INTERPRET", "OSCAR_KERNELS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [sys.executable, "-c", HIDE_TRITON + code + CHECK_NO_TRITON, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, f"{' '.join(args)} failed:\n{output[-6000:]}"
    return result.stdout


def oscar_hf(*args: str, cwd: Path) -> str:
    return run_without_triton(RUN_OSCAR_HF, *args, cwd=cwd)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A data folder as the commands expect one: a haystack and GSM8K-style questions."""
    folder = tmp_path_factory.mktemp("data")
    document = resources.files("oscar_hf").joinpath("assets/demo_document.txt").read_text(encoding="utf-8")
    (folder / "niah_paul_graham_essays").mkdir()
    (folder / "niah_paul_graham_essays" / "guide.txt").write_text("\n\n".join([document] * 3), encoding="utf-8")
    (folder / "text.txt").write_text("\n\n".join([document] * 6), encoding="utf-8")
    (folder / "gsm8k").mkdir()
    questions = [
        (
            f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
            f"Tom has {a} + {b} = {a + b} apples.\n#### {a + b}",
        )
        for a, b in [(3, 4), (5, 2), (7, 1), (2, 9), (6, 6), (4, 8)]
    ]
    rows = [json.dumps({"question": q, "answer": a}) + "\n" for q, a in questions]
    (folder / "gsm8k" / "train.jsonl").write_text("".join(rows[:5]))
    (folder / "gsm8k" / "test.jsonl").write_text("".join(rows[5:]))
    return folder


METHODS = "none,oscar-int2"


def test_demo(tmp_path):
    out = oscar_hf("demo", "--methods", "oscar-int2", "--max-new-tokens", "8", cwd=tmp_path)
    assert re.search(r"^none \(uncompressed.*\):\n  \S", out, flags=re.MULTILINE), out
    assert re.search(r"^oscar-int2 \(.*\):\n  \S.*\n  Same answer as none: (yes|NO)", out, flags=re.MULTILINE), out


def test_memory(tmp_path):
    out = oscar_hf("memory", "--tokens", "512", "--methods", METHODS, cwd=tmp_path)
    assert "## none" in out and "## oscar-int2" in out and "512 tokens" in out


def test_calibrate_then_evaluate_with_the_new_set(tmp_path, data):
    rotations = tmp_path / "rotations"
    out = oscar_hf(
        "calibrate",
        "--data",
        str(data / "text.txt"),
        "--tokens",
        "1024",
        "--seq-len",
        "512",
        "--out",
        str(rotations),
        cwd=tmp_path,
    )
    assert (rotations / "rotations.safetensors").is_file() and (rotations / "config.json").is_file(), out
    out = oscar_hf(
        "eval",
        "kl",
        "--rotations",
        str(rotations),
        "--text",
        str(data / "text.txt"),
        "--ctx",
        "512",
        "--windows",
        "1",
        "--methods",
        METHODS,
        "--json",
        cwd=tmp_path,
    )
    scores = {s["method"]: s for s in json.loads(out)["scores"]}
    assert scores["none"]["kl_from_none"] == 0 and scores["oscar-int2"]["kl_from_none"] > 0


def test_eval_kl(tmp_path, data):
    out = oscar_hf(
        "eval",
        "kl",
        "--text",
        str(data / "text.txt"),
        "--ctx",
        "512",
        "--windows",
        "1",
        "--methods",
        METHODS,
        cwd=tmp_path,
    )
    assert "| none |" in out and "| oscar-int2 |" in out


def test_eval_kl_curve(tmp_path, data):
    stem = tmp_path / "curve"
    out = oscar_hf(
        "eval",
        "kl-curve",
        "--text",
        str(data / "text.txt"),
        "--ctx",
        "512",
        "--windows",
        "1",
        "--bucket",
        "128",
        "--methods",
        METHODS,
        "--out",
        str(stem),
        cwd=tmp_path,
    )
    assert "oscar-int2" in out
    assert all(stem.with_suffix(suffix).stat().st_size > 0 for suffix in (".json", ".md", ".png"))


def test_eval_niah(tmp_path, data):
    stem = tmp_path / "niah"
    out = oscar_hf(
        "eval",
        "niah",
        "--data-dir",
        str(data),
        "--lengths",
        "1024",
        "--depths",
        "50",
        "--needles",
        "1",
        "--methods",
        METHODS,
        "--out",
        str(stem),
        cwd=tmp_path,
    )
    assert "oscar-int2" in out
    result = json.loads(stem.with_suffix(".json").read_text())
    assert {t["method"] for t in result["trials"]} == {"none", "oscar-int2"}


def test_eval_tasks(tmp_path, data):
    out_dir = tmp_path / "tasks"
    out = oscar_hf(
        "eval",
        "tasks",
        "--data-dir",
        str(data),
        "--tasks",
        "gsm8k",
        "--limit",
        "1",
        "--max-gen-toks",
        "8",
        "--methods",
        METHODS,
        "--out",
        str(out_dir),
        cwd=tmp_path,
    )
    assert "| none |" in out and "| oscar-int2 |" in out
    assert sorted(p.name for p in (out_dir / "runs").iterdir()) == [
        "none__gsm8k__seed0.json",
        "oscar-int2__gsm8k__seed0.json",
    ]


def test_lm_eval_tasks_and_the_lm_eval_command_it_prints(tmp_path, data):
    tasks = tmp_path / "lm_eval_tasks"
    out = oscar_hf("lm-eval-tasks", "--data-dir", str(data), "--out", str(tasks), cwd=tmp_path)
    [printed] = [line.strip() for line in out.splitlines() if line.strip().startswith("lm_eval ")]
    assert "method=oscar-int2" in printed and "--tasks oscar_gsm8k" in printed
    args = printed.split()[1:] + ["--gen_kwargs", "max_gen_toks=8", "--output_path", str(tmp_path / "out")]
    args[args.index("--limit") + 1] = "1"
    run_without_triton(RUN_LM_EVAL, *args, cwd=tmp_path)
    [results] = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(results.read_text())["n-samples"]["oscar_gsm8k"]["effective"] == 1


def quickstart() -> str:
    """The README's Quickstart snippet."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)


def test_readme_quickstart(tmp_path):
    out = run_without_triton("\n" + quickstart(), cwd=tmp_path)
    assert "oscar-int2" in out and "bits/element" in out
