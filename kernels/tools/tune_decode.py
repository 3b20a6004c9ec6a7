"""Sweep the decode-attention kernel's tile and split settings on a GPU; check each against the reference.

    python kernels/tools/tune_decode.py [--context 100000] [--batches 1,8,32] [--out kernels/measurements]

Qwen3-8B attention shape (32 query heads, 8 KV heads, head_dim 128), bf16, INT2 K and V, one layer.
Times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median), so they are the
kernels' device time without Python launch overhead; BF16 SDPA over the same context is measured
in the same run. Writes ``decode_kernel_tuning.json`` and ``.md`` with command, machine and date.
The best setting per batch feeds the launcher's defaults (``kernels/decode_launch.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import oscar_hf.kernels.decode_attention as kernels
from oscar_hf.kernels.testing import TIER_NAMES, shaped_inputs
from oscar_hf.provenance import command_line, machine_line, provenance

REPO = Path(__file__).resolve().parents[2]
# The kernel benchmark's shape and tiers (Qwen3-8B attention, sink 64, recent 256, random INT2 codes).
CONFIG = json.loads((REPO / "eval" / "configs" / "bench_kernel.json").read_text())


def inputs(context: int, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``q`` and the tiers by name (``TIER_NAMES``) at the kernel benchmark's shape, on the GPU."""
    return shaped_inputs(CONFIG, context, batch, "cuda", seed)


# The sweep's default grid; each axis can be narrowed or widened on the command line.
GRID = {"block_n": "32,64,128", "warps": "1,2,4,8", "stages": "2,3", "programs_per_sm": "2,4,8"}


def splits_for(programs_per_sm: int, batch: int) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, programs_per_sm * sms // (batch * CONFIG["shape"]["kv_heads"]))


def time_graph(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3  # microseconds


def sweep(batch: int, context: int, grid: dict[str, tuple[int, ...]]) -> dict:
    x = inputs(context, batch)
    args, scale = [x["q"], *(x[name] for name in TIER_NAMES)], CONFIG["shape"]["head_dim"] ** -0.5
    want = kernels.decode_attention_reference(
        args[0], kernels.DecodeTiers.from_flat(args[1:], 2, 2), sm_scale=scale
    ).float()
    dense_kv = torch.randn(2, batch, CONFIG["shape"]["kv_heads"], context, CONFIG["shape"]["head_dim"], device="cuda")
    dense_k, dense_v = dense_kv.to(args[0].dtype).unbind(0)
    rows = []
    axes = (grid["block_n"], grid["warps"], grid["stages"], grid["programs_per_sm"])
    for block_n, warps, stages, per_sm in itertools.product(*axes):
        splits = splits_for(per_sm, batch)
        setting = dict(block_n=block_n, num_warps=warps, num_stages=stages, splits=splits)

        def run():
            return kernels.decode_attention_triton(*args, None, 2, 2, scale, splits, block_n, warps, stages)

        try:
            error = (run().float() - want).abs().max().item()
            rows.append({**setting, "us": time_graph(run), "max_abs_error": error})
        except Exception as exc:  # noqa: BLE001  (out of shared memory etc.: record and go on)
            rows.append({**setting, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
    timed = sorted((r for r in rows if "us" in r and r["max_abs_error"] < 0.05), key=lambda r: r["us"])
    default = kernels.decode_attention_triton(*args, None, 2, 2, scale)
    return {
        "batch": batch,
        "context": context,
        "sdpa_bf16_us": time_graph(
            lambda: F.scaled_dot_product_attention(args[0][:, :, None], dense_k, dense_v, enable_gqa=True)
        ),
        "default_us": time_graph(lambda: kernels.decode_attention_triton(*args, None, 2, 2, scale)),
        "default_max_abs_error": (default.float() - want).abs().max().item(),
        "int2_bytes": sum(t.numel() * t.element_size() for t in args[3:9]),
        "best": timed[:8],
        "all": rows,
    }


def write(results: list[dict], out: Path, info: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_kernel_tuning.json").write_text(json.dumps({**info, "results": results}, indent=1))
    lines = [
        f"Decode-attention tuning, {machine_line(info['machine'])}, {info['date']}",
        "",
        f"`{info['command']}`",
        "",
        "| batch | context | BF16 SDPA us | default us | best us | best setting | GB/s at best |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        best = r["best"][0]
        setting = f"block_n {best['block_n']}, warps {best['num_warps']}, stages {best['num_stages']}, splits {best['splits']}"
        bandwidth = r["int2_bytes"] / best["us"] / 1e3
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['sdpa_bf16_us']:.1f} | {r['default_us']:.1f} | "
            f"{best['us']:.1f} | {setting} | {bandwidth:.0f} |"
        )
    (out / "decode_kernel_tuning.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=100_000)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--out", type=Path, default=Path("kernels/measurements"))
    for axis, values in GRID.items():
        parser.add_argument(f"--{axis.replace('_', '-')}", default=values, help=f"comma-separated (default {values})")
    options = parser.parse_args()
    grid = {axis: tuple(int(v) for v in getattr(options, axis).split(",")) for axis in GRID}
    run_info = provenance(command_line())
    results = []
    for batch in options.batches.split(","):
        results.append(sweep(int(batch), options.context, grid))
        write(results, options.out, run_info)  # after each batch: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
