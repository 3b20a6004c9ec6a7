"""``oscar-hf demo``: one long-prompt question answered with the uncompressed cache and with 2-bit ones, compared."""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources
from itertools import zip_longest
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from oscar_hf.config import METHODS
from oscar_hf.core.cache import OscarCache
from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.memory import MemoryReport, bits_per_element
from oscar_hf.model_info import head_dim_of
from oscar_hf.rotations.rotation_set import MethodRotations, rotations_for

QUESTION = "According to the guide, what is the name of the lighthouse keeper's dog?"
PROJECTED_TOKENS = (32 * 1024, 128 * 1024)
# On CUDA, once the warm-up has compiled the layers and kernels, plain generate freezes a new cache and
# captures the step at its first decode step (oscar_hf.core.step_replay): a one-time cost, timed apart.
SETUP_STEPS = 1


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
def prefill_report(
    model: PreTrainedModel, input_ids: torch.Tensor, method: str, rotations: MethodRotations
) -> MemoryReport:
    """Prefill ``input_ids`` into a fresh cache of ``method`` and return its memory report."""
    cache = OscarCache(model, method, rotations=rotations_for(rotations, method))
    model(input_ids.to(model.device), use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
    return cache.memory_report()


class _StepClock(LogitsProcessor):
    """Timestamps every generation step (the first marks the end of prefill) and keeps the cache's memory
    report right after prefill."""

    def __init__(self, cache: OscarCache) -> None:
        self.cache = cache
        self.times: list[float] = []
        self.prefill_memory: MemoryReport | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:  # the step's kernels must have finished for its time to count
            torch.cuda.synchronize(scores.device)
        self.times.append(time.perf_counter())
        if self.prefill_memory is None:
            self.prefill_memory = self.cache.memory_report()
        return scores


@dataclass
class DemoRun:
    """One method's answer, timings and KV memory right after prefill.

    On a GPU ``setup_seconds`` is the first decode step, which freezes the cache and captures the step
    (None on CPU, where nothing is captured); ``decode_tokens_per_second`` counts the
    decode steps after them (None: too few to time).
    """

    method: str
    answer: str
    new_tokens: int
    prefill_seconds: float
    setup_seconds: float | None
    decode_tokens_per_second: float | None
    memory: MemoryReport

    def to_dict(self) -> dict:
        return {**{k: v for k, v in vars(self).items() if k != "memory"}, "memory": self.memory.summary()}


@torch.no_grad()
def run_method(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: torch.Tensor,
    method: str,
    rotations: MethodRotations,
    max_new_tokens: int,
) -> DemoRun:
    """Greedy generation of ``prompt`` with a fresh cache of ``method``."""
    cache = OscarCache(model, method, rotations=rotations_for(rotations, method))
    clock = _StepClock(cache)
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
    times = clock.times
    setup = SETUP_STEPS if prompt.is_cuda else 0
    timed = len(times) - 1 - setup
    return DemoRun(
        method=method,
        answer=tokenizer.decode(new, skip_special_tokens=True).strip(),
        new_tokens=int(new.numel()),
        prefill_seconds=round(times[0] - start, 3),
        setup_seconds=round(times[setup] - times[0], 3) if setup and len(times) > setup else None,
        decode_tokens_per_second=round(timed / (times[-1] - times[setup]), 2) if timed > 0 else None,
        memory=clock.prefill_memory,
    )


@dataclass
class Demo:
    """Every method's run on the demo prompt; ``runs[0]`` is the uncompressed reference (``none``)."""

    prompt_tokens: int
    head_dim: int
    device: str
    dtype: str
    runs: list[DemoRun]
    warmup_seconds: dict[str, float]

    def memory_rows(self) -> list[dict]:
        """KV bytes per method with BF16 windows, as a GPU holds them: at this prompt (measured) and at
        PROJECTED_TOKENS (projected from the same layers)."""
        rows = [
            {
                "tokens": self.prompt_tokens,
                "measured": True,
                "bytes": {run.method: run.memory.in_bf16().total_bytes for run in self.runs},
            }
        ]
        for tokens in PROJECTED_TOKENS:
            rows.append(
                {
                    "tokens": tokens,
                    "measured": False,
                    "bytes": {
                        run.method: run.memory.projected_bytes(METHODS[run.method], tokens, self.head_dim)
                        for run in self.runs
                    },
                }
            )
        return rows

    def to_dict(self) -> dict:
        reference = self.runs[0].answer
        return {
            "prompt_tokens": self.prompt_tokens,
            "device": self.device,
            "dtype": self.dtype,
            "warmup_seconds": self.warmup_seconds,
            "kv_memory_bf16": self.memory_rows(),
            "runs": [
                {**run.to_dict(), "same_answer_as_none": first_difference(reference, run.answer) is None}
                for run in self.runs
            ],
        }


def run_demo(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    methods: list[str],
    rotations: MethodRotations,
    max_new_tokens: int,
    warm_up: bool | None = None,
) -> Demo:
    """Answer the demo question with ``none`` and then each of ``methods``.

    ``warm_up`` (None: on CUDA) first runs each cache on the same prompt for a few tokens, so that the
    timed runs leave out kernel compilation; its time is reported apart.
    """
    prompt = demo_prompt(tokenizer)
    methods = ["none", *(m for m in methods if m != "none")]
    if warm_up is None:
        warm_up = model.device.type == "cuda"
    warmup_seconds = {}
    if warm_up:
        for method in methods:
            start = time.perf_counter()
            run_method(model, tokenizer, prompt, method, rotations, SETUP_STEPS + 2)
            warmup_seconds[method] = round(time.perf_counter() - start, 3)
    runs = [run_method(model, tokenizer, prompt, method, rotations, max_new_tokens) for method in methods]
    head_dim = head_dim_of(model)
    return Demo(
        prompt.shape[1], head_dim, str(model.device), str(model.dtype).removeprefix("torch."), runs, warmup_seconds
    )


def first_difference(reference: str, answer: str) -> tuple[int, str, str] | None:
    """``(word number from 1, reference's word, answer's word)`` where two answers first differ word by word,
    None where they agree."""
    pairs = zip_longest(reference.split(), answer.split(), fillvalue="(nothing)")
    return next(((i, ref, ans) for i, (ref, ans) in enumerate(pairs, 1) if ref != ans), None)


def _describe(method: str, dtype: str) -> str:
    config = METHODS[method]
    if not config.quantized:
        return f"uncompressed, {dtype}"
    if config.key.bits == config.value.bits:
        return f"{config.key.bits}-bit cache"
    return f"{config.key.bits}-bit keys, {config.value.bits}-bit values"


def _answers(demo: Demo) -> list[str]:
    reference = demo.runs[0].answer
    lines = []
    for run in demo.runs:
        lines += [f"{run.method} ({_describe(run.method, demo.dtype)}):", f"  {' '.join(run.answer.split())}"]
        if run is not demo.runs[0]:
            difference = first_difference(reference, run.answer)
            lines.append(
                "  Same answer as none: yes."
                if difference is None
                else f'  Same answer as none: NO. Word {difference[0]} is "{difference[2]}" '
                f'where none says "{difference[1]}".'
            )
    return lines


def _size(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _memory(demo: Demo) -> list[str]:
    rows = demo.memory_rows()
    labels = [f"{row['tokens']:,} tokens ({'this prompt' if row['measured'] else 'projected'})" for row in rows]
    width = max(map(len, labels)) + 2
    lines = [
        f"KV-cache memory as a GPU holds it (BF16 windows; none = an uncompressed BF16 cache), head_dim {demo.head_dim}:",
        f"  {'':<18}" + "".join(f"{label:<{width}}" for label in labels),
    ]
    for run in demo.runs:
        cells = []
        for row in rows:
            size, none = row["bytes"][run.method], row["bytes"]["none"]
            cells.append(_size(size) + ("" if run.method == "none" else f" ({none / size:.1f}x smaller)"))
        lines.append(f"  {run.method:<18}" + "".join(f"{cell:<{width}}" for cell in cells))
    return lines + _head_dim_note(demo)


def _head_dim_note(demo: Demo) -> list[str]:
    """Why the ratio at 128K differs from a head_dim-128 model's (per-token metadata is spread over head_dim)."""
    quantized = [run.method for run in demo.runs if METHODS[run.method].quantized]
    if demo.head_dim == 128 or not quantized:
        return []
    method = "oscar-int2" if "oscar-int2" in quantized else quantized[0]
    config, tokens = METHODS[method], PROJECTED_TOKENS[-1]
    here, wide = bits_per_element(config, tokens, demo.head_dim), bits_per_element(config, tokens, 128)
    return [
        f"  Each quantized token carries a 16-bit scale and zero per head, spread over head_dim channels: at "
        f"{tokens:,} tokens {method} takes {here:.2f} bits per element here (head_dim {demo.head_dim}) "
        f"and {wide:.2f} at head_dim 128, {16 / wide:.1f}x smaller than BF16 (e.g. Qwen3-8B)."
    ]


def _speed(demo: Demo) -> list[str]:
    if demo.warmup_seconds:
        warm = "; ".join(f"{m} {s:.1f} s" for m, s in demo.warmup_seconds.items())
        lines = [
            f"Speed on {demo.device} ({demo.dtype}), after a warm-up run of each cache that compiled its "
            f"layers and kernels ({warm}):"
        ]
    else:
        lines = [f"Speed on {demo.device} ({demo.dtype}):"]
    for run in demo.runs:
        setup = "" if run.setup_seconds is None else f", first decode step {run.setup_seconds:.2f} s"
        decode = (
            "too few tokens to time decoding"
            if run.decode_tokens_per_second is None
            else f"{'then ' if setup else ''}decode {run.decode_tokens_per_second:.1f} tokens/s"
        )
        lines.append(f"  {run.method:<18}prefill {run.prefill_seconds:.2f} s{setup}, {decode}")
    if demo.device.startswith("cuda"):
        lines.append("  (the first decode step of a new cache freezes it and captures the step in a CUDA graph)")
    elif any(METHODS[run.method].quantized for run in demo.runs):
        lines.append(
            "  On a CPU the quantized caches run the torch reference, which dequantizes the history at every "
            "step, so they decode slower than none; on a GPU the decode kernels read the packed history "
            "directly and attend faster than an uncompressed cache."
        )
    return lines


def format_demo(demo: Demo) -> str:
    """The demo as a short report: both answers and whether they agree, KV memory, speed."""
    window = METHODS["oscar-int2"]
    head = [
        f"A {demo.prompt_tokens:,}-token prompt: a document, then this question. The answer is in the middle of "
        f"the document; a 2-bit cache keeps only the first {window.sink} and last {window.recent} tokens "
        "uncompressed.",
        f"  {QUESTION}",
    ]
    return "\n".join(head + [""] + _answers(demo) + [""] + _memory(demo) + [""] + _speed(demo))
