"""Per-layer bit widths at a method's budget: 4-bit keys where they help most, paid for by 1-bit values.

Each layer is scored twice on calibration rows, by the teacher-forced KL divergence of the model's
next-token distributions from the unquantized model's (:func:`oscar_hf.calibration.teacher_forcing.position_stats_of_caches`),
against the baseline of the given rotations and clip ratios at the base method's widths everywhere:

* ``key_gain``: how much the KL falls with that layer's keys at 4 bits (min-max, no clipping);
* ``value_cost``: how much it rises with that layer's values at 1 bit (levels ``mu +- 0.798 sigma``).

The ``layers`` layers of largest gain get 4-bit keys and the cheapest layers 1-bit values, as many as
pay for them: for ``oscar-int2`` (K2 V2) +2 bits in each of N layers against -1 in each of 2N, for
``oscar-k3v2`` (K3 V2) +1 in N against -1 in N, so the history keeps its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from oscar_hf.calibration.teacher_forcing import position_stats_of_caches
from oscar_hf.config import METHODS, OscarConfig
from oscar_hf.core.cache import OscarCache
from oscar_hf.core.layer import OscarLayer
from oscar_hf.rotations.rotation_set import RotationSet

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
    base_bits: tuple[int, int] = (2, 2)

    def to_dict(self) -> dict:
        return {
            "baseline_kl": round(self.baseline_kl, 6),
            "allocated_kl": None if self.allocated_kl is None else round(self.allocated_kl, 6),
            "key_bits": {str(i): KEY_BITS for i in self.key_layers},
            "value_bits": {str(i): VALUE_BITS for i in self.value_layers},
            "base_bits": dict(zip(("key", "value"), self.base_bits)),
            "key_gain": {str(i): round(v, 6) for i, v in sorted(self.key_gain.items())},
            "value_cost": {str(i): round(v, 6) for i, v in sorted(self.value_cost.items())},
            "positions": self.positions,
        }


def allocate_bits(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    rotations: RotationSet,
    layers: int,
    base: OscarConfig = METHODS["oscar-int2"],
    progress: bool = True,
) -> tuple[RotationSet, BitAllocation]:
    """Rank layers by the KL effect of 4-bit keys and of 1-bit values against ``base``'s widths; return
    ``rotations`` with the widths stored (K4 in the top ``layers``, V1 in as many of the cheapest as
    keep ``base``'s history bits, ``base_bits`` set to ``base``'s widths) and the scores.

    ``batches``: calibration rows ``[1, T]`` longer than ``base.sink + base.recent`` (cut to the
    shortest one's length). ``base`` must be a calibrated method with keys below 4 bits and values
    above 1 bit whose key step is paid by a whole number of value layers (``oscar-int2``, ``oscar-k3v2``);
    ``rotations`` supply its rotations and clip ratios (e.g. those of :func:`oscar_hf.calibration.clip_search.search_layers`).
    Costs ``2 * L + 2`` teacher-forced passes per row for ``L`` layers, plus one unquantized pass.
    """
    value_per_key = value_layers_per_key_layer(base)
    tokens, context = _rows(batches, base)
    probe = OscarCache(model, base, rotations=replace(rotations, key_bits={}, value_bits={}))
    layer_ids = [i for i, layer in enumerate(probe.layers) if isinstance(layer, OscarLayer)]
    most = len(layer_ids) // value_per_key
    if not 1 <= layers <= most:
        raise ValueError(
            f"--allocate-bits takes 1 to {most} layers for this model's {len(layer_ids)} quantized layers "
            f"(4-bit keys in N, 1-bit values in {value_per_key}N), got {layers}"
        )
    base_bits = (base.key.bits, base.value.bits)

    def widths(key_bits: dict[int, int], value_bits: dict[int, int]) -> RotationSet:
        return replace(rotations, key_bits=key_bits, value_bits=value_bits, base_bits=base_bits)

    def cache(key_bits: dict[int, int], value_bits: dict[int, int]) -> OscarCache:
        return OscarCache(model, base, rotations=widths(key_bits, value_bits), allow_bits_change=True)

    caches = {"baseline": probe}
    caches |= {f"k{i}": cache({i: KEY_BITS}, {}) for i in layer_ids}
    caches |= {f"v{i}": cache({}, {i: VALUE_BITS}) for i in layer_ids}
    kl = _mean_kl(model, tokens, caches, context, base, progress)
    baseline = kl["baseline"]
    key_gain = {i: baseline - kl[f"k{i}"] for i in layer_ids}
    value_cost = {i: kl[f"v{i}"] - baseline for i in layer_ids}
    key_layers = sorted(sorted(layer_ids, key=lambda i: -key_gain[i])[:layers])
    value_layers = sorted(sorted(layer_ids, key=lambda i: value_cost[i])[: value_per_key * layers])
    allocated = widths(dict.fromkeys(key_layers, KEY_BITS), dict.fromkeys(value_layers, VALUE_BITS))
    final = _mean_kl(
        model, tokens, {"allocated": OscarCache(model, base, rotations=allocated)}, context, base, progress
    )["allocated"]
    scores = BitAllocation(
        baseline,
        key_gain,
        value_cost,
        key_layers,
        value_layers,
        final,
        (context - 1 - base.sink - base.recent) * len(batches),
        base_bits,
    )
    return allocated, scores


def value_layers_per_key_layer(base: OscarConfig) -> int:
    """How many 1-bit value layers pay for one 4-bit key layer at ``base``'s widths; raises for a base
    the trade does not fit."""
    fits = (
        base.quantized
        and base.rotation == "calibrated"
        and base.layer_bits
        and base.key.bits < KEY_BITS
        and base.value.bits > VALUE_BITS
        and (KEY_BITS - base.key.bits) % (base.value.bits - VALUE_BITS) == 0
    )
    if not fits:
        widths = f"K{base.key.bits} V{base.value.bits}" if base.quantized else "unquantized"
        raise ValueError(
            f"bit allocation raises keys to {KEY_BITS} bits and lowers values to {VALUE_BITS} bit in a calibrated method "
            f"with per-layer widths, whose key step a whole number of value layers pays for (oscar-int2's 2-bit widths, "
            f"oscar-k3v2); got {base.method!r} ({widths})"
        )
    return (KEY_BITS - base.key.bits) // (base.value.bits - VALUE_BITS)


def _rows(batches: Sequence[torch.LongTensor], config: OscarConfig) -> tuple[torch.Tensor, int]:
    """The rows cut to one length and joined into one sequence of whole windows, and that length."""
    context = min(b.shape[-1] for b in batches)
    if context <= config.sink + config.recent + 1:
        raise ValueError(
            f"bit allocation needs calibration rows longer than sink + recent = "
            f"{config.sink + config.recent} tokens; the shortest has {context}"
        )
    return torch.cat([b.reshape(-1)[:context] for b in batches]), context


def _mean_kl(model, tokens, caches, context, config, progress) -> dict[str, float]:
    """Mean KL from the unquantized model over the positions after ``sink + recent``, per cache."""
    stats, _ = position_stats_of_caches(model, tokens, caches, context, tokens.numel() // context, progress)
    first = config.sink + config.recent
    return {label: float(s[1, first:].mean()) for label, s in stats.items()}
