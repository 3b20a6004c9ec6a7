"""The run files of ``oscar-hf eval tasks`` (``runs/<method>__<task>__seed<k>.json``, one per finished run)
and the summary rebuilt from them: ``table.md`` (the paper's Table 2 layout), ``summary.json`` and
``accuracy.png``."""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path

from oscar_hf.config import METHODS
from oscar_hf.core.memory import bits_per_element
from oscar_hf.provenance import machine_line

BASELINE = "none"
BPE_CONTEXT = 131072  # the paper's BPE figures are at 128K context


@dataclass(frozen=True)
class RunKey:
    method: str
    task: str
    seed: int

    @property
    def filename(self) -> str:
        return f"{self.method}__{self.task}__seed{self.seed}.json"


def run_path(out_dir: str | Path, key: RunKey) -> Path:
    return Path(out_dir) / "runs" / key.filename


def load_runs(
    out_dir: str | Path, methods: list[str], tasks: list[str], seeds: int
) -> dict[tuple[str, str], list[float]]:
    """(method, task) -> the scores of the finished seeds found in ``out_dir``."""
    scores: dict[tuple[str, str], list[float]] = {}
    for method in methods:
        for task in tasks:
            for seed in range(seeds):
                path = run_path(out_dir, RunKey(method, task, seed))
                if path.exists():
                    scores.setdefault((method, task), []).append(json.loads(path.read_text())["score"])
    return scores


def same_output_rates(out_dir: str | Path, methods: list[str], tasks: list[str], seeds: int) -> dict[str, float]:
    """Method -> the fraction of samples whose whole generation equals BF16's (``none``), same task, seed and doc."""

    def digests(method):
        found = {}
        for task in tasks:
            for seed in range(seeds):
                path = run_path(out_dir, RunKey(method, task, seed))
                if path.exists():
                    for sample in json.loads(path.read_text())["samples"]:
                        found[(task, seed, sample["doc_id"])] = sample.get("response_sha1")
        return found

    base = digests(BASELINE)
    rates = {}
    for method in methods:
        mine = digests(method)
        shared = [k for k in mine if k in base and mine[k] and base[k]]
        if shared:
            rates[method] = sum(mine[k] == base[k] for k in shared) / len(shared)
    return rates


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summary_rows(
    scores: dict, methods: list[str], tasks: list[str], head_dim: int, sink: int = 64, recent: int = 256
) -> list[dict]:
    """One row per method: per-task mean/std (in %), mean over tasks, drop vs ``none``, BPE at 128K."""
    rows = []
    for method in methods:
        cells = {}
        for task in tasks:
            values = scores.get((method, task))
            if values:
                mean, std = _mean_std([100.0 * v for v in values])
                cells[task] = {"mean": mean, "std": std, "seeds": len(values)}
        complete = len(cells) == len(tasks)
        average = statistics.fmean(c["mean"] for c in cells.values()) if complete else None
        rows.append(
            {
                "method": method,
                "tasks": cells,
                "average": average,
                "bpe": bits_per_element(
                    METHODS[method].with_overrides(sink=sink, recent=recent), BPE_CONTEXT, head_dim
                ),
            }
        )
    base = next((r["average"] for r in rows if r["method"] == BASELINE), None)
    for row in rows:
        row["drop_vs_bf16"] = (row["average"] - base) if row["average"] is not None and base is not None else None
    return rows


def table_markdown(rows: list[dict], tasks: list[str]) -> str:
    def cell(c):
        if c is None:
            return "-"
        return f"{c['mean']:.1f} ± {c['std']:.1f}" if c["seeds"] > 1 else f"{c['mean']:.1f}"

    def number(x, signed=False):
        return "-" if x is None else (f"{x:+.1f}" if signed else f"{x:.1f}")

    head = ["method", *tasks, "avg", "Δ vs BF16", "same output as BF16", "BPE@128K"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        values = [
            row["method"],
            *(cell(row["tasks"].get(t)) for t in tasks),
            number(row["average"]),
            number(row["drop_vs_bf16"], signed=True),
            "-" if row.get("same_output_as_bf16") is None else f"{100 * row['same_output_as_bf16']:.0f}%",
            f"{row['bpe']:.2f}",
        ]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def bar_chart(rows: list[dict], tasks: list[str], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [*tasks, "avg"]
    width = 0.8 / max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(columns)), 4))
    for i, row in enumerate(rows):
        means = [row["tasks"].get(t, {}).get("mean", math.nan) for t in tasks] + [row["average"] or math.nan]
        stds = [row["tasks"].get(t, {}).get("std", 0.0) for t in tasks] + [0.0]
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(columns))]
        ax.bar(xs, means, width, yerr=stds, label=f"{row['method']} ({row['bpe']:.2f} BPE)", capsize=2)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_summary(
    out_dir: str | Path,
    methods: list[str],
    tasks: list[str],
    seeds: int,
    *,
    head_dim: int,
    environment: dict | None = None,
    settings: dict | None = None,
) -> dict:
    """Rebuild ``table.md``, ``summary.json`` and ``accuracy.png`` from the run files in ``out_dir``."""
    out_dir = Path(out_dir)
    scores = load_runs(out_dir, methods, tasks, seeds)
    windows = {k: (settings or {}).get(k) or default for k, default in (("sink", 64), ("recent", 256))}
    rows = summary_rows(scores, methods, tasks, head_dim, **windows)
    overall = same_output_rates(out_dir, methods, tasks, seeds)
    by_task = {task: same_output_rates(out_dir, methods, [task], seeds) for task in tasks}
    for row in rows:
        row["same_output_as_bf16"] = overall.get(row["method"])
        row["same_output_as_bf16_by_task"] = {task: rates.get(row["method"]) for task, rates in by_task.items()}
    table = table_markdown(rows, tasks)
    env = environment or {}
    header = [
        f"Command: `{env.get('command', '?')}`",
        f"Machine: {machine_line(env['machine']) if 'machine' in env else '?'}",
        f"Date: {env.get('date', '?')}",
        f"Settings: {json.dumps(settings or {})}",
        f'Scores in %, mean ± std over {seeds} seed(s); "same output as BF16": share of samples whose whole '
        f"generation equals the `none` run's (same task, seed, example); BPE = KV bits per element at 128K "
        f"context, head_dim {head_dim}.",
    ]
    (out_dir / "table.md").write_text("\n\n".join(header) + "\n\n" + table + "\n")
    summary = {**env, "settings": settings, "methods": methods, "tasks": tasks, "seeds": seeds, "rows": rows}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = (
        textwrap.fill(env.get("command", ""), 120)
        + f"\n{machine_line(env['machine']) if 'machine' in env else ''}, {env.get('date', '')}"
    )
    bar_chart(rows, tasks, out_dir / "accuracy.png", title)
    return {**summary, "table": table}
