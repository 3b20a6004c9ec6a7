"""The ``e2e`` benchmark: ``model.generate`` on random-weight Qwen3-4B/8B shapes over a synthetically
filled cache (DynamicCache, StaticCache, OscarCache), plus a real 32K prefill (the quantize-on-write cost).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from oscar_hf import release_captured_steps
from oscar_hf.core.compat import cache_keyword

from . import Benchmark
from .caches import attention_for, make_cache, model_for, synthetic_fill
from .cases import add_speedups, free_memory, guarded, median_round
from .decoding import DECODE_DEFAULTS, ROOFLINE_COLUMNS, decode_case, generate, roofline_note, with_bandwidth
from .models import model_cases, model_rotations, random_tokens
from .report import Column, bars, figure, no_data, short_tokens, table
from .timing import elapsed_ms, median, model_devices


def prefill_case(model: PreTrainedModel, cache_name: str, context: int, batch: int, run: dict, rotations) -> dict:
    """Median time of a real prefill forward (``logits_to_keep=1``) into a fresh cache."""
    model.set_attn_implementation(attention_for(cache_name))
    ids = random_tokens(model, batch, context, seed=1)

    def once() -> float:
        cache = make_cache(cache_name, model, context + 8, rotations)
        forward = functools.partial(model, ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
        with torch.no_grad():
            ms = elapsed_ms(forward, model_devices(model))
        del forward, cache
        free_memory()
        return ms

    for _ in range(run["warmup"]):
        once()
    times = [once() for _ in range(run["repeats"])]
    return {
        "prefill_ms": median(times),
        "prefill_tokens_per_s": batch * context * 1e3 / median(times),
        "prefill_ms_all": times,
    }


def short_generations_case(model: PreTrainedModel, cache_name: str, run: dict, rotations) -> dict:
    """Wall time of ``prompts`` greedy generations one after another, each of ``new_tokens`` tokens from a
    prompt of random length in ``prompt_tokens`` (a real prefill) into a fresh cache: what lm-eval's
    ``--model oscar`` does for a generation task, one request at a time. The first round also sets up
    what the process sets up once (compiling, capturing); caches in ``second_round`` run a second."""
    model.set_attn_implementation(attention_for(cache_name))
    release_captured_steps()
    low, high = run["prompt_tokens"]
    lengths = torch.randint(low, high + 1, (run["prompts"],), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [random_tokens(model, 1, length, seed=index) for index, length in enumerate(lengths)]

    def all_prompts() -> float:
        def once() -> None:
            for ids in prompts:
                cache = make_cache(cache_name, model, ids.shape[1] + run["new_tokens"] + 8, rotations)
                generate(model, cache, ids, run["new_tokens"])

        return elapsed_ms(once, model_devices(model))

    first = all_prompts()
    wall = all_prompts() if cache_name in run.get("second_round", []) else first
    return {
        "short_first_round_s": first / 1e3,
        "short_wall_s": wall / 1e3,
        "short_tokens_per_s": run["prompts"] * run["new_tokens"] * 1e3 / wall,
    }


def e2e_model(config: dict, name: str, model: PreTrainedModel) -> list[dict]:
    """Decode rows per (context, batch, cache), then the prefill rows.

    ``decode.rounds`` > 1 measures the caches of a (context, batch) in turn, round after round, and
    reports each cache's median round: eager decoding is bound by host time, which drifted by 2x
    between device calls and would otherwise favour whichever cache ran in a fast stretch.
    """
    rotations = model_rotations(model, config)
    run, rows = with_bandwidth(model, config["decode"]), []
    rounds = run.get("rounds", 1)
    grid = [
        (c, b, r, k)
        for c in config["contexts"]
        for b in config["batches"]
        for r in range(rounds)
        for k in config["caches"]
    ]
    measured: dict[tuple, list[dict]] = {}
    for context, batch, _, cache_name in tqdm(grid, desc=f"e2e {name}"):

        def measure() -> dict:
            release_captured_steps()  # a case's second calls replay the step of its first, no other
            ids = random_tokens(model, batch, context + 1)
            fill = synthetic_fill(model, batch, context, run["fill_chunk_rows"])
            with model_for(model, cache_name, rotations) as method:
                return decode_case(model, method, fill, ids, run, rotations)

        measured.setdefault((context, batch, cache_name), []).append(
            guarded({"part": "decode", "model": name, "context": context, "batch": batch, "cache": cache_name}, measure)
        )
    rows += [median_round(results) for results in measured.values()]
    short = config.get("short_generations")
    for cache_name in tqdm(short["caches"] if short else [], desc=f"short generations {name}"):
        rows.append(
            guarded(
                {
                    "part": "short",
                    "model": name,
                    "cache": cache_name,
                    "prompts": short["prompts"],
                    "new_tokens": short["new_tokens"],
                },
                lambda: short_generations_case(model, cache_name, short, rotations),
            )
        )
    prefill = config["prefill"]
    for cache_name in tqdm(prefill["caches"], desc=f"prefill {name}"):
        rows.append(
            guarded(
                {
                    "part": "prefill",
                    "model": name,
                    "context": prefill["context"],
                    "batch": prefill["batch"],
                    "cache": cache_name,
                },
                lambda: prefill_case(model, cache_name, prefill["context"], prefill["batch"], prefill, rotations),
            )
        )
    return rows


def bench_e2e(config: dict) -> list[dict]:
    rows = model_cases(config, functools.partial(e2e_model, config))
    decode = [r for r in rows if r.get("part") == "decode"]
    add_speedups(decode, ("model", "context", "batch"), {"cache": "dynamic"}, {"tokens_per_s": True, "step_ms": False})
    prefill = [r for r in rows if r.get("part") == "prefill"]
    add_speedups(prefill, ("model",), {"cache": "dynamic"}, {"prefill_ms": False})
    return rows


E2E_COLUMNS: list[Column] = [
    ("model", "model", ""),
    ("context", "context", ""),
    ("batch", "batch", ""),
    ("cache", "cache", ""),
    ("tokens/s (generate)", "tokens_per_s", ".1f"),
    ("median step ms", "step_ms", ".2f"),
    ("tokens/s at the median step", "step_tokens_per_s", ".1f"),
    ("speedup vs Dynamic", "speedup_tokens_per_s", ".2f"),
    ("KV GiB", "kv_bytes", "GiB"),
    *ROOFLINE_COLUMNS,
]


PREFILL_COLUMNS: list[Column] = [
    ("model", "model", ""),
    ("context", "context", ""),
    ("batch", "batch", ""),
    ("cache", "cache", ""),
    ("prefill ms", "prefill_ms", ".1f"),
    ("tokens/s", "prefill_tokens_per_s", ".0f"),
    ("speedup vs Dynamic", "speedup_prefill_ms", ".2f"),
]


def call_columns(call_tokens: list[int]) -> list[Column]:
    """tokens/s of a first and a second ``generate`` call per length (:func:`first_and_second_calls`)."""
    return [
        (f"tokens/s {n} new, {which} call", f"call{n}_{which}_tokens_per_s", ".1f")
        for n in call_tokens
        for which in ("first", "second")
    ]


SHORT_COLUMNS: list[Column] = [
    ("model", "model", ""),
    ("cache", "cache", ""),
    ("prompts", "prompts", ""),
    ("new tokens each", "new_tokens", ""),
    ("first round s", "short_first_round_s", ".1f"),
    ("wall time s (a later round)", "short_wall_s", ".1f"),
    ("tokens/s", "short_tokens_per_s", ".1f"),
]


def e2e_markdown(result: dict) -> str:
    cases = result["cases"]
    columns = E2E_COLUMNS + call_columns(result["config"]["decode"].get("call_new_tokens", []))
    sections = [
        ("Decoding", "decode", columns),
        (
            "Short generations (a fresh cache and a real prefill each, as lm-eval's generation tasks run)",
            "short",
            SHORT_COLUMNS,
        ),
        ("Prefill (real forward, quantize-on-write included)", "prefill", PREFILL_COLUMNS),
    ]
    tables = [(title, [r for r in cases if r.get("part") == part], cols) for title, part, cols in sections]
    return "\n\n".join(f"{title}\n\n{table(rows, cols)}{roofline_note(rows)}" for title, rows, cols in tables if rows)


def e2e_plot(result: dict, path: Path) -> None:
    """Decode tokens/s per (model, context, batch), one bar per cache."""
    decode = [r for r in result["cases"] if r.get("part") == "decode"]
    groups = sorted({(r["model"], r["context"], r["batch"]) for r in decode}, key=lambda g: (g[0], g[1], g[2]))
    caches = result["config"]["caches"]
    value = {(r["model"], r["context"], r["batch"], r["cache"]): r.get("tokens_per_s") for r in decode}
    fig, axes = figure(width=max(6.0, 0.9 * len(groups)))
    if not groups:
        no_data(axes[0][0])
    else:
        bars(
            axes[0][0],
            [f"{m} {short_tokens(c)} b{b}" for m, c, b in groups],
            {k: [value.get((*g, k)) for g in groups] for k in caches},
            "decode tokens/s",
        )
        axes[0][0].set_title("end-to-end decoding (random weights, synthetic context)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


DEFAULTS = {
    "device": "cuda",
    "dtype": "bfloat16",
    "seed": 0,
    "models": ["qwen3-4b", "qwen3-8b"],
    "contexts": [32768, 65536, 100000],
    "batches": [1, 8],
    "caches": ["dynamic", "static", "oscar-int2"],
    "decode": DECODE_DEFAULTS,
    "prefill": {"context": 32768, "batch": 1, "warmup": 1, "repeats": 3, "caches": ["dynamic", "oscar-int2"]},
}
BENCHMARK = Benchmark(bench_e2e, e2e_markdown, e2e_plot, DEFAULTS)
