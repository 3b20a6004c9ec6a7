"""Sweep the fused write kernel's tile settings on a GPU for a prefill's worth of K and V rows.

    python kernels/tools/tune_quantize.py [--context 32768] [--feedback] [--out kernels/measurements]

One layer of a Qwen3-4B/8B-shaped prefill (batch 1, 8 KV heads, head_dim 128, bf16): K and V rows
quantized to INT2 in one launch (two jobs), as ``OscarLayer`` writes a prefill's middle part. Clip
ratios: off, the usual K 0.96 / V 0.92 (the threshold found by peeling maxima) and 0.5 (found by
bisection). Every setting's codes are checked bit-exact against the torch reference. Times are
``triton.testing.do_bench`` medians (CUDA events; each call also copies its small job table to the
device, as the cache's calls do, which rules out graph capture). With ``--feedback`` both jobs feed
their errors forward through a per-head factor (as keys of a set with key feedback do). Writes
``quantize_kernel_tuning.json`` and ``.md`` (``_feedback`` added with ``--feedback``) with command,
machine and date.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from oscar_hf.provenance import command_line, machine_line, provenance
from oscar_hf.quant import QuantizedRows, feedback_factor, quantize

CLIPS = {"off": (0.0, 0.0), "k0.96/v0.92": (0.96, 0.92), "0.5": (0.5, 0.5)}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def sweep(
    context: int, kv_heads: int, head_dim: int, blocks: tuple[int, ...], warps: tuple[int, ...], feedback: bool
) -> list[dict]:
    import triton.testing

    from oscar_hf.kernels.quantize_many import quantize_pack_many_triton

    sources = [(torch.randn(1, kv_heads, context, head_dim, device="cuda") * 3).bfloat16() for _ in range(2)]
    destinations = [
        QuantizedRows(
            torch.empty(1, kv_heads, context, head_dim // 4, dtype=torch.uint8, device="cuda"),
            *(torch.empty(1, kv_heads, context, 1, dtype=torch.bfloat16, device="cuda") for _ in range(2)),
        )
        for _ in range(2)
    ]
    factors = None
    if feedback:  # a factor of a random covariance per KV head
        samples = torch.randn(kv_heads, 4 * head_dim, head_dim, device="cuda")
        factors = [feedback_factor(samples.mT @ samples).contiguous() for _ in sources]
    read_bytes = sum(s.numel() * s.element_size() for s in sources)
    rows = []
    for (clip_name, ratios), block, num_warps in itertools.product(CLIPS.items(), blocks, warps):

        def run():
            quantize_pack_many_triton(
                sources,
                destinations,
                2,
                head_dim,
                False,
                list(ratios),
                torch.bfloat16,
                factors,
                block_rows=block,
                num_warps=num_warps,
            )

        run()
        exact = all(
            torch.equal(d.codes, quantize(s, 2, head_dim, clip_ratio=r, feedback=f).codes)
            for s, d, r, f in zip(sources, destinations, ratios, factors or [None, None])
        )
        us = triton.testing.do_bench(run, rep=100, return_mode="median") * 1e3
        rows.append(
            {
                "clip": clip_name,
                "block_rows": block,
                "num_warps": num_warps,
                "us": us,
                "gb_per_s": read_bytes / us / 1e3,
                "bit_exact": exact,
            }
        )
        print(f"clip {clip_name:12s} block {block:3d} warps {num_warps}: {us:9.1f} us  exact {exact}", flush=True)
    return rows


def to_markdown(info: dict, rows: list[dict]) -> str:
    lines = [
        f"Write-kernel tuning, {machine_line(info['machine'])}, {info['date']}",
        "",
        f"`{info['command']}`",
        "",
        f"One layer's K and V rows of a {info['context']}-token prefill (1 x {info['kv_heads']} KV heads x "
        f"head_dim {info['head_dim']}, bf16) to INT2 in one launch"
        + (", each row's error fed forward (key feedback)" if info.get("feedback") else "")
        + "; medians of do_bench.",
        "",
        "| clip | block rows | warps | µs | GB/s read | bit-exact |",
        "|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["clip"], r["us"])):
        lines.append(
            f"| {row['clip']} | {row['block_rows']} | {row['num_warps']} | {row['us']:.1f} | "
            f"{row['gb_per_s']:.0f} | {row['bit_exact']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--blocks", type=_ints, default=(4, 8, 16, 32))
    parser.add_argument("--warps", type=_ints, default=(1, 2, 4, 8))
    parser.add_argument("--feedback", action="store_true", help="feed errors forward through per-head factors")
    parser.add_argument("--out", type=Path, default=Path("kernels/measurements"))
    options = parser.parse_args()
    rows = sweep(options.context, options.kv_heads, options.head_dim, options.blocks, options.warps, options.feedback)
    info = {
        **provenance(command_line()),
        "context": options.context,
        "kv_heads": options.kv_heads,
        "head_dim": options.head_dim,
        "feedback": options.feedback,
    }
    options.out.mkdir(parents=True, exist_ok=True)
    stem = "quantize_kernel_tuning" + ("_feedback" if options.feedback else "")
    (options.out / f"{stem}.json").write_text(json.dumps({**info, "results": rows}, indent=1))
    (options.out / f"{stem}.md").write_text(to_markdown(info, rows))


if __name__ == "__main__":
    main()
