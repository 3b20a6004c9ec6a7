"""The ``kernel`` benchmark: decode attention of one layer at the Qwen3-8B attention shape.

BF16 SDPA, the reference's path (torch dequantize + concatenate + SDPA) and our split-K Triton
kernel; eager and CUDA-graph-replayed time, bytes read and bandwidth, speedup vs SDPA, kernel vs
torch reference.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import oscar_hf.kernels.decode_attention as decode_attention
from oscar_hf.kernels._triton import HAS_TRITON, INTERPRET
from oscar_hf.kernels.testing import TIER_NAMES, shaped_inputs
from oscar_hf.quant import QuantizedRows, dequantize

from . import Benchmark
from .cases import add_speedups, guarded
from .models import DTYPES
from .report import Column, bars, figure, no_data, short_tokens, table
from .timing import kernel_times, tensor_bytes


def dense_inputs(config: dict, context: int, batch: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """A query ``[B, Hq, D]`` and BF16 K/V ``[B, Hkv, context, D]`` for SDPA."""
    shape, dtype = config["shape"], DTYPES[config["dtype"]]
    generator = torch.Generator(device).manual_seed(seed)
    kv_shape = (batch, shape["kv_heads"], context, shape["head_dim"])
    return {
        "q": torch.randn(batch, shape["q_heads"], shape["head_dim"], generator=generator, device=device, dtype=dtype),
        "k": torch.randn(kv_shape, generator=generator, device=device, dtype=dtype),
        "v": torch.randn(kv_shape, generator=generator, device=device, dtype=dtype),
    }


def sdpa_bf16(x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The BF16 baseline: SDPA of one query token over the whole dense K/V, GQA inside SDPA."""
    return F.scaled_dot_product_attention(x["q"][:, :, None], x["k"], x["v"], enable_gqa=True)


def dequantize_sdpa(x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The reference's decode path: dequantize the packed history, concatenate the tiers, SDPA."""
    dtype = x["q"].dtype

    def history(name: str, bits: int) -> torch.Tensor:
        rows = QuantizedRows(x[f"{name}_codes"], x[f"{name}_scale"], x[f"{name}_zero"])
        return dequantize(rows, bits, x["q"].shape[-1] // rows.scale.shape[-1], dtype)

    keys = torch.cat([x["sink_k"], history("k", config["k_bits"]), x["recent_k"], x["new_k"]], dim=2)
    values = torch.cat([x["sink_v"], history("v", config["v_bits"]), x["recent_v"], x["new_v"]], dim=2)
    return F.scaled_dot_product_attention(x["q"][:, :, None], keys, values, enable_gqa=True)


def oscar_triton(x: dict[str, torch.Tensor], config: dict, span_variant=None) -> torch.Tensor:
    """Our split-K kernel, reading the packed history directly (the launcher, not the dispatcher). The
    history was written before the kernel ahead of each call, as in a decode step (``history_settled``):
    on Hopper a call's span then starts copying it while that kernel, the call before's merge, runs.
    ``span_variant``: the Gluon span's development variant (``kernels/tools/``; None: production)."""
    tiers = [x[name] for name in TIER_NAMES]
    scale = x["q"].shape[-1] ** -0.5
    return decode_attention.decode_attention_triton(
        x["q"], *tiers, None, config["k_bits"], config["v_bits"], scale, history_settled=True, span_variant=span_variant
    )


KERNEL_METHODS: dict[str, tuple[Callable, Callable]] = {
    "sdpa_bf16": (sdpa_bf16, dense_inputs),
    "torch_dequant_sdpa": (dequantize_sdpa, shaped_inputs),
    "oscar_triton": (oscar_triton, shaped_inputs),
}


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run here, or None."""
    if not HAS_TRITON:
        return "Triton is not installed"
    if device.type != "cuda" and not INTERPRET:
        return "Triton kernels need CUDA (or TRITON_INTERPRET=1 set before import, on CPU)"
    return None


def check_kernel(x: dict[str, torch.Tensor], config: dict) -> dict:
    """The kernel's output against ``decode_attention_reference`` on the same inputs (bf16 tolerance)."""
    got = oscar_triton(x, config).float()
    try:
        tiers = decode_attention.DecodeTiers.from_flat(
            [x[name] for name in TIER_NAMES], config["k_bits"], config["v_bits"]
        )
        want = decode_attention.decode_attention_reference(x["q"], tiers).float()
    except torch.OutOfMemoryError:  # the float32 reference needs ~4x the dense K/V; the timing still counts
        return {"max_abs_err": None, "check": "reference ran out of memory"}
    tolerance = config["check"]
    error = (got - want).abs()
    ok = bool((error <= tolerance["atol"] + tolerance["rtol"] * want.abs()).all())
    return {"max_abs_err": float(error.max()), "check": "match" if ok else "MISMATCH"}


def input_copies(nbytes: int, device: torch.device, timing: dict) -> int:
    """Input sets to cycle through so that a graph replay reads at least ``l2_flush_bytes`` between reuses."""
    if device.type != "cuda":
        return 1
    return max(1, min(timing["max_copies"], math.ceil(timing["l2_flush_bytes"] / max(1, nbytes))))


def kernel_case(method: str, config: dict, context: int, batch: int, device: torch.device) -> dict:
    """Time one method at one shape: bytes read, eager and graph-replayed microseconds, bandwidth."""
    if method == "oscar_triton" and (reason := triton_unavailable(device)):
        return {"status": "skipped", "reason": reason}
    call, build = KERNEL_METHODS[method]
    first = build(config, context, batch, device, seed=0)
    nbytes = tensor_bytes(first.values())
    count = input_copies(nbytes, device, config["timing"])
    copies = [first] + [build(config, context, batch, device, seed=seed) for seed in range(1, count)]
    row = {"bytes_read": nbytes, "input_copies": len(copies)}
    if method == "oscar_triton":
        row.update(check_kernel(first, config))
    row.update(kernel_times([functools.partial(call, x, config) for x in copies], device, config["timing"]))
    best = row["graph_us"] or row["eager_us"]
    row["gb_per_s"] = nbytes / (best * 1e-6) / 1e9
    return row


def bench_kernel(config: dict) -> list[dict]:
    """One row per (context, batch, method), with its speedup over BF16 SDPA."""
    device = torch.device(config["device"])
    grid = [(c, b, m) for c in config["contexts"] for b in config["batches"] for m in config["methods"]]
    rows = []
    for context, batch, method in tqdm(grid, desc="kernel"):
        rows.append(
            guarded(
                {"context": context, "batch": batch, "method": method},
                lambda: kernel_case(method, config, context, batch, device),
            )
        )
    add_speedups(rows, ("context", "batch"), {"method": "sdpa_bf16"}, {"graph_us": False, "eager_us": False})
    return rows


KERNEL_COLUMNS: list[Column] = [
    ("context", "context", ""),
    ("batch", "batch", ""),
    ("method", "method", ""),
    ("graph µs", "graph_us", ".1f"),
    ("eager µs", "eager_us", ".1f"),
    ("MiB read", "bytes_read", "MiB"),
    ("GB/s", "gb_per_s", ".0f"),
    ("speedup vs SDPA (graph)", "speedup_graph_us", ".2f"),
    ("speedup vs SDPA (eager)", "speedup_eager_us", ".2f"),
    ("max abs err vs ref", "max_abs_err", ".2e"),
]


# Settings that merged runs of several shapes or widths mark their rows with (eval/bench_gpu.py's merge).
SETTING_COLUMNS: list[Column] = [("head_dim", "head_dim", ""), ("K bits", "k_bits", ""), ("V bits", "v_bits", "")]


def kernel_markdown(result: dict) -> str:
    """The kernel rows as one markdown table, with their head_dim and widths where runs of several are merged."""
    settings = [column for column in SETTING_COLUMNS if any(column[1] in row for row in result["cases"])]
    return table(result["cases"], KERNEL_COLUMNS[:3] + settings + KERNEL_COLUMNS[3:])


def _line_of(row: dict) -> str:
    """A row's method, with its head_dim and widths where the row carries them."""
    widths = f" K{row['k_bits']} V{row['v_bits']}" if "k_bits" in row and "v_bits" in row else ""
    head_dim = f" d{row['head_dim']}" if "head_dim" in row else ""
    return row["method"] + widths + head_dim


def kernel_plot(result: dict, path: Path) -> None:
    """Time vs context, one panel per batch, one line per method and widths (log y); bars at one context."""
    batches = result["config"]["batches"]
    ok = [r for r in result["cases"] if r.get("status") == "ok"]
    lines = list(dict.fromkeys(_line_of(r) for r in ok))
    one_context = len({r["context"] for r in ok}) == 1
    fig, axes = figure(len(batches))
    for ax, batch in zip(axes[0], batches):
        time_of = {
            (r["context"], _line_of(r)): r.get("graph_us") or r.get("eager_us") for r in ok if r["batch"] == batch
        }
        if not time_of:
            no_data(ax)
            continue
        ax.set_ylabel("µs per layer (graph replay, else eager)")
        if one_context:
            context = ok[0]["context"]
            bars(ax, lines, {"µs": [time_of.get((context, line)) for line in lines]}, ax.get_ylabel())
            ax.set_title(f"decode attention at {short_tokens(context)} tokens, batch {batch}")
            continue
        for line in lines:
            points = sorted((c, t) for (c, name), t in time_of.items() if name == line)
            if points:
                ax.plot(*zip(*points), marker="o", label=line)
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"decode attention, batch {batch}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


_TIMING = {
    "warmup_ms": 25,
    "rep_ms": 100,
    "graph_rep_ms": 100,
    "cpu_warmup": 1,
    "cpu_repeats": 5,
    "l2_flush_bytes": 256 * 2**20,
    "max_copies": 16,
}
DEFAULTS = {
    "device": "cuda",
    "dtype": "bfloat16",
    "shape": {"q_heads": 32, "kv_heads": 8, "head_dim": 128},
    "sink": 64,
    "recent": 256,
    "new": 1,
    "k_bits": 2,
    "v_bits": 2,
    "codes": "random",
    "contexts": [32768, 65536, 100000, 131072],
    "batches": [1, 8, 32],
    "methods": ["sdpa_bf16", "torch_dequant_sdpa", "oscar_triton"],
    "timing": _TIMING,
    "check": {"atol": 2e-2, "rtol": 2e-2},
}
BENCHMARK = Benchmark(bench_kernel, kernel_markdown, kernel_plot, DEFAULTS)
