"""``oscar-hf demo``: the same long-prompt question answered with a BF16 cache and with OSCAR INT2."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from .cache import OscarCache
from .compat import cache_keyword
from .memory import MemoryReport
from .rotations import RotationSet

QUESTION = "According to the guide, what is the name of the lighthouse keeper's dog?"


def _document() -> str:
    return resources.files("oscar_hf").joinpath("assets/demo_document.txt").read_text(encoding="utf-8")


def demo_prompt(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """A ~1,500-token chat prompt whose answer sits in the middle of the document, i.e. in the INT2 history."""
    document = _document()
    messages = [{"role": "user", "content": f"{document}\n\n{QUESTION} Answer in one sentence."}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return encoded if isinstance(encoded, torch.Tensor) else encoded["input_ids"]


def filled_context(tokenizer: PreTrainedTokenizerBase, tokens: int, text_file: Path | None = None) -> torch.Tensor:
    """``[1, tokens]`` ids of a text file, or of the demo document repeated until long enough."""
    text = text_file.read_text(encoding="utf-8") if text_file else _document()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if ids.numel() < tokens and text_file is None:
        ids = ids.repeat(tokens // ids.numel() + 1)
    if ids.numel() < tokens:
        raise ValueError(f"{text_file} has {ids.numel()} tokens, fewer than {tokens}")
    return ids[:tokens][None]


@torch.no_grad()
def prefill_report(model: PreTrainedModel, input_ids: torch.Tensor, method: str, rotations: RotationSet | None) -> MemoryReport:
    """Prefill ``input_ids`` into a fresh cache of ``method`` and return its memory report."""
    cache = OscarCache(model, method, rotations=rotations)
    model(input_ids.to(model.device), use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
    return cache.memory_report()


class _StepClock(LogitsProcessor):
    """Timestamps every generation step: the first marks the end of prefill."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


@dataclass
class DemoRun:
    """One method's answer, timing and KV memory."""

    method: str
    answer: str
    new_tokens: int
    prefill_seconds: float
    decode_tokens_per_second: float
    memory: dict = field(default_factory=dict)


@torch.no_grad()
def run_method(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: torch.Tensor,
    method: str,
    rotations: RotationSet | None,
    max_new_tokens: int,
) -> DemoRun:
    """Greedy generation of ``prompt`` with a fresh cache of ``method``."""
    cache = OscarCache(model, method, rotations=rotations)
    clock = _StepClock()
    prompt = prompt.to(model.device)
    start = time.perf_counter()
    output = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([clock]),
        pad_token_id=tokenizer.pad_token_id,
        **{cache_keyword(model): cache},
    )
    new = output[0, prompt.shape[1] :]
    steps = len(clock.times) - 1
    decode_speed = steps / (clock.times[-1] - clock.times[0]) if steps else float("nan")
    return DemoRun(
        method=method,
        answer=tokenizer.decode(new, skip_special_tokens=True).strip(),
        new_tokens=int(new.numel()),
        prefill_seconds=round(clock.times[0] - start, 3),
        decode_tokens_per_second=round(decode_speed, 2),
        memory=cache.memory_report().summary(),
    )


def format_run(run: DemoRun) -> str:
    m = run.memory
    mib = 2**20
    return (
        f"[{run.method}] {run.answer}\n"
        f"  KV cache: {m['total_bytes'] / mib:.2f} MiB for {m['tokens']} tokens ({m['bits_per_element']:.2f} bits/element); "
        f"a DynamicCache in the model's dtype: {m['model_dtype_dynamic_cache_bytes'] / mib:.2f} MiB "
        f"(ratio {m['compression_vs_model_dtype']:.2f}x), in BF16: {m['bf16_dynamic_cache_bytes'] / mib:.2f} MiB "
        f"(ratio {m['compression_vs_bf16']:.2f}x)\n"
        f"  prefill {run.prefill_seconds:.2f} s, decode {run.decode_tokens_per_second:.1f} tokens/s"
    )
