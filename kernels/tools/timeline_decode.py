"""Where a batch-1 decode call's time goes: a timeline of the Gluon history span's programs, the three
kernels' windows, and the call's time against the tiles each program runs.

    python kernels/tools/timeline_decode.py [--out kernels/measurements] [--batches 1,8] [--tiles 1,2,4,6,8] [--context 100000]

Qwen3-8B attention shape (the kernel benchmark's inputs, ``eval/configs/bench_kernel.json``), the
whole call as the kernel benchmark times it (``decode_attention_triton``, settled history, CUDA-graph
replay). Three views:

* **tiles**: the span alone (staged, one wave of splits) and the whole call over histories of
  ``tiles x splits x 64`` rows, so that each program runs exactly ``tiles`` tiles; a line through
  them gives the time a tile adds and the fixed part (launch, q's prologue, epilogue, dense tiers,
  merge). The whole call picks its own splits, which are a whole wave from 4 tiles on.
* **programs** (``--context``, 100K by default): each span program's SM, start and end (global timer) and its SM's cycle
  counter at the start, after waiting for the kernel ahead, once q is ready, after the last tile and
  at the end (``gluon_span_variant.SpanVariant.timeline``), from the last of several calls replayed in one
  graph: how the wave ramps up and drains, and the cycles of each phase.
* **kernels** (the same context): the span's, the dense tiers' and the merge's start and duration per call from
  the profiler (CUPTI), over the same graph.

Writes ``timeline_decode.json``, ``.md`` and ``.png`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch
import tune_decode as tune  # a sibling tool: the kernel benchmark's shape and inputs

from oscar_hf.kernels.decode_attention import decode_attention_triton
from oscar_hf.kernels.gluon_span_variant import SpanVariant, programs_per_sm
from oscar_hf.kernels.testing import TIER_NAMES
from oscar_hf.provenance import command_line, machine_line, provenance

CALLS_A_GRAPH = 8
DENSE_ROWS = tune.CONFIG["sink"] + tune.CONFIG["recent"] + tune.CONFIG["new"]


def whole_call(x: dict, span_variant=None):
    """The kernel benchmark's call over ``x`` (settled history), as a function of no arguments."""
    tiers, scale = [x[name] for name in TIER_NAMES], tune.CONFIG["shape"]["head_dim"] ** -0.5
    bits = tune.CONFIG["k_bits"], tune.CONFIG["v_bits"]
    return lambda: decode_attention_triton(
        x["q"], *tiers, None, *bits, scale, history_settled=True, span_variant=span_variant
    )


def tile_rows(span, batch: int, tiles: list[int]) -> list[dict]:
    """The span alone and the whole call where each program runs ``tiles`` tiles."""
    splits = tune.splits_for(programs_per_sm(), batch)
    scale = tune.CONFIG["shape"]["head_dim"] ** -0.5
    rows = []
    for count in tiles:
        x = tune.inputs(DENSE_ROWS + count * splits * 64, batch)
        packed = [x[name] for name in TIER_NAMES[2:8]]
        span_us = tune.time_graph(
            functools.partial(span.history_partials, x["q"], *packed, sm_scale=scale, splits=splits, pipeline=True)
        )
        call_us = tune.time_graph(whole_call(x)) if count * splits * 64 >= splits * 256 else None
        rows.append({"batch": batch, "tiles": count, "splits": splits, "span_us": span_us, "call_us": call_us})
        print(rows[-1], flush=True)
        del x, packed
    return rows


def line(points: list[tuple[float, float]]) -> dict:
    """Least-squares ``y = slope x + intercept``."""
    if len(points) < 2:
        return {}
    xs, ys = zip(*points)
    slope, intercept = statistics.linear_regression(xs, ys)
    return {"us_a_tile": slope, "fixed_us": intercept}


def replayed(fn, calls: int) -> torch.cuda.CUDAGraph:
    """A graph of ``calls`` calls of ``fn`` (warmed up outside it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def program_timeline(x: dict) -> dict:
    """Each span program's record from the last call of a replayed graph, and phase summaries."""
    from oscar_hf.kernels.gluon_span_kernel import TIMELINE_FIELDS, placement

    timeline = torch.zeros(4 * 2112 * int(TIMELINE_FIELDS), dtype=torch.int64, device="cuda")
    graph = replayed(whole_call(x, SpanVariant(timeline=timeline)), CALLS_A_GRAPH)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    records = timeline.view(-1, int(TIMELINE_FIELDS)).cpu()
    ran = records[:, 1] != 0
    batch, kv_heads = x["q"].shape[0], x["sink_k"].shape[1]
    splits = int(ran.sum()) // (batch * kv_heads)
    index = torch.arange(len(records))[ran]  # (b, kv head, split) in record order
    launch = index // (kv_heads * splits) + batch * (index // splits % kv_heads + kv_heads * (index % splits))
    records = records[ran]
    sm, slot, tiles = placement(records)
    # relative to the first start before going to float: the counters' raw values exceed float64's 53 bits
    started, ended = (records[:, 1:3] - records[:, 1].min()).double().T
    c_start, c_waited, c_q, c_loop, c_end = (records[:, 3:] - records[:, 3:4]).double().T
    ghz = ((c_end - c_start) / (ended - started)).median().item()  # cycles a ns

    def us(cycles: torch.Tensor) -> dict:
        values = cycles / ghz / 1e3
        return {q: values.quantile(p).item() for q, p in (("p10", 0.1), ("median", 0.5), ("p90", 0.9), ("max", 1.0))}

    return {
        "programs": len(records),
        "tiles_a_program": {"min": int(tiles.min()), "max": int(tiles.max())},
        "sm_ghz": ghz,
        "window_us": (ended.max() - started.min()).item() / 1e3,
        "start_us": us(started * ghz),
        "end_us": us(ended * ghz),
        "waiting_us": us(c_waited - c_start),
        "q_prologue_us": us(c_q - c_waited),
        "tile_us": us((c_loop - c_q) / tiles.clamp(min=1)),
        "epilogue_us": us(c_end - c_loop),
        "program_us": us(c_end - c_start),
        "by_warp_slot": by_warp_slot(slot, tiles, (c_loop - c_q) / ghz / 1e3, ended / 1e3),
        "record_fields": [
            "sm",
            "warp_slot",
            "tiles",
            "launch",
            "start_ns",
            "end_ns",
            "cycles_start",
            "cycles_waited",
            "cycles_q",
            "cycles_loop",
            "cycles_end",
        ],
        "records": [
            [int(v) for v in row]
            for row in torch.stack(
                [sm, slot, tiles, launch, started.long(), ended.long(), *(records[:, 3:] - records[:, 3:4]).T], 1
            ).tolist()
        ],
    }


def by_warp_slot(slot: torch.Tensor, tiles: torch.Tensor, loop_us: torch.Tensor, end_us: torch.Tensor) -> list[dict]:
    """Median tiles, time a tile and end of the programs by their warp slot on the SM, in quarters of 4
    (one a warp scheduler): a scheduler issues for its lowest slots first."""
    out = []
    for quarter in range(int(slot.max()) // 4 + 1):
        chosen = slot // 4 == quarter
        if chosen.any():
            out.append(
                {
                    "slots": f"{4 * quarter}-{4 * quarter + 3}",
                    "programs": int(chosen.sum()),
                    "tiles": tiles[chosen].double().median().item(),
                    "tile_us": (loop_us[chosen] / tiles[chosen].clamp(min=1)).median().item(),
                    "end_us": end_us[chosen].median().item(),
                    "last_end_us": end_us[chosen].max().item(),
                }
            )
    return out


def kernel_windows(x: dict) -> dict:
    """Start (from the call's first kernel) and duration of each kernel of the middle calls of a replayed graph."""
    from torch.profiler import ProfilerActivity, profile

    graph = replayed(whole_call(x), CALLS_A_GRAPH)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    names = {"history_kernel": "span", "_decode_stage1_kernel": "dense", "_decode_stage2_kernel": "merge"}
    calls: list[dict] = []
    for event in events:
        name = names.get(event.name)
        if name == "span":
            calls.append({})
        if name and calls and name not in calls[-1]:
            calls[-1][name] = (event.time_range.start, event.time_range.end)
    complete = [c for c in calls if len(c) == 3]
    middle = complete[1:-1] or complete
    if not middle:
        return {"calls": 0, "period_us": None}
    out = {
        "calls": len(complete),
        "period_us": (complete[-1]["span"][0] - complete[0]["span"][0]) / max(1, len(complete) - 1),
    }
    for name in names.values():
        out[name] = {
            "start_us": statistics.median(c[name][0] - c["span"][0] for c in middle),
            "end_us": statistics.median(c[name][1] - c["span"][0] for c in middle),
            "duration_us": statistics.median(c[name][1] - c[name][0] for c in middle),
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gantt, fit) = plt.subplots(1, 2, figsize=(14, 5.5))
    timeline = result["batches"][0]["programs"]
    ghz = timeline["sm_ghz"]
    records = sorted(timeline["records"], key=lambda r: (r[0], r[1]))
    first = min(r[1] for r in records)
    slot: dict[int, int] = {}
    for sm, _, _, _, started, _, c_start, c_waited, c_q, c_loop, c_end in records:
        row = sm + slot.setdefault(sm, 0) / 16
        slot[sm] += 1
        t0 = (started - first) / 1e3
        phases = (
            (c_start, c_waited, "tab:gray"),
            (c_waited, c_q, "tab:orange"),
            (c_q, c_loop, "tab:blue"),
            (c_loop, c_end, "tab:red"),
        )
        for a, b, colour in phases:
            gantt.plot(
                [t0 + (a - c_start) / ghz / 1e3, t0 + (b - c_start) / ghz / 1e3], [row, row], color=colour, lw=0.4
            )
    gantt.set_xlabel("us from the first program's start")
    gantt.set_ylabel("SM (16 program rows each)")
    gantt.set_title(
        f"span programs, batch {result['batches'][0]['batch']}, {result['context'] // 1000}K: "
        "wait (grey), q (orange), tiles (blue), epilogue (red)",
        fontsize=9,
    )
    for batch in result["batches"]:
        rows = batch["tiles"]
        fit.plot(
            [r["tiles"] for r in rows], [r["span_us"] for r in rows], "o-", label=f"span alone, batch {batch['batch']}"
        )
        calls = [r for r in rows if r["call_us"] is not None]
        fit.plot(
            [r["tiles"] for r in calls],
            [r["call_us"] for r in calls],
            "s-",
            label=f"whole call, batch {batch['batch']}",
        )
    fit.axhline(25, color="k", ls=":", lw=0.8, label="target at 100K, batch 1")
    fit.set_xlabel("tiles a program (64 keys each)")
    fit.set_ylabel("us (CUDA-graph replay, median)")
    fit.legend(fontsize=8)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(result: dict) -> str:
    lines = [f"# {result['title']}", "", f"`{result['command']}`", ""]
    for batch in result["batches"]:
        lines += [
            f"## Batch {batch['batch']}",
            "",
            "| tiles a program | splits | span alone us | whole call us |",
            "|---|---|---|---|",
        ]
        for r in batch["tiles"]:
            call = "" if r["call_us"] is None else f"{r['call_us']:.1f}"
            lines.append(f"| {r['tiles']} | {r['splits']} | {r['span_us']:.1f} | {call} |")
        for name in ("span_fit", "call_fit"):
            fit = batch[name]
            if fit:
                lines.append(f"\n{name}: {fit['us_a_tile']:.2f} us a tile, {fit['fixed_us']:.1f} us fixed")
        p = batch["programs"]
        tiles = p["tiles_a_program"]
        lines += [
            "",
            f"Span programs at {result['context'] // 1000}K ({p['programs']}, {tiles['min']}-{tiles['max']} tiles each, "
            f"SM clock {p['sm_ghz']:.2f} GHz): first start to last end {p['window_us']:.1f} us.",
            "",
            "| phase | p10 us | median us | p90 us | max us |",
            "|---|---|---|---|---|",
        ]
        for phase in ("start_us", "end_us", "waiting_us", "q_prologue_us", "tile_us", "epilogue_us", "program_us"):
            v = p[phase]
            lines.append(f"| {phase[:-3]} | {v['p10']:.2f} | {v['median']:.2f} | {v['p90']:.2f} | {v['max']:.2f} |")
        lines += [
            "",
            "By warp slot on the SM (medians; a warp scheduler issues for its lowest slots first):",
            "",
            "| slots | programs | tiles | us a tile | end us | last end us |",
            "|---|---|---|---|---|---|",
        ]
        for r in p["by_warp_slot"]:
            lines.append(
                f"| {r['slots']} | {r['programs']} | {r['tiles']:.0f} | {r['tile_us']:.2f} | {r['end_us']:.2f} | "
                f"{r['last_end_us']:.2f} |"
            )
        k = batch["kernels"]
        if not k["calls"]:
            lines += ["", "Kernels: the profiler traced none of the graph's kernels.", ""]
            continue
        lines += [
            "",
            f"Kernels a call (profiler, {k['calls']} calls, period {k['period_us'] or float('nan'):.1f} us):",
            "",
            "| kernel | start us | end us | duration us |",
            "|---|---|---|---|",
        ]
        for name in ("span", "dense", "merge"):
            lines.append(
                f"| {name} | {k[name]['start_us']:.1f} | {k[name]['end_us']:.1f} | {k[name]['duration_us']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("kernels/measurements"))
    parser.add_argument("--batches", default="1")
    parser.add_argument("--tiles", default="1,2,4,6,8")
    parser.add_argument("--context", type=int, default=100_000, help="tokens of the programs' and kernels' views")
    options = parser.parse_args()
    from oscar_hf.kernels import decode_history_gluon as span

    result = {**provenance(command_line()), "context": options.context, "batches": []}
    result["title"] = f"Decode call timeline, {machine_line(result['machine'])}, {result['date']}"
    for batch in (int(b) for b in options.batches.split(",")):
        tiles = tile_rows(span, batch, [int(t) for t in options.tiles.split(",")])
        x = tune.inputs(options.context, batch)
        entry = {
            "batch": batch,
            "tiles": tiles,
            "call_us": tune.time_graph(whole_call(x)),
            "span_fit": line([(r["tiles"], r["span_us"]) for r in tiles]),
            "call_fit": line([(r["tiles"], r["call_us"]) for r in tiles if r["call_us"] is not None]),
            "programs": program_timeline(x),
            "kernels": kernel_windows(x),
        }
        result["batches"].append(entry)
        print({k: v for k, v in entry["programs"].items() if k != "records"}, entry["kernels"], flush=True)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "timeline_decode.json").write_text(json.dumps(result))
    (options.out / "timeline_decode.md").write_text(markdown(result))
    plot(result, options.out / "timeline_decode.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
