"""Where a decode step's time goes: torch.profiler summary of a few steps per cache, same model and context.

    python -m eval.profile_decode [--model qwen3-8b] [--context 100000] [--batch 1] [--caches dynamic,oscar-int2]
    python -m eval.profile_decode --prefill --context 32768     # one prefill forward per cache instead
    python -m eval.profile_decode --python                      # host time by Python function (cProfile)

Builds the random-weight model of ``eval/bench_gpu.py``, fills each cache synthetically, then
profiles ``--steps`` single-token forwards (after warm-up) and prints, per cache: wall time per step,
summed CUDA kernel time per step, and the top operators by self CUDA and self CPU time. Also times
``generate`` of the same number of tokens on a fresh cache, to compare with the step loop. Writes
``<out>/profile_decode.json``. ``--python`` adds the host time by Python function of ``generate``'s steps (eager
batch-1 decoding is bound by it), profiled on their own, since cProfile slows every call it counts.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from eval.benchmarks.caches import attention_for, fill_cache, make_cache
from eval.benchmarks.cases import free_memory
from eval.benchmarks.decoding import decode_steps, generate
from eval.benchmarks.models import (
    add_model_arguments,
    build_model,
    random_rotations,
    random_tokens,
)
from eval.benchmarks.timing import median, model_devices, synchronize
from oscar_hf.core.compat import cache_keyword
from oscar_hf.model_info import full_attention_layer_ids, head_dim_of
from oscar_hf.provenance import command_line, provenance


def top_ops(prof, key: str, count: int) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:count]
    return [{"name": e.key[:90], "calls": e.count, f"{key}_us": round(getattr(e, key), 1)} for e in events]


def python_functions(run, steps: int, count: int) -> list[dict]:
    """The ``count`` Python functions (and builtins) with the most own host time in ``run()``, per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls_per_step": calls / steps,
            "own_us_per_step": round(own * 1e6 / steps, 1),
            "cumulative_us_per_step": round(total * 1e6 / steps, 1),
        }
        for (file, line, name), (_, calls, own, total, _) in rows
    ]


def profile_cache(
    model, cache_name: str, batch: int, context: int, steps: int, rotations, python: bool = False
) -> dict:
    model.set_attn_implementation(attention_for(cache_name))
    max_len = context + 2 * steps + 16

    def filled():
        cache = make_cache(cache_name, model, max_len, rotations)
        fill_cache(cache, model, batch, context, 65536)
        synchronize(model_devices(model))
        return cache

    cache = filled()
    decode_steps(model, cache, batch, 3, 0)  # warm-up, compiles kernels
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = decode_steps(model, cache, batch, 0, steps)
    kernels_us = sum(e.self_device_time_total for e in prof.key_averages())
    del cache
    free_memory()
    ids = random_tokens(model, batch, context + 1)
    host = {}
    if python:  # generate's steps, the path the e2e benchmark times
        cache = filled()
        host["python"] = python_functions(functools.partial(generate, model, cache, ids, steps), steps, 40)
        del cache
        free_memory()
    cache = filled()
    start = time.perf_counter()
    generate(model, cache, ids, steps)
    synchronize(model_devices(model))
    generate_ms = (time.perf_counter() - start) * 1e3
    del cache
    free_memory()
    return {
        "cache": cache_name,
        "step_ms_median": median(wall),
        "cuda_kernel_ms_per_step": kernels_us / steps / 1e3,
        "generate_ms_per_token": generate_ms / steps,
        "top_cuda": top_ops(prof, "self_device_time_total", 12),
        "top_cpu": top_ops(prof, "self_cpu_time_total", 30),
        **host,
    }


def profile_prefill(model, cache_name: str, batch: int, context: int, rotations) -> dict:
    """The same summary for one real prefill forward into a fresh cache (after a warm-up one)."""
    model.set_attn_implementation(attention_for(cache_name))
    ids = random_tokens(model, batch, context, seed=1)

    def forward() -> None:
        cache = make_cache(cache_name, model, context + 8, rotations)
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
        synchronize(model_devices(model))

    forward()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        forward()
        wall_ms = (time.perf_counter() - start) * 1e3
    free_memory()
    return {
        "cache": cache_name,
        "prefill_ms": wall_ms,
        "cuda_kernel_ms": sum(e.self_device_time_total for e in prof.key_averages()) / 1e3,
        "top_cuda": top_ops(prof, "self_device_time_total", 16),
        "top_cpu": top_ops(prof, "self_cpu_time_total", 30),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--caches", default="dynamic,oscar-int2")
    parser.add_argument("--prefill", action="store_true", help="profile one prefill of --context tokens instead")
    parser.add_argument(
        "--python", action="store_true", help="also profile the host time of generate's steps by Python function"
    )
    options = parser.parse_args()
    name, spec = options.model
    model = build_model(spec, options.device, torch.bfloat16)
    rotations = random_rotations(head_dim_of(model), full_attention_layer_ids(model))
    results = []
    for cache_name in options.caches.split(","):
        if options.prefill:
            result = profile_prefill(model, cache_name, options.batch, options.context, rotations)
            print(
                f"{cache_name}: prefill {result['prefill_ms']:.1f} ms (CUDA kernels {result['cuda_kernel_ms']:.1f} ms)"
            )
        else:
            result = profile_cache(
                model, cache_name, options.batch, options.context, options.steps, rotations, options.python
            )
            print(
                f"{cache_name}: step {result['step_ms_median']:.1f} ms (CUDA kernels {result['cuda_kernel_ms_per_step']:.1f} ms), "
                f"generate {result['generate_ms_per_token']:.1f} ms/token"
            )
        results.append(result)
        for op in result["top_cuda"][: 14 if options.prefill else 8]:
            print("   cuda", op)
        for op in result["top_cpu"][:6]:
            print("   cpu ", op)
        for function in result.get("python", [])[:25]:
            print("   py  ", function)
    options.out.mkdir(parents=True, exist_ok=True)
    info = {**provenance(command_line()), "model": name, "context": options.context, "batch": options.batch}
    stem = "profile_prefill" if options.prefill else "profile_decode"
    (options.out / f"{stem}.json").write_text(json.dumps({**info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
