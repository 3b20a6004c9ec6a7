"""A benchmark's rows: one guarded measurement per row, speedups against a baseline row, rounds."""

from __future__ import annotations

import gc
import sys
import traceback
from typing import Any, Callable

import torch
from tqdm.auto import tqdm


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks, so that the next case starts from what is resident."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_line(error: BaseException) -> str:
    """An error's first line (at most 500 characters), as a row records it."""
    return (str(error).strip().splitlines() or [""])[0][:500]


def guarded(case: dict, measure: Callable[[], dict]) -> dict:
    """Merge ``measure()`` into ``case``; an OOM or any error becomes the row's status, and the run goes on.

    ``measure`` may itself return ``{"status": "skipped", "reason": ...}``.
    """
    try:
        case.update(measure())
        case.setdefault("status", "ok")
    except torch.OutOfMemoryError as error:
        case.update(status="oom", error=first_line(error))
    except Exception as error:  # noqa: BLE001 - one failing case must not end the benchmark
        case.update(status="error", error=f"{type(error).__name__}: {first_line(error)}")
        tqdm.write(traceback.format_exc(), file=sys.stderr)
    # The exception (and the frames holding the case's tensors) is gone here, so memory can be returned.
    free_memory()
    return case


def add_speedups(rows: list[dict], keys: tuple[str, ...], baseline: dict[str, Any], metrics: dict[str, bool]) -> None:
    """``speedup_<metric>`` of each ok row against the ok row that matches ``baseline`` in the same group.

    ``metrics`` maps a metric to whether higher is better (throughput) or not (time).
    """

    def is_base(candidate: dict, row: dict) -> bool:
        return (
            candidate.get("status") == "ok"
            and all(candidate.get(k) == row.get(k) for k in keys)
            and all(candidate.get(k) == v for k, v in baseline.items())
        )

    for row in rows:
        base = next((r for r in rows if is_base(r, row)), None)
        if base is None or row.get("status") != "ok":
            continue
        for metric, higher_is_better in metrics.items():
            if row.get(metric) and base.get(metric):
                ratio = row[metric] / base[metric] if higher_is_better else base[metric] / row[metric]
                row[f"speedup_{metric}"] = float(f"{ratio:.3g}")  # significant digits: interpreted kernels are ~1e-4x


def median_round(results: list[dict], key: str = "tokens_per_s", higher_is_faster: bool = True) -> dict:
    """One row from rounds of the same case: the round of median ``key`` (the slower middle one of an
    even count), with every round's value as ``<key>_rounds`` (a failed round is the row if no round
    succeeded; rows without a status count as succeeded)."""
    done = sorted(
        (r for r in results if r.get("status", "ok") == "ok"), key=lambda r: r[key] if higher_is_faster else -r[key]
    )
    if len(results) == 1 or not done:
        return results[0]
    return {**done[(len(done) - 1) // 2], f"{key}_rounds": [r.get(key) for r in results]}
