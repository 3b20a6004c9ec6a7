"""The ``memory`` benchmark: KV bytes and peak memory at 128K, then the largest batch at 100K,
predicted from the measured caches and verified by running it, and the decode throughput there.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from oscar_hf import OscarCache
from oscar_hf.model_info import head_dim_of, text_config_of

from . import Benchmark
from .caches import attention_for, fill_cache, kv_bytes, make_cache
from .cases import add_speedups, first_line, free_memory, guarded
from .decoding import decode_steps
from .models import input_device, model_cases, model_rotations
from .report import Column, bars, figure, no_data, table
from .timing import median, synchronize, tensor_bytes


def allocated(device: torch.device) -> int | None:
    """Bytes allocated on ``device`` (None on CPU, where they are not counted)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def decode_peak(model: PreTrainedModel, cache, batch: int, steps: int) -> int | None:
    """Peak bytes allocated while decoding ``steps`` tokens (None on CPU)."""
    device = input_device(model)
    if device.type == "cuda":
        synchronize([device])
        torch.cuda.reset_peak_memory_stats(device)
    decode_steps(model, cache, batch, warmup=0, steps=steps)
    if device.type != "cuda":
        return None
    synchronize([device])
    return torch.cuda.max_memory_allocated(device)


def fill_probe(
    model: PreTrainedModel, cache_name: str, batch: int, context: int, chunk_rows: int, rotations, steps: int = 1
) -> dict:
    """Fill a fresh cache and decode ``steps`` tokens: KV bytes stored and allocated, step overhead, peak.

    ``kv_allocated_bytes`` is what the cache really holds after those steps, growth slack included
    (OscarCache's buffers grow geometrically when demoted rows join the history, every ``block``
    steps); ``step_overhead_bytes`` is the peak of the steps above that (activations, transients).
    """
    device = input_device(model)
    model.set_attn_implementation(attention_for(cache_name))
    free_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = allocated(device)
    cache = make_cache(cache_name, model, context + steps + 8, rotations)
    fill_cache(cache, model, batch, context, chunk_rows)
    synchronize([device])
    stored = kv_bytes(cache)
    fill_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    peak = decode_peak(model, cache, batch, steps)
    resident = allocated(device)
    elements = 2 * batch * context * len(cache.layers) * text_config_of(model).num_key_value_heads * head_dim_of(model)
    row = {
        "kv_bytes": stored,
        # on CPU, where allocations cannot be counted, the stored bytes stand in
        "kv_allocated_bytes": stored if before is None else resident - before,
        "step_overhead_bytes": None if peak is None else peak - resident,
        "decode_steps": steps,
        # weights + filled cache + the decode steps' transients (the synthetic fill's own peak is apart)
        "peak_bytes": peak,
        "fill_peak_bytes": fill_peak,
        "bits_per_element": 8 * stored / elements,
    }
    if isinstance(cache, OscarCache):
        row["compression_vs_bf16"] = round(cache.memory_report().compression, 3)
    return row


def predict_max_batch(per_sequence: int, fixed: int, budget: int) -> int:
    """Largest batch with ``fixed + batch * per_sequence <= budget``."""
    return max(0, (budget - fixed) // max(1, per_sequence))


def try_batch(model: PreTrainedModel, cache_name: str, batch: int, context: int, run: dict, rotations) -> dict:
    """Allocate, fill and decode at ``batch``: the verification of a predicted batch, with its step times."""
    try:
        model.set_attn_implementation(attention_for(cache_name))
        cache = make_cache(cache_name, model, context + run["warmup_steps"] + run["steps"] + 8, rotations)
        fill_cache(cache, model, batch, context, run["fill_chunk_rows"])
        times = decode_steps(model, cache, batch, run["warmup_steps"], run["steps"])
        outcome = {"batch": batch, "status": "ok", "step_ms": median(times)}
    except torch.OutOfMemoryError as error:
        outcome = {"batch": batch, "status": "oom", "error": first_line(error)}
    cache = None
    free_memory()
    return outcome


def max_batch_case(model: PreTrainedModel, cache_name: str, config: dict, rotations) -> dict:
    """Predict the largest batch at ``context`` from batch-1 and batch-2 probes, then verify it, stepping down on OOM.

    Memory model: weights + ``fixed`` + ``batch * (kv_per_sequence + activation_per_sequence)``. The
    probes decode as many steps as the verification does, so both the cache's growth and the step
    overhead (activations, a layer's transient copies) are measured, at batch 1 and 2.
    """
    run, context = config["max_batch"], config["max_batch"]["context"]
    device = input_device(model)
    probes = {
        b: fill_probe(
            model, cache_name, b, context, run["fill_chunk_rows"], rotations, steps=run["warmup_steps"] + run["steps"]
        )
        for b in (1, 2)
    }
    kv_per_sequence = max(probes[1]["kv_allocated_bytes"], probes[2]["kv_allocated_bytes"] // 2)
    overheads = [probes[b]["step_overhead_bytes"] or 0 for b in (1, 2)]
    activation_per_sequence = max(0, overheads[1] - overheads[0])
    fixed = max(0, overheads[0] - activation_per_sequence)
    free_memory()
    if run.get("budget_bytes"):
        budget = run["budget_bytes"]
    elif device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] - run["reserve_bytes"]  # free with only the weights resident
    else:
        return {"status": "skipped", "reason": "no device memory to size the batch by: set max_batch.budget_bytes"}
    predicted = predict_max_batch(kv_per_sequence + activation_per_sequence, fixed, budget)
    attempts, batch = [], predicted
    while batch >= 1 and len(attempts) < run["max_attempts"]:
        attempts.append(try_batch(model, cache_name, batch, context, run, rotations))
        if attempts[-1]["status"] == "ok":
            break
        batch -= max(1, math.ceil(batch * run["step_down"]))
    if run["probe_up"] and attempts and attempts[-1]["status"] == "ok" and attempts[0]["status"] == "ok":
        # the prediction held at once: does one more sequence fit too (i.e. was it conservative)?
        attempts.append(try_batch(model, cache_name, batch + 1, context, run, rotations))
    verified = max((a for a in attempts if a["status"] == "ok"), key=lambda a: a["batch"], default=None)
    row = {
        "kv_bytes_per_sequence": kv_per_sequence,
        "activation_bytes_per_sequence": activation_per_sequence,
        "fixed_step_bytes": fixed,
        "budget_bytes": budget,
        "predicted_batch": predicted,
        "attempts": attempts,
        "max_batch": verified["batch"] if verified else 0,
    }
    if verified:
        row.update(step_ms=verified["step_ms"], tokens_per_s=verified["batch"] * 1e3 / verified["step_ms"])
    return row


def memory_model(config: dict, name: str, model: PreTrainedModel) -> list[dict]:
    """One model's KV report rows, then its largest-batch rows, per cache."""
    rotations = model_rotations(model, config)
    weights = tensor_bytes(model.parameters())
    report = config["report"]
    rows = []
    for cache_name in tqdm(config["caches"], desc=f"memory {name}"):
        rows.append(
            guarded(
                {
                    "part": "report",
                    "model": name,
                    "cache": cache_name,
                    "context": report["context"],
                    "batch": report["batch"],
                    "weight_bytes": weights,
                },
                lambda: fill_probe(
                    model, cache_name, report["batch"], report["context"], report["fill_chunk_rows"], rotations
                ),
            )
        )
    for cache_name in tqdm(config["caches"], desc=f"max batch {name}"):
        rows.append(
            guarded(
                {
                    "part": "max_batch",
                    "model": name,
                    "cache": cache_name,
                    "context": config["max_batch"]["context"],
                    "weight_bytes": weights,
                },
                lambda: max_batch_case(model, cache_name, config, rotations),
            )
        )
    return rows


def bench_memory(config: dict) -> list[dict]:
    """Every configured model's rows, with KV ratios and throughput speedups over DynamicCache."""
    rows = model_cases(config, functools.partial(memory_model, config))
    report = [r for r in rows if r.get("part") == "report"]
    for row in report:
        base = next(
            (r for r in report if r["model"] == row["model"] and r["cache"] == "dynamic" and r.get("status") == "ok"),
            None,
        )
        if base and row.get("status") == "ok":
            row["kv_ratio_vs_bf16"] = round(base["kv_bytes"] / row["kv_bytes"], 3)
    add_speedups(
        [r for r in rows if r.get("part") == "max_batch"],
        ("model",),
        {"cache": "dynamic"},
        {"tokens_per_s": True, "max_batch": True},
    )
    return rows


MEMORY_COLUMNS: list[Column] = [
    ("model", "model", ""),
    ("cache", "cache", ""),
    ("context", "context", ""),
    ("batch", "batch", ""),
    ("KV GiB", "kv_bytes", "GiB"),
    ("KV allocated GiB", "kv_allocated_bytes", "GiB"),
    ("bits/element", "bits_per_element", ".2f"),
    ("BF16 / KV", "kv_ratio_vs_bf16", ".2f"),
    ("weights GiB", "weight_bytes", "GiB"),
    ("peak GiB (filled + decode step)", "peak_bytes", "GiB"),
]


MAX_BATCH_COLUMNS: list[Column] = [
    ("model", "model", ""),
    ("cache", "cache", ""),
    ("context", "context", ""),
    ("KV GiB / seq", "kv_bytes_per_sequence", "GiB"),
    ("activation GiB / seq", "activation_bytes_per_sequence", "GiB"),
    ("predicted batch", "predicted_batch", ""),
    ("verified max batch", "max_batch", ""),
    ("median step ms", "step_ms", ".2f"),
    ("tokens/s", "tokens_per_s", ".1f"),
    ("throughput vs BF16", "speedup_tokens_per_s", ".2f"),
]


def memory_markdown(result: dict) -> str:
    """The KV memory table, then the largest-batch table."""
    cases = result["cases"]
    paper = result["config"].get("paper")
    note = f"\n\nPaper: {paper}" if paper else ""
    return (
        "KV memory\n\n"
        + table([r for r in cases if r.get("part") != "max_batch"], MEMORY_COLUMNS)
        + "\n\nLargest batch (predicted from the measured caches, then run)\n\n"
        + table([r for r in cases if r.get("part") == "max_batch"], MAX_BATCH_COLUMNS)
        + note
    )


def memory_plot(result: dict, path: Path) -> None:
    """Largest verified batch and its decode throughput, per model and cache."""
    rows = [r for r in result["cases"] if r.get("part") == "max_batch"]
    models = sorted({r["model"] for r in rows})
    caches = result["config"]["caches"]
    fig, axes = figure(2)
    for ax, key, label in zip(axes[0], ("max_batch", "tokens_per_s"), ("largest batch", "decode tokens/s")):
        values = {(r["model"], r["cache"]): r.get(key) for r in rows}
        if models:
            bars(ax, models, {c: [values.get((m, c)) for m in models] for c in caches}, label)
            ax.set_title(f"{label} at {result['config']['max_batch']['context']} tokens")
        else:
            no_data(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


DEFAULTS = {
    "device": "cuda",
    "dtype": "bfloat16",
    "seed": 0,
    "models": ["qwen3-8b", "qwen3-4b"],
    "caches": ["dynamic", "oscar-int2"],
    "report": {"context": 131072, "batch": 1, "fill_chunk_rows": 65536},
    "max_batch": {
        "context": 100000,
        "reserve_bytes": 2 * 2**30,
        "budget_bytes": None,
        "step_down": 0.05,
        "max_attempts": 6,
        "probe_up": True,
        "warmup_steps": 2,
        "steps": 8,
        "fill_chunk_rows": 65536,
    },
}
BENCHMARK = Benchmark(bench_memory, memory_markdown, memory_plot, DEFAULTS)
