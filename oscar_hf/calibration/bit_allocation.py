"""Per-layer bit widths at a method's budget: wider keys where they help most, paid for by 1-bit values.

Each layer is scored on calibration rows, by the teacher-forced KL divergence of the model's next-token
distributions from the unquantized model's (:func:`oscar_hf.calibration.teacher_forcing.position_stats_of_caches`),
against the baseline of the given rotations and clip ratios at the base method's widths everywhere:

* ``key_gain``: how much the KL falls with that layer's keys at each width given above the base's, up to 4
  bits (3 and 4 against ``oscar-int2``'s 2 by default; only 4 against ``oscar-k3v2``'s 3);
* ``value_cost``: how much it rises with that layer's values at 1 bit (levels ``mu +- 0.798 sigma``).

A budget of ``N`` layers' worth of 4-bit keys, ``(4 - K) N`` extra key bits a row, goes to the widths whose
summed gain is largest (a knapsack over the layers: 3-bit keys in two layers can beat 4-bit keys in one), and
the cheapest layers take 1-bit values, as many as pay for those bits: ``2N`` against ``oscar-int2`` (K2 V2),
``N`` against ``oscar-k3v2`` (K3 V2), so the history keeps its size.

The scores do not depend on ``N``, only the choice over them does: a saved set's recorded scores
(``bit_allocation`` in its ``config.json``) give the widths at another budget without scoring again
(:meth:`BitAllocation.from_dict`, :meth:`BitAllocation.respend`).
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

KEY_BITS, VALUE_BITS = 4, 1  # the widest keys and the narrowest values an allocation gives


@dataclass
class BitAllocation:
    """Per-layer scores (KL in nats, mean over the scored positions) and the widths chosen.

    ``key_gain`` maps each key width tried to its gain per layer; ``key_bits`` the layers whose keys were
    widened to their width; ``value_layers`` the layers whose values went to 1 bit.
    """

    baseline_kl: float
    key_gain: dict[int, dict[int, float]]
    value_cost: dict[int, float]
    key_bits: dict[int, int]
    value_layers: list[int]
    allocated_kl: float | None = None
    positions: int = 0
    base_bits: tuple[int, int] = (2, 2)

    def to_dict(self) -> dict:
        return {
            "baseline_kl": round(self.baseline_kl, 6),
            "allocated_kl": None if self.allocated_kl is None else round(self.allocated_kl, 6),
            "key_bits": {str(i): bits for i, bits in sorted(self.key_bits.items())},
            "value_bits": {str(i): VALUE_BITS for i in self.value_layers},
            "base_bits": dict(zip(("key", "value"), self.base_bits)),
            "key_gain": {
                str(bits): {str(i): round(v, 6) for i, v in sorted(gain.items())}
                for bits, gain in self.key_gain.items()
            },
            "value_cost": {str(i): round(v, 6) for i, v in sorted(self.value_cost.items())},
            "positions": self.positions,
        }

    @classmethod
    def from_dict(cls, record: dict) -> BitAllocation:
        """The allocation :meth:`to_dict` recorded (a saved set's ``bit_allocation``)."""
        return cls(
            record["baseline_kl"],
            {int(bits): {int(i): v for i, v in gain.items()} for bits, gain in record["key_gain"].items()},
            {int(i): v for i, v in record["value_cost"].items()},
            {int(i): bits for i, bits in record["key_bits"].items()},
            sorted(int(i) for i in record["value_bits"]),
            record["allocated_kl"],
            record["positions"],
            (record["base_bits"]["key"], record["base_bits"]["value"]),
        )

    def respend(self, layers: int) -> BitAllocation:
        """The same scores spent on ``layers`` layers' worth of 4-bit keys; ``allocated_kl`` is None (not measured)."""
        key_bits, value_layers = _choose(self.key_gain, self.value_cost, layers, self.base_bits)
        return replace(self, key_bits=key_bits, value_layers=value_layers, allocated_kl=None)

    def widths_of(self, rotations: RotationSet) -> RotationSet:
        """``rotations`` with this allocation's per-layer widths and base widths."""
        value_bits = dict.fromkeys(self.value_layers, VALUE_BITS)
        return replace(rotations, key_bits=dict(self.key_bits), value_bits=value_bits, base_bits=self.base_bits)


def allocate_bits(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    rotations: RotationSet,
    layers: int,
    base: OscarConfig = METHODS["oscar-int2"],
    key_widths: Sequence[int] = (3, KEY_BITS),
    progress: bool = True,
) -> tuple[RotationSet, BitAllocation]:
    """Score every layer's wider keys and 1-bit values against ``base``'s widths; return ``rotations`` with
    the widths stored (``layers`` layers' worth of 4-bit keys spent where they gain most, :func:`widest_gain`;
    V1 in as many of the cheapest layers as keep ``base``'s history bits; ``base_bits`` set to ``base``'s
    widths) and the scores.

    ``batches``: calibration rows ``[1, T]`` longer than ``base.sink + base.recent`` (cut to the
    shortest one's length). ``base`` must be a calibrated method with keys below 4 bits and values
    above 1 bit whose key step is paid by a whole number of value layers (``oscar-int2``, ``oscar-k3v2``);
    ``rotations`` supply its rotations and clip ratios (e.g. those of :func:`oscar_hf.calibration.clip_search.search_layers`).
    ``key_widths``: the key widths the allocation may give; those above ``base``'s are scored.
    Costs ``(W + 1) L + 2`` teacher-forced passes per row for ``L`` layers and ``W`` key widths above the
    base's, plus one unquantized pass.
    """
    value_layers_per_key_layer(base)  # raises for a base the trade does not fit
    tokens, context = _rows(batches, base)
    probe = OscarCache(model, base, rotations=replace(rotations, key_bits={}, value_bits={}))
    layer_ids = [i for i, layer in enumerate(probe.layers) if isinstance(layer, OscarLayer)]
    base_bits = (base.key.bits, base.value.bits)
    _check_budget(layers, len(layer_ids), base_bits)
    key_widths = sorted(bits for bits in set(key_widths) if base.key.bits < bits <= KEY_BITS)
    if not key_widths:
        raise ValueError(f"no key width above {base.method}'s {base.key.bits} bits to allocate (up to {KEY_BITS})")

    def widths(key_bits: dict[int, int], value_bits: dict[int, int]) -> RotationSet:
        return replace(rotations, key_bits=key_bits, value_bits=value_bits, base_bits=base_bits)

    def cache(key_bits: dict[int, int], value_bits: dict[int, int]) -> OscarCache:
        return OscarCache(model, base, rotations=widths(key_bits, value_bits), allow_bits_change=True)

    caches = {"baseline": probe}
    caches |= {f"k{bits}_{i}": cache({i: bits}, {}) for bits in key_widths for i in layer_ids}
    caches |= {f"v{i}": cache({}, {i: VALUE_BITS}) for i in layer_ids}
    kl = _mean_kl(model, tokens, caches, context, base, progress)
    baseline = kl["baseline"]
    key_gain = {bits: {i: baseline - kl[f"k{bits}_{i}"] for i in layer_ids} for bits in key_widths}
    value_cost = {i: kl[f"v{i}"] - baseline for i in layer_ids}
    key_bits, value_layers = _choose(key_gain, value_cost, layers, base_bits)
    allocated = widths(key_bits, dict.fromkeys(value_layers, VALUE_BITS))
    final = _mean_kl(
        model, tokens, {"allocated": OscarCache(model, base, rotations=allocated)}, context, base, progress
    )["allocated"]
    scores = BitAllocation(
        baseline,
        key_gain,
        value_cost,
        key_bits,
        value_layers,
        final,
        (context - 1 - base.sink - base.recent) * len(batches),
        base_bits,
    )
    return allocated, scores


def _choose(
    key_gain: dict[int, dict[int, float]], value_cost: dict[int, float], layers: int, base_bits: tuple[int, int]
) -> tuple[dict[int, int], list[int]]:
    """The key widths and the 1-bit value layers ``layers`` layers' worth of 4-bit keys buy from the scores."""
    _check_budget(layers, len(value_cost), base_bits)
    key_bits = widest_gain(key_gain, (KEY_BITS - base_bits[0]) * layers, base_bits[0])
    cheapest = sorted(value_cost, key=lambda i: value_cost[i])
    return key_bits, sorted(cheapest[: _value_per_key(base_bits) * layers])


def _check_budget(layers: int, quantized: int, base_bits: tuple[int, int]) -> None:
    per_key = _value_per_key(base_bits)
    if not 1 <= layers <= quantized // per_key:
        raise ValueError(
            f"--allocate-bits takes 1 to {quantized // per_key} layers for this model's {quantized} quantized layers "
            f"(the bits of 4-bit keys in N, paid by 1-bit values in {per_key}N), got {layers}"
        )


def _value_per_key(base_bits: tuple[int, int]) -> int:
    return (KEY_BITS - base_bits[0]) // (base_bits[1] - VALUE_BITS)


def widest_gain(key_gain: dict[int, dict[int, float]], budget: int, base_bits: int) -> dict[int, int]:
    """``{layer: bits}``: the key widths that spend exactly ``budget`` bits above ``base_bits`` with the
    largest summed gain, each layer at its base width or one of ``key_gain``'s (a knapsack over the layers,
    gains taken as additive; ties keep the narrower choice met first)."""
    layers = sorted(next(iter(key_gain.values())))
    best: dict[int, tuple[float, dict[int, int]]] = {0: (0.0, {})}  # bits spent -> (summed gain, widths)
    for layer in layers:
        extended = dict(best)
        for spent, (gain, chosen) in best.items():
            for bits, gains in key_gain.items():
                total, cost = gain + gains[layer], spent + bits - base_bits
                if cost <= budget and (cost not in extended or total > extended[cost][0]):
                    extended[cost] = (total, {**chosen, layer: bits})
        best = extended
    if budget not in best:
        raise ValueError(f"no choice of key widths {sorted(key_gain)} spends exactly {budget} bits")
    return dict(sorted(best[budget][1].items()))


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
    return _value_per_key((base.key.bits, base.value.bits))


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
