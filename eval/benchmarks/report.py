"""Markdown tables and matplotlib helpers for the benchmarks' reports."""

from __future__ import annotations

from typing import Any

Column = tuple[str, str, str]  # header, row key, format spec ("" for str())


def fmt(value: Any, spec: str) -> str:
    """``value`` for a table cell: ``spec`` is a format spec, ``MiB`` or ``GiB`` (bytes), or empty."""
    if value is None:
        return ""
    if spec == "MiB":
        return f"{value / 2**20:,.1f}"
    if spec == "GiB":
        return f"{value / 2**30:,.2f}"
    return format(value, spec) if spec and isinstance(value, (int, float)) else str(value)


def table(rows: list[dict], columns: list[Column]) -> str:
    """A markdown table; rows that did not run show their status and error instead of numbers."""
    head = "| " + " | ".join(c[0] for c in columns) + " | status |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for row in rows:
        status = row.get("status", "")
        if status != "ok":
            status += f": {row.get('error') or row.get('reason') or ''}".rstrip(": ")
        if row.get("check") == "MISMATCH":
            status += " (kernel != reference)"
        lines.append("| " + " | ".join(fmt(row.get(key), spec) for _, key, spec in columns) + f" | {status} |")
    return "\n".join(lines)


def short_tokens(count: int) -> str:
    """32768 -> 32K, 100000 -> 100K, 400 -> 400."""
    for unit in (1024, 1000):
        if count >= unit and count % unit == 0:
            return f"{count // unit}K"
    return str(count)


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.5):
    """A row of ``ncols`` matplotlib axes (headless backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)


def no_data(ax, text: str = "no successful cases") -> None:
    """Replace an empty panel by ``text``."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True)
    ax.set_axis_off()


def bars(ax, labels: list[str], series: dict[str, list[float | None]], ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per series (missing values leave a gap)."""
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        xs = [i + index * width for i, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width=width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend()
