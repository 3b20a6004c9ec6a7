"""Per-layer clip ratios and rotation variant, chosen by attention-output error (beyond the reference).

The reference clips every layer at fixed ratios (K 0.96, V 0.92) and always uses R = U·H·P. Here
each layer picks, separately for K and V, the (rotation variant, clip ratio) pair from a small grid
that minimises the error of its attention output on calibration tokens, when the keys (or values)
in the history are quantized as step-by-step decoding would see them (sink and recent window
exact). Errors of K and V are measured one at a time: K's error moves the attention weights, V's
only the mixed values, so they barely interact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from oscar_hf.calibration.covariances import LayerCovariances, observe_attention, rotations_from_covariances
from oscar_hf.calibration.teacher_forcing import quantized_key_mask
from oscar_hf.config import METHODS, OscarConfig
from oscar_hf.core.quantize_jobs import roundtrip_rows
from oscar_hf.rotations.rotation_set import RotationSet

CLIP_GRID = (1.0, 0.96, 0.92, 0.88, 0.84, 0.80, 0.75)
VARIANTS = ("UHP", "HP")


@dataclass
class LayerChoice:
    """The chosen (variant, clip ratio) of K and V in one layer, with every candidate's relative output error.

    Candidates are keyed ``"<factors>@<clip ratio>"``; errors are squared attention-output errors
    over the squared reference output.
    """

    key_factors: str
    key_clip: float
    value_factors: str
    value_clip: float
    key_errors: dict[str, float]
    value_errors: dict[str, float]


class _LayerErrors:
    """Summed squared attention-output errors of every candidate of one layer."""

    def __init__(self) -> None:
        self.key: dict[tuple[str, float], float] = {}
        self.value: dict[tuple[str, float], float] = {}
        self.reference = 0.0

    def add(self, table: dict, candidate: tuple[str, float], error: float) -> None:
        table[candidate] = table.get(candidate, 0.0) + error


class _Search:
    def __init__(
        self,
        variants: dict[str, RotationSet],
        config: OscarConfig,
        grid: Sequence[float],
        max_queries: int,
        key_means: dict[int, torch.Tensor],
        layers: Sequence[int] | None = None,
        values: bool = True,
    ) -> None:
        self.variants, self.config, self.grid, self.max_queries = variants, config, grid, max_queries
        self.key_means = key_means  # layer -> [H_kv, D]: keys are quantized centered (none: uncentered)
        self.layers = layers  # the layers measured (None: all)
        self.values = values  # False: only the keys' candidates are measured
        self.errors: dict[int, _LayerErrors] = {}

    def _queries(self, from_history: torch.Tensor) -> torch.Tensor:
        """Evenly spaced query positions among those that see quantized keys (the cost is linear in them)."""
        candidates = from_history.any(-1).nonzero().flatten()
        if candidates.numel() == 0:
            raise ValueError("calibration rows are too short for the clip search: no key reaches the history")
        picks = torch.linspace(0, candidates.numel() - 1, min(self.max_queries, candidates.numel())).round().long()
        return candidates[picks]

    def observe(self, layer_id: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.layers is not None and layer_id not in self.layers:
            return
        errors = self.errors.setdefault(layer_id, _LayerErrors())
        length, head_dim = key.shape[2], key.shape[3]
        full_mask = quantized_key_mask(length, self.config, query.device)
        rows = self._queries(full_mask)
        from_history = full_mask[rows]
        causal = rows[:, None] >= torch.arange(length, device=query.device)[None, :]
        groups = query.shape[1] // key.shape[1]
        q = query[:, :, rows].float().unflatten(1, (key.shape[1], groups))  # [B, Hkv, g, Q, D]
        k, v = key.float().unsqueeze(2), value.float().unsqueeze(2)
        scale = head_dim**-0.5
        exact_scores = (q @ k.transpose(-1, -2)) * scale
        probs = exact_scores.masked_fill(~causal, float("-inf")).softmax(-1)
        reference = probs @ v
        errors.reference += reference.pow(2).sum().item()
        for factors, rotations in self.variants.items():
            r_k, r_v = (_by_kv_head(r[layer_id].to(q.device)) for r in (rotations.key, rotations.value))
            q_rot, k_rot, v_rot = q @ r_k, k @ r_k, v @ r_v
            mean = self.key_means.get(layer_id)
            # a centered layer quantizes k - mu and attends with mu added back: the scores' common shift
            mean = 0.0 if mean is None else mean.to(q.device, torch.float32).reshape(-1, 1, 1, head_dim) @ r_k
            feedback = rotations.key_feedback.get(layer_id)
            feedback = None if feedback is None else feedback.to(q.device)
            for ratio in self.grid:
                spec = replace(self.config.key, clip_ratio=ratio)
                # the factors address [..., H_kv, T, D] rows: the query-group axis of k_rot (size 1) goes
                k_hat = roundtrip_rows((k_rot - mean)[:, :, 0], spec, self.config.metadata_dtype, feedback)
                scores = torch.where(
                    from_history, (q_rot @ (k_hat[:, :, None] + mean).transpose(-1, -2)) * scale, exact_scores
                )
                output = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
                errors.add(errors.key, (factors, ratio), (output - reference).pow(2).sum().item())
                if not self.values:
                    continue
                v_hat = roundtrip_rows(v_rot, replace(self.config.value, clip_ratio=ratio), self.config.metadata_dtype)
                mixed = (probs * from_history) @ v_hat + (probs * ~from_history) @ v_rot
                errors.add(errors.value, (factors, ratio), (mixed - reference @ r_v).pow(2).sum().item())

    def choices(self) -> dict[int, LayerChoice]:
        result = {}
        for layer_id, errors in sorted(self.errors.items()):
            key_best = min(errors.key, key=errors.key.get)
            value_best = min(errors.value, key=errors.value.get)
            result[layer_id] = LayerChoice(
                key_best[0],
                key_best[1],
                value_best[0],
                value_best[1],
                {f"{f}@{r}": e / errors.reference for (f, r), e in errors.key.items()},
                {f"{f}@{r}": e / errors.reference for (f, r), e in errors.value.items()},
            )
        return result


def _by_kv_head(rotation: torch.Tensor) -> torch.Tensor:
    """A rotation that multiplies ``[B, Hkv, g, T, D]`` rows: ``[D, D]``, or ``[Hkv, 1, D, D]`` per KV head."""
    return rotation if rotation.ndim == 2 else rotation[:, None]


def search_layers(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    covariances: dict[int, LayerCovariances],
    config: OscarConfig = METHODS["oscar-int2"],
    grid: Sequence[float] = CLIP_GRID,
    variants: Sequence[str] = VARIANTS,
    max_queries: int = 256,
    progress: bool = True,
    per_head: bool = False,
    center_keys: bool = False,
) -> tuple[RotationSet, dict[int, LayerChoice]]:
    """Pick each layer's K and V rotation variant and clip ratio; return the resulting rotations and the choices.

    ``batches`` should be a few rows of calibration tokens, longer than ``config.sink + config.recent``
    so that keys reach the history; errors are measured at up to ``max_queries`` query positions
    per row, each costing one attention per candidate and layer. With ``per_head`` every variant is
    built per KV head (its own C_Q^(h) and C_S^(h)); the choice of variant and clip stays per layer.
    With ``center_keys`` keys are quantized centered on their calibration mean, which the set keeps.
    """
    built = {factors: rotations_from_covariances(covariances, "qqt_sst", factors, per_head) for factors in variants}
    key_means = {i: c.key_mean_heads.float() for i, c in covariances.items()} if center_keys else {}
    search = _Search(built, config, grid, max_queries, key_means)
    observe_attention(model, batches, search.observe, "OSCAR clip search", progress)
    choices = search.choices()
    base = built[variants[0]]
    return (
        RotationSet(
            head_dim=base.head_dim,
            key={i: built[c.key_factors].key[i] for i, c in choices.items()},
            value={i: built[c.value_factors].value[i] for i, c in choices.items()},
            description=f"{base.description}; per-layer rotation variant and clip ratios by attention-output error",
            key_eigenvalues=base.key_eigenvalues,
            value_eigenvalues=base.value_eigenvalues,
            key_clip={i: c.key_clip for i, c in choices.items()},
            value_clip={i: c.value_clip for i, c in choices.items()},
            key_mean={i: key_means[i] for i in choices if i in key_means},
            base_bits=(config.key.bits, config.value.bits),
        ),
        choices,
    )


def search_key_clips(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    rotations: RotationSet,
    config: OscarConfig = METHODS["oscar-int2"],
    grid: Sequence[float] = CLIP_GRID,
    max_queries: int = 256,
    progress: bool = True,
) -> tuple[RotationSet, dict[int, dict[str, float]]]:
    """Choose each layer's key clip ratio again with its keys quantized as ``rotations`` stores them: its
    R_K, key means and key feedback factors (the rotation variants and the values stay). Only layers whose
    keys a cache clips by the set are measured: keys at the set's searched width, ``config``'s
    (:meth:`oscar_hf.config.OscarConfig.for_layer`).

    Key feedback repairs rounding error and not clipping error, so a layer fed back clips less than the
    search without it chose. Returns the set with the new ratios and each candidate's relative error.
    """
    bits = rotations.base_bits[0]
    layers = [i for i in sorted(rotations.key) if rotations.key_bits.get(i, bits) == bits == config.key.bits]
    if not layers:
        return rotations, {}
    key_means = {i: mean.float() for i, mean in rotations.key_mean.items()}
    search = _Search({"set": rotations}, config, grid, max_queries, key_means, layers, values=False)
    observe_attention(model, batches, search.observe, "OSCAR key clips under key feedback", progress)
    clips, errors = {}, {}
    for layer_id, layer_errors in sorted(search.errors.items()):
        clips[layer_id] = min(layer_errors.key, key=layer_errors.key.get)[1]
        errors[layer_id] = {str(ratio): e / layer_errors.reference for (_, ratio), e in layer_errors.key.items()}
    return replace(rotations, key_clip={**rotations.key_clip, **clips}), errors
