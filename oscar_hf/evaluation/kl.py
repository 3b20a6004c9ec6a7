"""Perplexity and KL divergence from the unquantized cache, per cache method, on long text windows."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from oscar_hf.core.cache import OscarCache

from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.model_info import head_dim_of
from oscar_hf.core.memory import mean_bits_per_element
from oscar_hf.core.rotation_set import RotationSet
from oscar_hf.core.teacher_forcing import teacher_forced_logits


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


def window_starts(n_tokens: int, context: int, windows: int) -> list[int]:
    """Start of each of ``windows`` windows spread evenly: window k starts at k * floor((n - ctx) / (N - 1))."""
    if n_tokens < context:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one window of {context}")
    if windows < 1:
        raise ValueError("windows must be at least 1")
    stride = (n_tokens - context) // (windows - 1) if windows > 1 else 0
    return [k * stride for k in range(windows)]


def token_stats(
    log_probs: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: NLL of the target, KL(reference || log_probs) in nats, and top-1 agreement (0/1).

    ``log_probs`` and ``reference`` are ``[positions, vocab]`` log-probabilities, ``targets`` ``[positions]``.
    """
    nll = -log_probs.gather(-1, targets[:, None])[:, 0]
    kl = (reference.exp() * (reference - log_probs)).sum(-1)
    agree = (log_probs.argmax(-1) == reference.argmax(-1)).float()
    return nll, kl, agree


def evaluate_methods(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    methods: Sequence[str],
    rotations: RotationSet | None = None,
    context: int = 2048,
    windows: int = 6,
    progress: bool = True,
    **overrides,
) -> list[MethodScore]:
    """Teacher-forced perplexity, KL from ``none`` and top-1 agreement for each named method.

    ``token_ids`` is one long 1-D sequence; ``windows`` windows of ``context`` tokens are spread
    over it. Positions before ``sink + recent`` never see quantized keys and are not scored.
    """
    caches = {m: OscarCache(model, m, rotations=rotations, **overrides) for m in methods}
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
        raise ValueError("all compared caches must use the same sink and recent window, so they score the same positions")
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


@torch.no_grad()
def position_stats_of_caches(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    caches: dict[str, OscarCache],
    context: int,
    windows: int,
    progress: bool = True,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``{label: [3, context - 1]}`` window-averaged NLL, KL from ``none`` and top-1 agreement per position.

    Position ``p`` predicts token ``p + 1``. Every window is decoded teacher-forced once unquantized
    (the reference) and once per quantizing cache; caches that quantize nothing reuse the reference.
    Also returns the window starts.
    """
    reference_cache = OscarCache(model, "none")
    starts = window_starts(token_ids.numel(), context, windows)
    sums = {label: torch.zeros(3, context - 1, dtype=torch.float64) for label in caches}
    device = next(model.parameters()).device
    bar = tqdm(total=len(starts) * (1 + sum(c.oscar_config.quantized for c in caches.values())),
               desc="teacher-forced passes", disable=not progress)
    for start in starts:
        ids = token_ids[start : start + context][None].to(device)
        bar.set_postfix_str(f"window at {start}, none")
        reference = _log_probs(teacher_forced_logits(model, ids, reference_cache))
        bar.update()
        for label, cache in caches.items():
            if cache.oscar_config.quantized:
                bar.set_postfix_str(f"window at {start}, {label}")
                log_probs = _log_probs(teacher_forced_logits(model, ids, cache))
                bar.update()
            else:
                log_probs = reference
            sums[label] += torch.stack(token_stats(log_probs, reference, ids[0, 1:])).double().cpu()
            del log_probs
    bar.close()
    return {label: s / len(starts) for label, s in sums.items()}, starts


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, :-1].float().log_softmax(dim=-1)


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
        rows.append(f"| {s.method} | {s.bits_per_element:.2f} | {s.perplexity:.3f} | {s.kl_from_none:.4f} | {s.top1_agreement:.3f} |")
    return "\n".join(rows)


def tokens_label(count: int) -> str:
    """``4096`` -> ``4K``; counts that are no whole multiple of 1024 stay as they are."""
    return f"{count // 1024}K" if count >= 1024 and count % 1024 == 0 else str(count)


def write_outputs(result: dict, stem: Path, markdown: str, plot: Callable[[dict, Path], None]) -> list[Path]:
    """``stem``.json, ``stem``.md and ``stem``.png of an evaluation (``stem`` may end in .json; parents are created)."""
    stem = Path(stem)
    if stem.suffix in (".json", ".md", ".png"):
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ext) for ext in (".json", ".md", ".png")]
    paths[0].write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    paths[1].write_text(markdown)
    plot(result, paths[2])
    return paths
