"""The ``graph`` benchmark: decode steps eager and replayed from a CUDA graph.

Per-step decode time of eager DynamicCache, StaticCache under transformers' compiled generate, eager
OscarCache and OscarCache with its step captured in a CUDA graph (``oscar_hf.StaticDecoder``), each
beside its memory roofline; ``oscar_hf.generate`` tokens/s; and a profiler summary of one captured step.

A cache name here is one of :mod:`.caches`, optionally followed by ``+graph`` (its decode steps
replayed from a CUDA graph; OscarCache: ``oscar_hf.StaticDecoder``), then ``+compile`` (the decoder
layers compiled inside the captured step) or ``+autotune`` (compiled with mode
"max-autotune-no-cudagraphs": Inductor times its GEMMs), then ``+fused``
(``StaticDecoder(fuse_projections=True)``: stacked q/k/v and gate/up GEMMs).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

import oscar_hf
from oscar_hf import RotationSet, StaticDecoder
from oscar_hf.core.compat import cache_keyword

from . import Benchmark
from .caches import attention_for, fill_cache, kv_bytes, make_cache, model_for, synthetic_fill
from .cases import add_speedups, free_memory, guarded
from .decoding import (
    DECODE_DEFAULTS,
    ROOFLINE_COLUMNS,
    decode_steps,
    dense_kv_bytes,
    generate_ms,
    roofline,
    roofline_note,
    with_bandwidth,
)
from .models import input_device, model_cases, model_rotations, random_tokens
from .report import Column, bars, figure, no_data, short_tokens, table
from .timing import elapsed_ms, median, model_devices, synchronize

GRAPH_SUFFIX = "+graph"
COMPILE_SUFFIXES = {"+compile": True, "+autotune": "max-autotune-no-cudagraphs"}
FUSED_SUFFIX = "+fused"


def graph_variant(cache_name: str) -> tuple[str, bool, dict]:
    """``"<cache>[+graph[+compile|+autotune][+fused]]"`` -> (cache name for :func:`model_for`, captured,
    the ``compile`` and ``fuse_projections`` arguments of :class:`oscar_hf.StaticDecoder`)."""
    base, graph, rest = cache_name.partition(GRAPH_SUFFIX)
    compiled, fused = rest.removesuffix(FUSED_SUFFIX), rest.endswith(FUSED_SUFFIX)
    if compiled and compiled not in COMPILE_SUFFIXES:
        raise ValueError(
            f"cache {cache_name!r}: after {GRAPH_SUFFIX!r} comes nothing or one of "
            f"{list(COMPILE_SUFFIXES)}, then optionally {FUSED_SUFFIX!r}"
        )
    return base, bool(graph), {"compile": COMPILE_SUFFIXES.get(compiled, False), "fuse_projections": fused}


def static_decoder(model: PreTrainedModel, cache, capacity: int, options: dict) -> StaticDecoder:
    """Captured on CUDA; elsewhere (the CPU smoke test) the same static steps run eagerly. ``options``:
    :func:`graph_variant`'s keyword arguments."""
    return StaticDecoder(model, cache, capacity, capture=input_device(model).type == "cuda", **options)


def graph_decode_steps(model: PreTrainedModel, decoder: StaticDecoder, batch: int, warmup: int, steps: int) -> dict:
    """Times (ms) of single-token steps through :class:`oscar_hf.StaticDecoder`, each synchronised.

    The first step freezes the cache and runs eagerly, the second captures the graph; both are part
    of ``warmup``.
    """
    device, devices = input_device(model), model_devices(model)
    cache = decoder.cache
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []

    def step() -> None:
        nonlocal token
        logits = decoder.step({"input_ids": token, cache_keyword(model): cache})
        token = logits[:, -1:].argmax(-1)

    for index in range(max(warmup, 2) + steps):
        ms = elapsed_ms(step, devices)
        if index >= max(warmup, 2):
            times.append(ms)
    captured = decoder.graph is not None
    decoder.stop()
    return {"step_ms_all": times, "captured": captured}


def graph_case(
    model: PreTrainedModel,
    method: str,
    captured: bool,
    options: dict,
    context: int,
    batch: int,
    run: dict,
    rotations: RotationSet | None,
) -> dict:
    """One cache's median decode step over a synthetic ``context`` (and generate tokens/s where cheap)."""
    capacity = context + run["warmup_steps"] + run["steps"] + run["new_tokens"] + 16
    model.set_attn_implementation(attention_for(method))
    fill = synthetic_fill(model, batch, context, run["fill_chunk_rows"])
    ids = random_tokens(model, batch, context + 1)

    def filled():
        cache = make_cache(method, model, capacity, rotations, preallocate=captured)
        fill(cache)
        synchronize(model_devices(model))
        return cache

    cache = filled()
    row = {"kv_bytes": kv_bytes(cache)}
    if captured:
        decoder = static_decoder(model, cache, capacity, options)
        row.update(graph_decode_steps(model, decoder, batch, run["warmup_steps"], run["steps"]))
        del decoder
    else:
        row["step_ms_all"] = decode_steps(model, cache, batch, run["warmup_steps"], run["steps"])
    del cache
    free_memory()
    if captured or method == "dynamic":  # the user-facing loop: generate's own sampling and stopping
        times = []
        for _ in range(run["repeats"] + 1):  # the first call warms up (compiles and captures)
            cache = filled()
            fast = dict(runner=functools.partial(oscar_hf.generate, model), **options) if captured else {}
            times.append(generate_ms(model, cache, ids, run["new_tokens"], **fast))
            del cache
            free_memory()
        row["generate_tokens_per_s"] = batch * run["new_tokens"] * 1e3 / median(times[1:])
    row["step_ms"] = median(row["step_ms_all"])
    return {**row, **roofline(model, row["kv_bytes"], row["step_ms"], run, context, batch)}


def compiled_static_case(model: PreTrainedModel, context: int, batch: int, run: dict) -> dict:
    """StaticCache under transformers' compiled generate: a step is the time difference of two lengths.

    Compilation and graph capture happen in the first call, which is not timed.
    """
    short, long = run["compiled_new_tokens"]
    capacity = context + long + 16
    model.set_attn_implementation("sdpa")
    fill = synthetic_fill(model, batch, context, run["fill_chunk_rows"])
    ids = random_tokens(model, batch, context + 1)
    times: dict[int, list[float]] = {short: [], long: []}
    for index, tokens in enumerate([short] + [short, long] * run["repeats"]):
        cache = make_cache("static", model, capacity, None)
        fill(cache)
        ms = generate_ms(model, cache, ids, tokens, disable_compile=False)  # StaticCache: transformers compiles
        if index:
            times[tokens].append(ms)
        del cache
        free_memory()
    step_ms = (median(times[long]) - median(times[short])) / (long - short)
    cache_bytes = dense_kv_bytes(model, capacity, batch)
    return {
        "step_ms": step_ms,
        "kv_bytes": cache_bytes,
        "generate_ms_by_tokens": times,
        **roofline(model, cache_bytes, step_ms, run, context, batch),
    }


def profile_graph_step(
    model: PreTrainedModel, method: str, options: dict, context: int, batch: int, run: dict, rotations
) -> list[dict]:
    """Where a captured OscarCache step spends its GPU time: kernels by total time over replays."""
    from torch.profiler import ProfilerActivity, profile

    capacity = context + 64
    model.set_attn_implementation("oscar")
    cache = make_cache(method, model, capacity, rotations, preallocate=True)
    fill_cache(cache, model, batch, context, run["fill_chunk_rows"])
    device = input_device(model)
    decoder = static_decoder(model, cache, capacity, options)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    for _ in range(3):  # freeze, capture, replay once
        decoder.step({"input_ids": token, cache_keyword(model): cache})
    steps = run["profile_steps"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize([device])
    with profile(activities=activities) as trace:
        for _ in range(steps):
            decoder.step({"input_ids": token, cache_keyword(model): cache})
        synchronize([device])
    decoder.stop()
    events = [e for e in trace.key_averages() if e.device_time_total > 0] if device.type == "cuda" else []
    gpu_us = sum(e.device_time_total for e in events) / steps  # kernels only (self times), no overlap
    rows = [
        {
            "part": "profile",
            "kernel": e.key[:90],
            "calls_per_step": e.count / steps,
            "us_per_step": e.device_time_total / steps,
            "share": e.device_time_total / steps / gpu_us,
        }
        for e in sorted(events, key=lambda e: -e.device_time_total)[: run["profile_top"]]
    ]
    return [{"part": "profile", "kernel": "(all kernels)", "us_per_step": gpu_us, "share": 1.0}, *rows]


def graph_model(config: dict, name: str, model: PreTrainedModel) -> list[dict]:
    """One model's decode rows per (context, batch, cache), compiled StaticCache rows and the profile rows."""
    rotations = model_rotations(model, config)
    run, rows = with_bandwidth(model, config["decode"]), []
    grid = [(c, b, k) for c in config["contexts"] for b in config["batches"] for k in config["caches"]]
    for context, batch, cache_name in tqdm(grid, desc=f"graph {name}"):

        def measure() -> dict:
            base, captured, options = graph_variant(cache_name)
            with model_for(model, base, rotations) as method:
                return graph_case(model, method, captured, options, context, batch, run, rotations)

        rows.append(
            guarded({"part": "decode", "model": name, "context": context, "batch": batch, "cache": cache_name}, measure)
        )
    compiled = config["compiled_static"]
    if name in compiled["models"]:
        for context, batch in [(c, b) for c in compiled["contexts"] for b in compiled["batches"]]:
            rows.append(
                guarded(
                    {"part": "decode", "model": name, "context": context, "batch": batch, "cache": "static+compiled"},
                    lambda: compiled_static_case(model, context, batch, run),
                )
            )
    profiled = config["profile"]
    if name == profiled["model"]:
        holder: list = []
        base, _, options = graph_variant(profiled["cache"])

        def trace() -> dict:
            with model_for(model, base, rotations) as method:
                holder.extend(
                    profile_graph_step(
                        model, method, options, profiled["context"], profiled["batch"], {**run, **profiled}, rotations
                    )
                )
            return {}

        row = guarded(
            {
                "part": "profile",
                "model": name,
                "context": profiled["context"],
                "batch": profiled["batch"],
                "cache": profiled["cache"],
            },
            trace,
        )
        if holder:
            rows.extend({**row, **entry} for entry in holder)
        else:
            rows.append(row)
    return rows


def bench_graph(config: dict) -> list[dict]:
    """Every configured model's rows, with step and generate speedups over DynamicCache."""
    rows = model_cases(config, functools.partial(graph_model, config))
    decode = [r for r in rows if r.get("part") == "decode"]
    add_speedups(
        decode, ("model", "context", "batch"), {"cache": "dynamic"}, {"step_ms": False, "generate_tokens_per_s": True}
    )
    return rows


GRAPH_COLUMNS: list[Column] = [
    ("model", "model", ""),
    ("context", "context", ""),
    ("batch", "batch", ""),
    ("cache", "cache", ""),
    ("median step ms", "step_ms", ".2f"),
    ("speedup vs Dynamic", "speedup_step_ms", ".2f"),
    *ROOFLINE_COLUMNS,
    ("generate tokens/s", "generate_tokens_per_s", ".1f"),
    ("generate vs Dynamic", "speedup_generate_tokens_per_s", ".2f"),
    ("KV GiB", "kv_bytes", "GiB"),
]


PROFILE_COLUMNS: list[Column] = [
    ("kernel", "kernel", ""),
    ("calls per step", "calls_per_step", ".1f"),
    ("µs per step", "us_per_step", ".1f"),
    ("share of kernel time", "share", ".1%"),
]


def graph_markdown(result: dict) -> str:
    """The decode-step table, then the captured step's profile if there is one."""
    cases = result["cases"]
    decode = [r for r in cases if r.get("part") != "profile"]
    text = (
        "Decode step (synthetic context; eager rows: transformers' forward per step; `+graph`: one CUDA "
        "graph replay per step)\n\n" + table(decode, GRAPH_COLUMNS) + roofline_note(decode)
    )
    profile = [r for r in cases if r.get("part") == "profile"]
    if profile:
        p = result["config"]["profile"]
        text += (
            f"\n\nWhere a captured OscarCache step spends its GPU time ({p['model']}, {p['cache']}, "
            f"{short_tokens(p['context'])}, batch {p['batch']}; torch.profiler over {p['profile_steps']} "
            "replays)\n\n" + table(profile, PROFILE_COLUMNS)
        )
    return text


def graph_plot(result: dict, path: Path) -> None:
    """Median step ms per (model, context, batch), one bar per cache, a black tick at each bar's roofline."""
    decode = [r for r in result["cases"] if r.get("part") == "decode"]
    groups = sorted({(r["model"], r["context"], r["batch"]) for r in decode})
    caches = list(dict.fromkeys(r["cache"] for r in decode))
    rows = {(r["model"], r["context"], r["batch"], r["cache"]): r for r in decode}
    fig, axes = figure(width=max(7.0, 1.4 * len(groups)), height=5.5)
    ax = axes[0][0]
    if not groups:
        no_data(ax)
    else:
        series = {k: [rows.get((*g, k), {}).get("step_ms") for g in groups] for k in caches}
        bars(ax, [f"{m} {short_tokens(c)} b{b}" for m, c, b in groups], series, "ms per decode step")
        width = 0.8 / len(caches)
        for index, cache in enumerate(caches):
            for group_index, group in enumerate(groups):
                roof = rows.get((*group, cache), {}).get("roofline_ms")
                if roof:
                    x = group_index + index * width
                    ax.hlines(roof, x - width / 2, x + width / 2, color="black", linewidth=2)
        ax.set_yscale("log")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, fontsize="small")
        ax.set_title("decode step: eager vs CUDA graph (log scale; black: memory roofline)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


DEFAULTS = {
    "device": "cuda",
    "dtype": "bfloat16",
    "seed": 0,
    "models": ["qwen3-8b", "qwen3-4b"],
    "contexts": [32768, 65536, 100000],
    "batches": [1, 8],
    "caches": ["dynamic", "oscar-int2", "oscar-int2+graph"],
    "decode": {**DECODE_DEFAULTS, "compiled_new_tokens": [8, 24], "bandwidth_bytes_per_s": None},
    "compiled_static": {"models": [], "contexts": [100000], "batches": [1, 8]},
    "profile": {
        "model": "qwen3-8b",
        "cache": "oscar-int2+graph",
        "context": 100000,
        "batch": 1,
        "profile_steps": 5,
        "profile_top": 15,
    },
}
BENCHMARK = Benchmark(bench_graph, graph_markdown, graph_plot, DEFAULTS)
