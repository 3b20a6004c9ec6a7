"""``oscar-hf demo``: the same long-prompt question answered with a BF16 cache and with OSCAR INT2."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import resources

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from .cache import OscarCache
from .compat import cache_keyword
from .rotations import RotationSet

QUESTION = "According to the guide, what is the name of the lighthouse keeper's dog?"


def demo_prompt(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """A ~1,500-token chat prompt whose answer sits in the middle of the document, i.e. in the INT2 history."""
    document = resources.files("oscar_hf").joinpath("assets/demo_document.txt").read_text(encoding="utf-8")
    messages = [{"role": "user", "content": f"{document}\n\n{QUESTION} Answer in one sentence."}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return encoded if isinstance(encoded, torch.Tensor) else encoded["input_ids"]


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
    return (
        f"[{run.method}] {run.answer}\n"
        f"  KV cache: {m['total_bytes'] / 2**20:.2f} MiB for {m['tokens']} tokens, {m['bits_per_element']} bits/element; "
        f"{m['compression_vs_model_dtype']}x smaller than a DynamicCache in the model's dtype "
        f"({m['model_dtype_dynamic_cache_bytes'] / 2**20:.2f} MiB), {m['compression_vs_bf16']}x smaller than BF16\n"
        f"  prefill {run.prefill_seconds:.2f} s, decode {run.decode_tokens_per_second:.1f} tokens/s"
    )
