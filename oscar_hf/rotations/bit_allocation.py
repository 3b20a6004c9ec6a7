"""Per-layer bit widths at ``oscar-int2``'s budget: 4-bit keys where they help most, paid for by 1-bit values.

Each layer is scored twice on calibration rows, by the teacher-forced KL divergence of the model's
next-token distributions from the unquantized model's (:func:`oscar_hf.core.teacher_forcing.position_stats_of_caches`),
against the baseline of the given rotations and clip ratios at 2 bits everywhere:

* ``key_gain``: how much the KL falls with that layer's keys at 4 bits (min-max, no clipping);
* ``value_cost``: how much it rises with that layer's values at 1 bit (levels ``mu +- 0.798 sigma``).

The ``layers`` layers of largest gain get 4-bit keys and the ``2 * layers`` of smallest cost 1-bit
values: +2 bits in each of the first, -1 in each of the second, so the history keeps its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from oscar_hf.core.cache import OscarCache

from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.config import METHODS, OscarConfig
from oscar_hf.core.teacher_forcing import position_stats_of_caches
from oscar_hf.core.rotation_set import RotationSet

KEY_BITS, VALUE_BITS = 4, 1


@dataclass
class BitAllocation:
    """Per-layer scores (KL in nats, mean over the scored positions) and the layers chosen."""

    baseline_kl: float
    key_gain: dict[int, float]
    value_cost: dict[int, float]
    key_layers: list[int]
    value_layers: list[int]
    allocated_kl: float | None = None
    positions: int = 0

    def to_dict(self) -> dict:
        return {
            "baseline_kl": round(self.baseline_kl, 6),
            "allocated_kl": None if self.allocated_kl is None else round(self.allocated_kl, 6),
            "key_bits": {str(i): KEY_BITS for i in self.key_layers},
            "value_bits": {str(i): VALUE_BITS for i in self.value_layers},
            "key_gain": {str(i): round(v, 6) for i, v in sorted(self.key_gain.items())},
            "value_cost": {str(i): round(v, 6) for i, v in sorted(self.value_cost.items())},
            "positions": self.positions,
        }


def allocate_bits(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    rotations: RotationSet,
    layers: int,
    config: OscarConfig = METHODS["oscar-int2"],
    progress: bool = True,
) -> tuple[RotationSet, BitAllocation]:
    """Rank layers by the KL effect of 4-bit keys and of 1-bit values; return ``rotations`` with the
    widths stored (K4 in the top ``layers``, V1 in the ``2 * layers`` cheapest) and the scores.

    ``batches``: calibration rows ``[1, T]`` longer than ``config.sink + config.recent`` (cut to the
    shortest one's length). ``config`` must quantize K and V to 2 bits with calibrated rotations;
    ``rotations`` supply its rotations and clip ratios (e.g. those of :func:`oscar_hf.rotations.clip_search.search_layers`).
    Costs ``2 * L + 2`` teacher-forced passes per row for ``L`` layers, plus one unquantized pass.
    """
    if not (config.quantized and config.rotation == "calibrated" and config.key.bits == config.value.bits == 2):
        raise ValueError(f"bit allocation trades 2-bit widths of a calibrated method (oscar-int2); got {config.method!r}")
    tokens, context = _rows(batches, config)
    probe = OscarCache(model, config, rotations=replace(rotations, key_bits={}, value_bits={}))
    layer_ids = [i for i, layer in enumerate(probe.layers) if isinstance(layer, OscarLayer)]
    if not 1 <= layers <= len(layer_ids) // 2:
        raise ValueError(f"--allocate-bits takes 1 to {len(layer_ids) // 2} layers for this model's {len(layer_ids)} "
                         f"quantized layers (4-bit keys in N, 1-bit values in 2N), got {layers}")  # fmt: skip

    def cache(key_bits: dict[int, int], value_bits: dict[int, int]) -> OscarCache:
        widths = replace(rotations, key_bits=key_bits, value_bits=value_bits)
        return OscarCache(model, config, rotations=widths, allow_bits_change=True)

    caches = {"baseline": probe}
    caches |= {f"k{i}": cache({i: KEY_BITS}, {}) for i in layer_ids}
    caches |= {f"v{i}": cache({}, {i: VALUE_BITS}) for i in layer_ids}
    kl = _mean_kl(model, tokens, caches, context, config, progress)
    baseline = kl["baseline"]
    key_gain = {i: baseline - kl[f"k{i}"] for i in layer_ids}
    value_cost = {i: kl[f"v{i}"] - baseline for i in layer_ids}
    key_layers = sorted(sorted(layer_ids, key=lambda i: -key_gain[i])[:layers])
    value_layers = sorted(sorted(layer_ids, key=lambda i: value_cost[i])[: 2 * layers])
    allocated = replace(rotations, key_bits={i: KEY_BITS for i in key_layers},
                        value_bits={i: VALUE_BITS for i in value_layers})  # fmt: skip
    final = _mean_kl(model, tokens, {"allocated": OscarCache(model, config, rotations=allocated)}, context, config,
                     progress)["allocated"]  # fmt: skip
    scores = BitAllocation(baseline, key_gain, value_cost, key_layers, value_layers, final,
                           (context - 1 - config.sink - config.recent) * len(batches))  # fmt: skip
    return allocated, scores


def _rows(batches: Sequence[torch.LongTensor], config: OscarConfig) -> tuple[torch.Tensor, int]:
    """The rows cut to one length and joined into one sequence of whole windows, and that length."""
    context = min(b.shape[-1] for b in batches)
    if context <= config.sink + config.recent + 1:
        raise ValueError(f"bit allocation needs calibration rows longer than sink + recent = "
                         f"{config.sink + config.recent} tokens; the shortest has {context}")  # fmt: skip
    return torch.cat([b.reshape(-1)[:context] for b in batches]), context


def _mean_kl(model, tokens, caches, context, config, progress) -> dict[str, float]:
    """Mean KL from the unquantized model over the positions after ``sink + recent``, per cache."""
    stats, _ = position_stats_of_caches(model, tokens, caches, context, tokens.numel() // context, progress)
    first = config.sink + config.recent
    return {label: float(s[1, first:].mean()) for label, s in stats.items()}
