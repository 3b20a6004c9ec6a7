"""Time the explicit-layout (Gluon) history span against the Triton decode kernel's stage 1 on a GPU.

    python kernels/tools/time_gluon_history.py [--out kernels/measurements] [--batches 1,8] [--programs-per-sm 16]
                                      [--dense-split-tokens 16,32] [--registers 128] [--pdl 1,0]
                                      [--merge-tiles 8192] [--merge-warps 4] [--settled 1,0] [--halves 1,0]
                                      [--one-metadata-array] [--alternating-rows] [--floors]

Qwen3-8B attention shape at 100K (the kernel benchmark's inputs, ``eval/configs/bench_kernel.json``).
Both sides are CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median):

* ``triton``: ``decode_attention_triton`` over the packed history only (dense tiers empty), stage 1 and
  the merge, at the launcher's defaults, with ``OSCAR_DECODE_HISTORY=triton``;
* ``gluon``: ``history_partials`` (its stage 1 only; the merge is the same kernel) for each number
  of splits (programs an SM x SMs / (batch x KV heads)); ``gluon, staged``: the same with the next
  tile copied into shared memory while the current one computes (``pipeline=True``);
* ``triton, all tiers`` and ``gluon, all tiers``: the whole call as the kernel benchmark times it
  (sink, history, recent window, new row), the latter for each size of the dense tiers' splits and of
  the merge's tile (``--merge-tiles``), with
  the dense tiers and the merge launched programmatically (the default on Hopper) and, ``no PDL``,
  one after another; ``settled``: with ``history_settled=True`` (each call's span starts copying the
  history while the call before's merge runs, as a decode step's span does while q is rotated).

``--halves``: the span's 64-key tiles as two halves of 32 keys in the MMAs' columns (1, where a KV
head has at most 4 query heads) or one (0); each times the span alone and the whole call.
``--one-metadata-array`` also times the staged span alone with its four metadata pointers (K's and V's
scales and zeros) aimed at one array: one 128-byte stream a tile instead of four, for timing only (its
results are wrong), to see what the four separate arrays cost in memory traffic.

``--alternating-rows`` also times the staged span alone and the whole call with K's and V's code rows
side by side in one buffer (64-byte rows: one 4 KB stream a tile instead of two of 2 KB).

``--floors`` times only the whole call (settled), as it is and with its parts after the span made
trivial, for timing only (the outputs are wrong): the dense tiers empty (their kernel still launches and
waits for the span) and the merge replaced by one that waits and stores zeros; in turns three times.
What each saves is the most that making that part cheaper could.

``--registers`` caps the span's registers a thread (``maxnreg``); each cap runs at the programs an SM
it fits (65536 registers an SM), unless ``--programs-per-sm`` is given.

The variants reach the launcher through ``decode_attention_triton``'s ``span_variant``
(``gluon_span_variant.SpanVariant``) and ``launch_variant`` (``decode_launch.LaunchVariant``) arguments.

Writes ``gluon_history_timing.json`` and ``.md`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
import tune_decode as tune  # a sibling tool: the kernel benchmark's shape and inputs

import oscar_hf.kernels.decode_attention as decode_attention
from oscar_hf.kernels.decode_launch import PRODUCTION_LAUNCH, LaunchVariant
from oscar_hf.kernels.gluon_span_variant import REGISTERS, SpanVariant
from oscar_hf.kernels.testing import TIER_NAMES
from oscar_hf.provenance import command_line, machine_line, provenance


def full_call_rows(
    kernels, x: dict, scale: float, options: argparse.Namespace, variant: dict, span_variant, baseline: bool
) -> list[dict]:
    """The whole decode call over all four tiers (the kernel benchmark's ``oscar_triton``): Triton's
    stage 1 throughout (``baseline``), then the span (``span_variant``) with the dense tiers in splits
    of each size."""

    tiers = [x[name] for name in TIER_NAMES]
    want = kernels.decode_attention_reference(
        x["q"], kernels.DecodeTiers.from_flat(tiers, 2, 2), sm_scale=scale
    ).float()

    def row(kernel: str, settled: bool = False, launch: LaunchVariant = PRODUCTION_LAUNCH, **extra) -> dict:
        def run():
            return kernels.decode_attention_triton(
                x["q"],
                *tiers,
                None,
                2,
                2,
                scale,
                history_settled=settled,
                span_variant=span_variant,
                launch_variant=launch,
            )

        return {
            "batch": x["q"].shape[0],
            "kernel": kernel,
            "us": tune.time_graph(run),
            "max_abs_error": (run().float() - want).abs().max().item(),
            **extra,
        }

    rows = [row("triton, all tiers")] if baseline else []
    os.environ["OSCAR_DECODE_HISTORY"] = "gluon"
    for tokens, pdl, merge_tile, merge_warps, settled in itertools.product(
        numbers(options.dense_split_tokens),
        numbers(options.pdl),
        numbers(options.merge_tiles),
        numbers(options.merge_warps),
        numbers(options.settled),
    ):
        if settled and not pdl:
            continue  # a settled history changes nothing without programmatic launches
        if not 8 <= merge_tile // (32 * merge_warps) <= 128:
            continue  # floats a thread: more spill, fewer leave most lanes idle
        launch = LaunchVariant(
            span_dense_split_tokens=tokens, merge_tile=merge_tile, merge_warps=merge_warps, programmatic=bool(pdl)
        )
        kernel = "gluon, all tiers" + ("" if pdl else ", no PDL") + (", settled" if settled else "")
        rows.append(
            row(
                kernel,
                bool(settled),
                launch,
                dense_split_tokens=tokens,
                merge_tile=merge_tile,
                merge_warps=merge_warps,
                **variant,
            )
        )
        print(rows[-1], flush=True)
    os.environ["OSCAR_DECODE_HISTORY"] = "triton"
    return rows


def alternating_rows(kernels, span, x: dict, scale: float, variant: dict, span_variant) -> list[dict]:
    """The staged span alone and the whole call with K's and V's code rows side by side in one buffer,
    each beside the same with two buffers, twice in turn (the machine drifts)."""
    from oscar_hf.core.storage import RowBuffer

    k_codes, v_codes = x["k_codes"], x["v_codes"]
    rows = RowBuffer(*k_codes.shape[:2], (64,), torch.uint8, k_codes.device)
    rows.append(torch.cat([k_codes, v_codes], dim=-1))
    layouts = {
        "two buffers": x,
        "alternating rows": dict(x, k_codes=rows.view()[..., :32], v_codes=rows.view()[..., 32:]),
    }
    batch, splits = x["q"].shape[0], tune.splits_for(span_variant.programs_per_sm(), x["q"].shape[0])
    tiers = kernels.DecodeTiers.from_flat([x[name] for name in TIER_NAMES], 2, 2)
    want = kernels.decode_attention_reference(x["q"], tiers, sm_scale=scale).float()
    os.environ["OSCAR_DECODE_HISTORY"] = "gluon"
    out = []
    for _, (name, inputs) in itertools.product(range(2), layouts.items()):
        packed = [inputs[n] for n in TIER_NAMES[2:8]]
        tiers = [inputs[n] for n in TIER_NAMES]

        def alone():
            return span.history_partials(
                inputs["q"], *packed, sm_scale=scale, splits=splits, pipeline=True, variant=span_variant
            )

        def call():
            return kernels.decode_attention_triton(
                inputs["q"], *tiers, None, 2, 2, scale, history_settled=True, span_variant=span_variant
            )

        out.append(
            {
                "batch": batch,
                "kernel": f"gluon, staged, {name}",
                **variant,
                "splits": splits,
                "us": tune.time_graph(alone),
                "max_abs_error": float("nan"),
            }
        )
        out.append(
            {
                "batch": batch,
                "kernel": f"gluon, all tiers, settled, {name}",
                **variant,
                "us": tune.time_graph(call),
                "max_abs_error": (call().float() - want).abs().max().item(),
            }
        )
        print(out[-2:], flush=True)
    os.environ["OSCAR_DECODE_HISTORY"] = "triton"
    return out


@triton.jit
def _merge_floor(
    PM,
    PL,
    PACC,
    O,
    o_st,
    n_slots,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOTS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """The merge's launch, waits and stores without its loads and arithmetic (timing only)."""
    if DEPENDENT:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    tl.store(
        O + tl.program_id(0) * o_st[0] + tl.program_id(1) * o_st[1] + dims, tl.zeros([BLOCK_D], O.dtype.element_ty)
    )


def floor_rows(kernels, x: dict, scale: float) -> list[dict]:
    """The whole call (settled) as it is, with the dense tiers empty, with the merge's floor, and both."""
    empty = x["sink_k"][:, :, :0]
    full, dense_empty = (
        [x[name] for name in TIER_NAMES],
        [empty, empty, *(x[n] for n in TIER_NAMES[2:8]), empty, empty, empty, empty],
    )
    os.environ["OSCAR_DECODE_HISTORY"] = "gluon"
    out = []
    for turn, (tiers_name, tiers), merge_name in itertools.product(
        range(3),
        (("all tiers", full), ("dense tiers empty", dense_empty)),
        ("merge", "merge floor"),
    ):
        launch = PRODUCTION_LAUNCH if merge_name == "merge" else LaunchVariant(merge_kernel=_merge_floor)

        def call():
            return kernels.decode_attention_triton(
                x["q"], *tiers, None, 2, 2, scale, history_settled=True, launch_variant=launch
            )

        out.append(
            {
                "batch": x["q"].shape[0],
                "kernel": f"gluon, {tiers_name}, {merge_name}, settled (timing only)",
                "turn": turn,
                "us": tune.time_graph(call),
                "max_abs_error": float("nan"),
            }
        )
        print(out[-1], flush=True)
    os.environ["OSCAR_DECODE_HISTORY"] = "triton"
    return out


def numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("kernels/measurements"))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument(
        "--programs-per-sm",
        default="",  # at 128 registers 10-14 were slower than 16
        help="programs an SM for the span alone (default: as many as its registers fit)",
    )
    parser.add_argument("--registers", default=str(REGISTERS), help="register caps of the span to time")
    parser.add_argument(
        "--merge-tiles",
        default=str(PRODUCTION_LAUNCH.merge_tile),
        help="floats of a merge program's [slots, dims] tile, for the whole call",
    )
    parser.add_argument(
        "--merge-warps", default=str(PRODUCTION_LAUNCH.merge_warps), help="warps of a merge program, for the whole call"
    )
    parser.add_argument(
        "--dense-split-tokens",
        default="16,32",  # 64 and 256 were slower
        help="sizes of the dense tiers' splits beside the span, for the whole call",
    )
    parser.add_argument("--pdl", default="1,0", help="whole calls with programmatic launches (1), without (0)")
    parser.add_argument("--settled", default="1,0", help="whole calls with history_settled=True (1), without (0)")
    parser.add_argument("--halves", default="1", help="tiles as two halves of 32 keys (1) or one of 64 (0)")
    parser.add_argument(
        "--alternating-rows",
        action="store_true",
        help="also time the span and the whole call with K's and V's code rows in one buffer",
    )
    parser.add_argument(
        "--one-metadata-array",
        action="store_true",
        help="also time the staged span reading its four metadata vectors from one array",
    )
    parser.add_argument(
        "--floors",
        action="store_true",
        help="time only the whole call, as it is and with the dense tiers and the merge trivial",
    )
    options = parser.parse_args()
    from oscar_hf.kernels import decode_history_gluon as span

    os.environ["OSCAR_DECODE_HISTORY"] = "triton"  # the baselines; full_call_rows switches to the span and back

    kernels = decode_attention
    info = provenance(command_line())
    rows = []
    for batch in numbers(options.batches):
        x = tune.inputs(100_000, batch)
        q, packed = x["q"], [x[name] for name in TIER_NAMES[2:8]]
        empty = x["sink_k"][:, :, :0]
        scale = tune.CONFIG["shape"]["head_dim"] ** -0.5
        if options.floors:
            rows += floor_rows(kernels, x, scale)
            continue
        tiers = kernels.DecodeTiers.from_flat([empty, empty, *packed, empty, empty, empty, empty], 2, 2)
        want = kernels.decode_attention_reference(q, tiers, sm_scale=scale).float()

        def triton_run():
            return kernels.decode_attention_triton(
                q, empty, empty, *packed, empty, empty, empty, empty, None, 2, 2, scale
            )

        rows.append(
            {
                "batch": batch,
                "kernel": "triton",
                "us": tune.time_graph(triton_run),
                "max_abs_error": (triton_run().float() - want).abs().max().item(),
            }
        )
        caps = numbers(options.registers)
        for index, (registers, halves) in enumerate(itertools.product(caps, numbers(options.halves))):
            variant = {"registers": registers, "halves": 2 if halves else 1}
            span_variant = SpanVariant(two_halves=bool(halves), registers=registers)
            per_sm_choices = numbers(options.programs_per_sm or str(span_variant.programs_per_sm()))
            for per_sm, pipeline in itertools.product(per_sm_choices, (False, True)):
                splits = tune.splits_for(per_sm, batch)

                def gluon_run():
                    return span.history_partials(
                        q, *packed, sm_scale=scale, splits=splits, pipeline=pipeline, variant=span_variant
                    )

                error = (span.merge_partials(*gluon_run()) - want).abs().max().item()
                rows.append(
                    {
                        "batch": batch,
                        "kernel": "gluon, staged" if pipeline else "gluon",
                        **variant,
                        "programs_per_sm": per_sm,
                        "splits": splits,
                        "us": tune.time_graph(gluon_run),
                        "max_abs_error": error,
                    }
                )
                print(rows[-1], flush=True)
            if options.one_metadata_array:
                aliased = [packed[0], packed[1], packed[1], packed[3], packed[1], packed[1]]  # k_scale four times
                splits = tune.splits_for(span_variant.programs_per_sm(), batch)

                def aliased_run():
                    return span.history_partials(
                        q, *aliased, sm_scale=scale, splits=splits, pipeline=True, variant=span_variant
                    )

                rows.append(
                    {
                        "batch": batch,
                        "kernel": "gluon, staged, one metadata array (timing only)",
                        **variant,
                        "splits": splits,
                        "us": tune.time_graph(aliased_run),
                        "max_abs_error": float("nan"),
                    }
                )
                print(rows[-1], flush=True)
            if options.alternating_rows:
                rows += alternating_rows(kernels, span, x, scale, variant, span_variant)
            rows += full_call_rows(kernels, x, scale, options, variant, span_variant, baseline=index == 0)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "gluon_history_timing.json").write_text(json.dumps({**info, "rows": rows}, indent=1))
    lines = [
        f"Gluon history span vs Triton stage 1, {machine_line(info['machine'])}, {info['date']}",
        "",
        f"`{info['command']}`",
        "",
        "| batch | kernel | halves | registers | programs an SM | splits | dense split tokens | merge tile | "
        "merge warps | us | max abs error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['kernel']} | {r.get('halves', '')} | "
            f"{r.get('registers', '')} | {r.get('programs_per_sm', '')} | {r.get('splits', '')} | "
            f"{r.get('dense_split_tokens', '')} | {r.get('merge_tile', '')} | {r.get('merge_warps', '')} | "
            f"{r['us']:.1f} | {r['max_abs_error']:.2e} |"
        )
    (options.out / "gluon_history_timing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
