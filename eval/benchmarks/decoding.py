"""Timed decoding: ``generate`` calls, a synchronised single-step loop, and a step's memory roofline."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from oscar_hf import RotationSet
from oscar_hf.core.compat import cache_keyword
from oscar_hf.model_info import head_dim_of, text_config_of

from .caches import attention_for, kv_bytes, make_cache
from .cases import free_memory
from .models import input_device
from .report import Column
from .timing import elapsed_ms, median, model_devices, synchronize

# The decode timing of the e2e, graph and multigpu benchmarks, unless their config says otherwise.
DECODE_DEFAULTS = {"new_tokens": 32, "repeats": 3, "warmup_steps": 3, "steps": 16, "fill_chunk_rows": 65536}
MEASURED = "measured"  # a run's ``bandwidth_bytes_per_s``: BF16 SDPA's read rate on the run's GPU


def generate(
    model: PreTrainedModel, cache, input_ids: torch.Tensor, new_tokens: int, runner: Callable | None = None, **options
) -> torch.Tensor:
    """Greedy decoding of exactly ``new_tokens``; a filled cache makes generate run only the uncached tokens.

    ``runner`` is ``model.generate`` by default (or e.g. ``oscar_hf.generate`` bound to the model);
    ``options`` go to it. ``disable_compile`` defaults to True: generate would otherwise compile the
    forward for StaticCache on its own, and every cache must be timed running the same (eager) code
    unless a case asks for compilation.
    """
    options.setdefault("disable_compile", True)
    with torch.no_grad():
        return (runner or model.generate)(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **{cache_keyword(model): cache},
            **options,
        )


def generate_ms(model: PreTrainedModel, cache, input_ids: torch.Tensor, new_tokens: int, **options) -> float:
    """Time of one :func:`generate` call (options as there)."""
    return elapsed_ms(functools.partial(generate, model, cache, input_ids, new_tokens, **options), model_devices(model))


def decode_steps(model: PreTrainedModel, cache, batch: int, warmup: int, steps: int) -> list[float]:
    """Times (ms) of ``steps`` single-token forward passes after ``warmup``, each synchronised.

    Each step gets the all-ones attention mask ``generate`` passes, so both take the same attention
    path (without a mask, SDPA may pick a different backend for the BF16 caches).
    """
    device, devices = input_device(model), model_devices(model)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []

    def step() -> None:
        nonlocal token
        mask = torch.ones(batch, cache.get_seq_length() + 1, dtype=torch.long, device=device)
        logits = model(
            token, attention_mask=mask, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1
        ).logits
        token = logits[:, -1:].argmax(-1).to(device)

    with torch.no_grad():
        for index in range(warmup + steps):
            ms = elapsed_ms(step, devices)
            if index >= warmup:
                times.append(ms)
    return times


def first_and_second_calls(
    model: PreTrainedModel, filled: Callable[[], Any], input_ids: torch.Tensor, call_tokens: list[int]
) -> dict[str, float]:
    """tokens/s of a first and a second ``generate`` call of each length in ``call_tokens``, each on a
    fresh cache from ``filled()``: the first call of these shapes pays what is set up once (compiling,
    capturing), the second what every later call pays. Run before anything else of these shapes.
    Keys ``call<tokens>_first_tokens_per_s`` and ``call<tokens>_second_tokens_per_s``."""
    calls = {}
    for tokens in call_tokens:
        speeds = []
        for _ in range(2):
            cache = filled()
            speeds.append(input_ids.shape[0] * tokens * 1e3 / generate_ms(model, cache, input_ids, tokens))
            del cache
            free_memory()
        calls[f"call{tokens}_first_tokens_per_s"], calls[f"call{tokens}_second_tokens_per_s"] = speeds
    return calls


def sdpa_read_rate(device: torch.device) -> float:
    """Bytes per second at which BF16 SDPA reads a dense K/V on ``device``: one query token of the Qwen3-8B
    attention shape (32 query and 8 KV heads, head_dim 128) over 100,000 tokens at batch 4, 1.6 GB, far
    past any cache; the median of 10 calls. No BF16 decode step reads its K/V faster than this."""
    generator = torch.Generator(device).manual_seed(0)
    k = torch.randn(4, 8, 100_000, 128, generator=generator, device=device, dtype=torch.bfloat16)
    v, q = torch.randn_like(k), torch.randn(4, 32, 1, 128, generator=generator, device=device, dtype=k.dtype)
    call = functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)
    for _ in range(3):
        call()
    ms = median([elapsed_ms(call, [device]) for _ in range(10)])
    return 2 * k.numel() * k.element_size() / (ms * 1e-3)


def with_bandwidth(model: PreTrainedModel, run: dict) -> dict:
    """``run`` with its roofline rate in bytes/s: ``bandwidth_bytes_per_s`` as configured, or for ``"measured"``
    :func:`sdpa_read_rate` on the model's GPU, measured now, before any case fills the GPU (None on CPU, where
    no roofline is drawn)."""
    if run.get("bandwidth_bytes_per_s") != MEASURED:
        return run
    device = input_device(model)
    return {**run, "bandwidth_bytes_per_s": sdpa_read_rate(device) if device.type == "cuda" else None}


def dense_kv_bytes(model: PreTrainedModel, tokens: int, batch: int) -> int:
    """Bytes of an unquantized cache in the model's dtype (transformers' layout, BF16 in the benchmarks)
    holding ``tokens`` tokens of ``batch`` sequences in every layer; a sliding-window layer holds its window."""
    config = text_config_of(model)
    window, kinds = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    kinds = kinds or ["full_attention"] * config.num_hidden_layers
    rows = sum(min(tokens, window) if kind == "sliding_attention" and window else tokens for kind in kinds)
    return 2 * rows * batch * config.num_key_value_heads * head_dim_of(model) * model.dtype.itemsize


ROOFLINE_COLUMNS: list[Column] = [
    ("roofline ms", "roofline_ms", ".2f"),
    ("step / roofline", "step_over_roofline", ".2f"),
    ("BF16 roofline ms", "bf16_roofline_ms", ".2f"),
    ("step / BF16 roofline", "step_over_bf16_roofline", ".2f"),
]


def roofline_note(rows: list[dict]) -> str:
    """The sentence under a table that says at which read rate its rooflines are drawn."""
    rates = sorted({round(r["bandwidth_bytes_per_s"] / 1e9) for r in rows if r.get("bandwidth_bytes_per_s")})
    if not rates:
        return ""
    shown = f"{rates[0]:,} GB/s" if len(rates) == 1 else f"{rates[0]:,}-{rates[-1]:,} GB/s (each run measures its own)"
    return (
        f"\n\nRooflines at {shown}: BF16 SDPA's read rate on the run's GPU. The BF16 roofline is the step with a "
        "BF16 cache of the same context: no BF16 decoding is faster."
    )


def roofline(model: PreTrainedModel, cache_bytes: int, step_ms: float, run: dict, context: int, batch: int) -> dict:
    """A decode step's memory roofline: every weight and the whole KV cache read once at the run's rate
    (:func:`with_bandwidth`); beside it the same step's roofline with a BF16 cache of ``context`` tokens,
    the time no BF16 decoding can beat. Empty without a rate.

    All parameters count, though a step gathers only a few rows of an untied input embedding.
    """
    bandwidth = run.get("bandwidth_bytes_per_s")
    if not bandwidth:
        return {}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    roofline_ms = (weight_bytes + cache_bytes) / bandwidth * 1e3
    bf16_ms = (weight_bytes + dense_kv_bytes(model, context, batch)) / bandwidth * 1e3
    return {
        "bandwidth_bytes_per_s": bandwidth,
        "roofline_ms": roofline_ms,
        "step_over_roofline": step_ms / roofline_ms,
        "bf16_roofline_ms": bf16_ms,
        "step_over_bf16_roofline": step_ms / bf16_ms,
    }


def decode_case(
    model: PreTrainedModel,
    cache_name: str,
    fill: Callable[[Any], None],
    input_ids: torch.Tensor,
    run: dict,
    rotations: RotationSet | None,
    inspect: Callable[[Any], dict] | None = None,
) -> dict:
    """Decode throughput of one cache: a manual step loop (median step) and timed ``generate`` calls.

    ``fill(cache)`` brings a fresh cache to ``input_ids.shape[1] - 1`` tokens (synthetic K/V or a real
    prefill, excluded from the timing); every timed ``generate`` gets a fresh cache, since it
    mutates it. The step loop's warm-up also warms up generate. ``inspect(cache)`` runs on the
    cache after the step loop and adds its entries to the row.
    """
    batch, context = input_ids.shape[0], input_ids.shape[1] - 1
    new_tokens, call_tokens = run["new_tokens"], run.get("call_new_tokens", [])
    max_len = context + max(new_tokens, run["warmup_steps"] + run["steps"], *call_tokens) + 8
    model.set_attn_implementation(attention_for(cache_name))

    def filled():
        cache = make_cache(cache_name, model, max_len, rotations)
        fill(cache)
        synchronize(model_devices(model))
        return cache

    timed_calls = call_tokens if cache_name in run.get("call_caches", [cache_name]) else []
    row = first_and_second_calls(model, filled, input_ids, timed_calls)
    cache = filled()
    row["kv_bytes"] = kv_bytes(cache)
    steps = decode_steps(model, cache, batch, run["warmup_steps"], run["steps"])
    if inspect is not None:
        row.update(inspect(cache))
    del cache
    free_memory()
    generate_times = []
    for _ in range(run["repeats"]):
        cache = filled()
        generate_times.append(generate_ms(model, cache, input_ids, new_tokens))
        del cache
        free_memory()
    step_ms, total_ms = median(steps), median(generate_times)
    return {
        **row,
        **roofline(model, row["kv_bytes"], step_ms, run, context, batch),
        "step_ms": step_ms,
        "step_tokens_per_s": batch * 1e3 / step_ms,
        "generate_ms": total_ms,
        "tokens_per_s": batch * new_tokens * 1e3 / total_ms,
        "generate_ms_all": generate_times,
    }
