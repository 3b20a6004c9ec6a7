"""Shared fixtures: tiny random-weight models (no downloads) and helpers; kernel tests in the interpreter's own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import oscar_hf  # noqa: F401  (registers the "oscar" attention)
from oscar_hf.core.compat import cache_keyword

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def tiny_model(arch: str, seed: int = 0, attn: str = "oscar", **config_overrides):
    """A tiny random-weight Llama or Qwen3 (``config_overrides`` change its config, e.g. ``attention_bias``)."""
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **config_overrides}))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, "use_sliding_window": False, **config_overrides}))
    else:
        raise ValueError(arch)
    model.eval()
    model.generation_config.pad_token_id = 0
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(params=["llama", "qwen3"])
def tiny(request):
    return tiny_model(request.param)


def saved_tiny_model(tmp_path):
    """A tiny Llama saved with the default model's tokenizer, and a calibration text beside it, for
    ``oscar-hf calibrate --model DIR``: (model folder, text file)."""
    from transformers import AutoTokenizer

    from oscar_hf.core.models import _default_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(_default_checkpoint())
    model_dir = tmp_path / "model"
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, calibration_text(tmp_path / "text.txt", lines=200)


def calibration_text(path: Path, lines: int = 400) -> Path:
    """A calibration text of ``lines`` numbered sentences written to ``path``; returns ``path``."""
    path.write_text(
        " ".join(f"Line {i}: the harbour, the bridge and the cliffs of the northern coast." for i in range(lines))
    )
    return path


def run_calibrate(model: str | Path, data: Path, tokens: int, seq_len: int, out: Path, *options: str) -> None:
    """``oscar-hf calibrate --model MODEL --data DATA --tokens N --seq-len L OPTIONS --out OUT``, in this process."""
    from oscar_hf.cli.main import main

    main(
        ["calibrate", "--model", str(model), "--data", str(data), "--tokens", str(tokens), "--seq-len", str(seq_len)]
        + [*options, "--out", str(out)]
    )


def generate(model, input_ids, cache, **kwargs):
    """``model.generate`` with the cache passed under the installed transformers' keyword."""
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", 24)
    kwargs.setdefault("min_new_tokens", kwargs["max_new_tokens"])
    with torch.no_grad():
        return model.generate(input_ids, **{cache_keyword(model): cache}, **kwargs)


def forward(model, input_ids, cache, **kwargs):
    with torch.no_grad():
        return model(input_ids, **{cache_keyword(model): cache}, use_cache=True, **kwargs)


# Test modules that run Triton kernels: on a machine without CUDA they need Triton's interpreter, which
# TRITON_INTERPRET=1 selects only when set before Triton is first imported (by transformers, here). So
# unless this process already has it, each runs in a pytest process of its own that starts with it.
INTERPRETED_MODULES = ("test_kernels.py",)


def _needs_own_process(path: Path) -> bool:
    return (
        path.name in INTERPRETED_MODULES and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    )


class InterpretedModule(pytest.File):
    """A test module run whole in its own ``TRITON_INTERPRET=1`` pytest process: one item here."""

    def collect(self):
        yield InterpretedRun.from_parent(self, name="under TRITON_INTERPRET=1")


class InterpretedRun(pytest.Item):
    def runtest(self) -> None:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(self.path)]
        if self.config.getoption("maxfail"):  # -x and --maxfail N carry over
            command.append(f"--maxfail={self.config.getoption('maxfail')}")
        done = subprocess.run(
            command,
            env={**os.environ, "TRITON_INTERPRET": "1"},
            cwd=self.config.rootpath,
            capture_output=True,
            text=True,
        )
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        self.user_properties.append(("summary", summary))
        if done.returncode != 0:
            raise InterpretedFailure(done.stdout[-20000:] + done.stderr[-5000:])

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, InterpretedFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name} under TRITON_INTERPRET=1"


class InterpretedFailure(Exception):
    """The module's own pytest process failed; its output is the report."""


def pytest_pycollect_makemodule(module_path: Path, parent):
    if _needs_own_process(module_path):
        return InterpretedModule.from_parent(parent, path=module_path)
    return None


def pytest_terminal_summary(terminalreporter) -> None:
    for report in terminalreporter.stats.get("passed", []):
        for key, value in report.user_properties:
            if key == "summary":
                terminalreporter.write_line(f"{report.nodeid}: {value}")
