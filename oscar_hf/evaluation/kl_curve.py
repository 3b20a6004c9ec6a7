"""KL from BF16 as a function of context length (the paper's Figure 3 analogue).

Each window of ``context`` tokens is scored teacher-forced (:func:`~oscar_hf.calibration.teacher_forcing.teacher_forced_logits`,
the exact step-by-step decoding schedule) once per method, and the per-position KL(p_none || p_method),
top-1 agreement and NLL are averaged over windows. Position ``p`` predicts token ``p + 1`` from a
context of ``p + 1`` tokens, so one long window gives the whole curve: positions are averaged in
buckets of ``bucket`` tokens, and :func:`at_contexts` gives what ``oscar-hf eval kl --ctx C`` scores
(positions ``sink + recent .. C - 2``) for several ``C`` at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from oscar_hf.calibration.teacher_forcing import position_stats_of_caches
from oscar_hf.core.cache import OscarCache
from oscar_hf.evaluation.report import tokens_label
from oscar_hf.provenance import provenance_line, provenance_title
from oscar_hf.rotations.rotation_set import MethodRotations, rotations_for


def position_stats(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    methods: Sequence[str],
    rotations: MethodRotations = None,
    context: int = 8192,
    windows: int = 2,
    progress: bool = True,
    **overrides,
) -> tuple[dict[str, torch.Tensor], list[int], int]:
    """``{method: [3, context - 1]}`` window-averaged NLL, KL from ``none`` and top-1 agreement per position.

    Also returns the window starts and the first position that can see a quantized key (the
    smallest ``sink + recent`` of the quantized methods).
    """
    caches = {m: OscarCache(model, m, rotations=rotations_for(rotations, m), **overrides) for m in methods}
    configs = [c.oscar_config for c in caches.values()]
    first = min((c.sink + c.recent for c in configs if c.quantized), default=configs[0].sink + configs[0].recent)
    stats, starts = position_stats_of_caches(model, token_ids, caches, context, windows, progress)
    return stats, starts, first


def buckets(stats: torch.Tensor, width: int) -> list[dict]:
    """Mean KL, top-1 agreement and perplexity of positions ``[start, start + width)``, per bucket."""
    positions = stats.shape[1]
    out = []
    for start in range(0, positions, width):
        chunk = stats[:, start : start + width]
        nll, kl, top1 = chunk.mean(dim=1).tolist()
        out.append(
            {
                "start": start,
                "end": start + chunk.shape[1],
                "kl": round(kl, 6),
                "top1_agreement": round(top1, 4),
                "perplexity": round(math.exp(nll), 4),
            }
        )
    return out


def at_contexts(stats: torch.Tensor, first: int, contexts: Sequence[int]) -> dict[str, dict]:
    """For each context C: the means over positions ``first .. C - 2``, i.e. what ``eval kl --ctx C`` scores."""
    out = {}
    for c in contexts:
        if not first < c - 1 <= stats.shape[1]:
            continue
        nll, kl, top1 = stats[:, first : c - 1].mean(dim=1).tolist()
        out[str(c)] = {
            "kl": round(kl, 6),
            "top1_agreement": round(top1, 4),
            "perplexity": round(math.exp(nll), 4),
            "positions": c - 1 - first,
        }
    return out


def default_contexts(context: int) -> list[int]:
    """512, 1K, 2K, ... up to ``context`` (and ``context`` itself)."""
    contexts = [c for c in (2**k for k in range(9, 20)) if c < context]
    return contexts + [context]


def kl_curve_result(
    stats: dict[str, torch.Tensor], starts: list[int], first: int, bucket: int, meta: dict, settings: dict
) -> dict:
    context = settings["ctx"]
    return {
        **meta,
        **settings,
        "window_starts": starts,
        "first_scored": first,
        "bucket": bucket,
        "curves": {m: buckets(s, bucket) for m, s in stats.items()},
        "at_context": {m: at_contexts(s, first, default_contexts(context)) for m, s in stats.items()},
    }


def _nats(x: float) -> str:
    """KL for display: rounding noise below zero (KL is never negative) shows as 0.0000."""
    return f"{x if x > 0 else 0.0:.4f}"


def kl_curve_markdown(result: dict) -> str:
    methods = result["methods"]
    contexts = list(next(iter(result["at_context"].values())))
    rows = [
        f"Mean KL(p_BF16 || p_method) in nats over positions {result['first_scored']}..C-2 "
        "(what `eval kl --ctx C` scores), by context C (top-1 agreement in brackets):",
        "",
        "| method | " + " | ".join(tokens_label(int(c)) for c in contexts) + " |",
        "|---|" + "---|" * len(contexts),
    ]
    for m in methods:
        cells = result["at_context"][m]
        rows.append(
            f"| {m} | "
            + " | ".join(f"{_nats(cells[c]['kl'])} ({cells[c]['top1_agreement']:.3f})" for c in contexts)
            + " |"
        )
    curve = result["curves"][methods[0]]
    rows += [
        "",
        f"Per bucket of {result['bucket']} positions (KL in nats; position p sees p + 1 tokens):",
        "",
        "| positions | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for i, b in enumerate(curve):
        rows.append(
            f"| {b['start']}-{b['end'] - 1} | "
            + " | ".join(_nats(result["curves"][m][i]["kl"]) for m in methods)
            + " |"
        )
    meta = (
        f"\n\n{provenance_line(result)}, "
        f"{result['seconds']} s; model {result['model']}, text {result['text']} ({result['text_tokens']} tokens), "
        f"{len(result['window_starts'])} window(s) of {result['ctx']} tokens at {result['window_starts']}, "
        "teacher-forced with the step-by-step decoding schedule; positions before "
        f"{result['first_scored']} (sink + recent) see no quantized key."
    )
    return "\n".join(rows) + meta + "\n"


def plot_kl_curve(result: dict, path: Path) -> None:
    """KL (log-log) and top-1 agreement over context length, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_top1) = plt.subplots(1, 2, figsize=(12, 4.8))
    for method in result["methods"]:
        curve = result["curves"][method]
        x = [(b["start"] + b["end"]) / 2 + 1 for b in curve]
        kl = [b["kl"] if b["kl"] > 0 else float("nan") for b in curve]
        ax_kl.plot(x, kl, marker="o", markersize=3, label=method)
        ax_top1.plot(x, [b["top1_agreement"] for b in curve], marker="o", markersize=3, label=method)
    for ax in (ax_kl, ax_top1):
        ax.set_xscale("log", base=2)
        ax.axvline(result["first_scored"], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(f"context length (tokens; buckets of {result['bucket']}, dotted: sink + recent)")
        ax.grid(alpha=0.3, which="both")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL(p_BF16 || p_method), nats (log)")
    ax_top1.set_ylabel("top-1 agreement with BF16")
    ax_kl.legend(fontsize=8)
    headline = f"KL from BF16 vs context, {result['model']} on {Path(result['text']).name}"
    fig.suptitle(provenance_title(result, headline), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
