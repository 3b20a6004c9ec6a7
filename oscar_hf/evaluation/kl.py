"""Perplexity and KL divergence from the unquantized cache, per cache method, on long text windows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel

from oscar_hf.calibration.teacher_forcing import position_stats_of_caches
from oscar_hf.core.cache import OscarCache
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.memory import mean_bits_per_element
from oscar_hf.model_info import head_dim_of
from oscar_hf.rotations.rotation_set import MethodRotations, rotations_for


@dataclass
class MethodScore:
    """Scores of one method over all evaluated positions (those after ``sink + recent``)."""

    method: str
    perplexity: float
    kl_from_none: float  # mean KL(p_none || p_method) in nats
    top1_agreement: float  # share of positions whose argmax equals the unquantized one
    bits_per_element: float
    positions: int

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_methods(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    methods: Sequence[str],
    rotations: MethodRotations = None,
    context: int = 2048,
    windows: int = 6,
    progress: bool = True,
    **overrides,
) -> list[MethodScore]:
    """Teacher-forced perplexity, KL from ``none`` and top-1 agreement for each named method.

    ``token_ids`` is one long 1-D sequence; ``windows`` windows of ``context`` tokens are spread
    over it. Positions before ``sink + recent`` never see quantized keys and are not scored.
    """
    caches = {m: OscarCache(model, m, rotations=rotations_for(rotations, m), **overrides) for m in methods}
    return evaluate_caches(model, token_ids, caches, context, windows, progress)


@torch.no_grad()
def evaluate_caches(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    caches: dict[str, OscarCache],
    context: int = 2048,
    windows: int = 6,
    progress: bool = True,
) -> list[MethodScore]:
    """:func:`evaluate_methods` for arbitrary labelled cache configurations (e.g. ablation variants).

    The caches only supply configurations and rotations; the reference is an unquantized forward.
    """
    config = next(iter(caches.values())).oscar_config
    first = config.sink + config.recent
    if first >= context - 1:
        raise ValueError(f"context {context} leaves no position after sink + recent = {first}")
    if any((c.oscar_config.sink, c.oscar_config.recent) != (config.sink, config.recent) for c in caches.values()):
        raise ValueError(
            "all compared caches must use the same sink and recent window, so they score the same positions"
        )
    stats, starts = position_stats_of_caches(model, token_ids, caches, context, windows, progress)
    head_dim = head_dim_of(next(iter(caches.values())).text_config)
    return [
        _score(label, stats[label][:, first:], len(starts), _bits_per_element(cache, context, head_dim))
        for label, cache in caches.items()
    ]


def _bits_per_element(cache: OscarCache, context: int, head_dim: int) -> float:
    """The cache's BPE after a ``context``-token prefill, each layer at its own bit widths."""
    configs = [layer.config for layer in cache.layers if isinstance(layer, OscarLayer)]
    return mean_bits_per_element(configs, context, head_dim)


def _score(method: str, stats: torch.Tensor, windows: int, bpe: float) -> MethodScore:
    """A method's score from its window-averaged per-position stats over the scored positions."""
    nll, kl, agree = stats.mean(dim=1).tolist()
    return MethodScore(
        method=method,
        perplexity=round(math.exp(nll), 4),
        kl_from_none=round(kl, 5),
        top1_agreement=round(agree, 4),
        bits_per_element=round(bpe, 3),
        positions=stats.shape[1] * windows,
    )


def scores_to_markdown(scores: Sequence[MethodScore]) -> str:
    rows = ["| method | BPE | perplexity | KL from none (nats) | top-1 agreement |", "|---|---|---|---|---|"]
    for s in scores:
        rows.append(
            f"| {s.method} | {s.bits_per_element:.2f} | {s.perplexity:.3f} | {s.kl_from_none:.4f} | {s.top1_agreement:.3f} |"
        )
    return "\n".join(rows)
