"""Calibration statistics for OSCAR rotations, captured through transformers' attention interface.

A private attention implementation sees the post-RoPE (and post q/k-norm) query and key and the raw
value of every attention layer, adds them to running float64 sums and then runs ordinary SDPA, so
the forward pass is unchanged and no activation is ever stored. The targets are exactly the
reference's (``rotation/compute_kv_rotation.py`` in github.com/FutureMLS-Lab/OSCAR):

* ``C_Q^(h) = Q_h^T Q_h / (n g)`` over the ``g`` query heads of KV head ``h`` (contiguous groups),
  ``C_Q`` = mean over KV heads, symmetrised; R_K is built from it (or, per KV head, from each C_Q^(h)).
* ``w_t^(h) = k_t C_Q^(h) k_t^T`` and ``C_S^(h) = sum_t w_t v_t^T v_t / sum_t w_t`` (the coded
  linearised surrogate of ``V^T S^T S V``), ``C_S`` = mean over KV heads, symmetrised; R_V is
  built from it (or, per KV head, from each C_S^(h)).

``C_S`` needs the finished ``C_Q^(h)``, so the same batches go through the model twice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from oscar_hf.core.attention import swapped_attention
from oscar_hf.log import get_logger
from oscar_hf.model_info import full_attention_layer_ids
from oscar_hf.rotations.rotation_set import RotationSet, rotation_from_covariance

logger = get_logger(__name__)

CALIBRATION_ATTENTION = "oscar_calibration"
# The reference floors the per-head weight sum before normalising the surrogate weights.
_MIN_WEIGHT_SUM = 1e-12


OBJECTIVES = ("qqt_sst", "ktk_vtv")


@dataclass
class LayerCovariances:
    """Calibration targets of one full-attention layer per KV head, float64 ``[H_kv, D, D]``, each symmetric.

    ``query_heads`` are the C_Q^(h) and ``value_heads`` the C_S^(h) (OSCAR's attention-aware
    targets); ``key_gram_heads`` (K_h^T K_h / n) and ``value_gram_heads`` (V_h^T V_h / n) are the
    tensor-reconstruction targets of the paper's ablation. The pooled targets (``query``, ``value``,
    ``key_gram``, ``value_gram``) are their means over KV heads, as the reference pools them.
    ``key_mean_heads`` ``[H_kv, D]`` is each KV head's mean key (for key centering). ``tokens`` is the
    number of calibration tokens seen.
    """

    query_heads: torch.Tensor
    value_heads: torch.Tensor
    key_gram_heads: torch.Tensor
    value_gram_heads: torch.Tensor
    tokens: int
    key_mean_heads: torch.Tensor

    @property
    def query(self) -> torch.Tensor:
        return _pooled(self.query_heads)

    @property
    def value(self) -> torch.Tensor:
        return _pooled(self.value_heads)

    @property
    def key_gram(self) -> torch.Tensor:
        return _pooled(self.key_gram_heads)

    @property
    def value_gram(self) -> torch.Tensor:
        return _pooled(self.value_gram_heads)

    def targets(self, objective: str, per_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(covariance for R_K, covariance for R_V) of an objective in :data:`OBJECTIVES`:
        pooled ``[D, D]``, or ``[H_kv, D, D]`` with ``per_head``."""
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if objective == "qqt_sst":
            heads = self.query_heads, self.value_heads
        else:
            heads = self.key_gram_heads, self.value_gram_heads
        return heads if per_head else (_pooled(heads[0]), _pooled(heads[1]))


class _LayerSums:
    """Running float64 sums of one layer, kept per KV head."""

    def __init__(self) -> None:
        self.query_outer: torch.Tensor | None = None  # [H_kv, D, D]: sum of q q^T over the group's query rows
        self.key_outer: torch.Tensor | None = None  # [H_kv, D, D]: sum of k k^T over tokens
        self.key_sum: torch.Tensor | None = None  # [H_kv, D]: sum of k over tokens
        self.value_outer: torch.Tensor | None = None  # [H_kv, D_v, D_v]: sum of v v^T over tokens
        self.group_size = 0
        self.tokens = 0
        self.query_per_head: torch.Tensor | None = None  # [H_kv, D, D]: C_Q^(h), set between the passes
        self.weighted_value_outer: torch.Tensor | None = None  # [H_kv, D_v, D_v]: sum of w v v^T
        self.weight_sum: torch.Tensor | None = None  # [H_kv]
        self.value_tokens = 0

    def add_queries(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        kv_heads = key.shape[1]
        batch, query_heads, length, dim = query.shape
        if query_heads % kv_heads:
            raise ValueError(f"{query_heads} query heads cannot be grouped onto {kv_heads} KV heads")
        group = query_heads // kv_heads
        # Contiguous GQA grouping, as repeat_kv does: KV head h serves query heads h*g .. (h+1)*g - 1.
        grouped = query.to(torch.float64).reshape(batch, kv_heads, group, length, dim)
        outer = torch.einsum("bhgti,bhgtj->hij", grouped, grouped)
        self.query_outer = outer if self.query_outer is None else self.query_outer + outer
        key_outer = torch.einsum("bhti,bhtj->hij", key.to(torch.float64), key.to(torch.float64))
        value_outer = torch.einsum("bhti,bhtj->hij", value.to(torch.float64), value.to(torch.float64))
        self.key_outer = key_outer if self.key_outer is None else self.key_outer + key_outer
        key_sum = key.to(torch.float64).sum(dim=(0, 2))
        self.key_sum = key_sum if self.key_sum is None else self.key_sum + key_sum
        self.value_outer = value_outer if self.value_outer is None else self.value_outer + value_outer
        self.group_size = group
        self.tokens += batch * length

    def finish_queries(self) -> None:
        self.query_per_head = self.query_outer / (self.tokens * self.group_size)

    def add_values(self, key: torch.Tensor, value: torch.Tensor) -> None:
        key = key.to(torch.float64)
        value = value.to(torch.float64)
        # w_t = k_t C_Q^(h) k_t^T: the mean squared raw logit of token t over the group's queries.
        weights = torch.einsum("bhti,hij,bhtj->bht", key, self.query_per_head, key)
        outer = torch.einsum("bht,bhti,bhtj->hij", weights, value, value)
        weight_sum = weights.sum(dim=(0, 2))
        if self.weighted_value_outer is None:
            self.weighted_value_outer, self.weight_sum = outer, weight_sum
        else:
            self.weighted_value_outer += outer
            self.weight_sum += weight_sum
        self.value_tokens += key.shape[0] * key.shape[2]

    def result(self) -> LayerCovariances:
        if self.value_tokens != self.tokens:
            raise RuntimeError(
                f"the two calibration passes saw different token counts ({self.tokens} vs {self.value_tokens})"
            )
        per_head_value = self.weighted_value_outer / self.weight_sum.clamp_min(_MIN_WEIGHT_SUM)[:, None, None]
        return LayerCovariances(
            _symmetrise(self.query_per_head),
            _symmetrise(per_head_value),
            _symmetrise(self.key_outer / self.tokens),
            _symmetrise(self.value_outer / self.tokens),
            self.tokens,
            self.key_sum / self.tokens,
        )


def _symmetrise(matrix: torch.Tensor) -> torch.Tensor:
    """``(M + M^T) / 2`` of one matrix or of each of a stack."""
    return (matrix + matrix.transpose(-1, -2)) / 2


def _pooled(per_head: torch.Tensor) -> torch.Tensor:
    """The mean over KV heads, symmetrised (the reference's pooled target)."""
    return _symmetrise(per_head.mean(dim=0))


LayerObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class _Recorder:
    """Hands the attention inputs of full-attention layers to ``observer(layer_id, query, key, value)``."""

    def __init__(self, is_full_attention: Callable[[int], bool], observer: LayerObserver) -> None:
        self.is_full_attention = is_full_attention
        self.observer = observer
        self.seen = False

    def observe(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict
    ) -> None:
        layer_id = getattr(module, "layer_idx", None)
        if layer_id is None:
            raise ValueError(f"{type(module).__name__} has no layer_idx, so calibration cannot attribute it to a layer")
        # Mistral-style models pass their window as a kwarg, Gemma3/Qwen2-style ones set it on the module.
        sliding = getattr(module, "sliding_window", None) is not None or kwargs.get("sliding_window") is not None
        if sliding or not self.is_full_attention(layer_id):
            return
        self.seen = True
        self.observer(layer_id, query, key, value)


# The registry is global, so the registered function reads the recorder of the pass in progress
# instead of capturing one (which would keep its statistics alive in the registry afterwards).
_active_recorder: _Recorder | None = None


def _calibration_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered attention function: records the inputs, then computes exactly what ``sdpa`` would."""
    if _active_recorder is not None:
        _active_recorder.observe(module, query, key, value, kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _as_batches(batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if len(batches) == 0:
        raise ValueError("calibration needs at least one batch of token ids")
    rows = [batch[None] if batch.ndim == 1 else batch for batch in batches]
    for batch in rows:
        if batch.ndim != 2 or batch.dtype != torch.long:
            raise ValueError(f"a batch must be a LongTensor [batch, seq_len], got {batch.dtype} {tuple(batch.shape)}")
    return rows


def observe_attention(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    observer: LayerObserver,
    description: str = "OSCAR calibration",
    progress: bool = True,
) -> None:
    """Run ``batches`` through ``model`` and call ``observer(layer_id, query, key, value)`` in every full-attention layer.

    Query and key are post-RoPE (and post q/k-norm), the value raw, exactly what the model's attention
    receives. Batches are ``[batch, seq_len]`` LongTensors of real tokens (no attention mask, so no
    padding). The model runs in eval mode with ``use_cache=False``; its attention implementation and
    training mode are restored afterwards, also on error.
    """
    global _active_recorder
    rows = _as_batches(batches)
    recorder = _Recorder(set(full_attention_layer_ids(model)).__contains__, observer)
    was_training = model.training
    # Only the attention inputs matter; keeping one logit skips most of the LM head where the model allows it.
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    try:
        _active_recorder = recorder
        model.eval()
        with swapped_attention(model, CALIBRATION_ATTENTION, _calibration_attention), torch.no_grad():
            for batch in tqdm(rows, desc=description, unit="batch", disable=not progress):
                model(input_ids=batch.to(model.device), use_cache=False, **extra)
    finally:
        _active_recorder = None
        model.train(was_training)
    if not recorder.seen:
        raise ValueError(
            f"{type(model).__name__} ran no full-attention layer through the attention interface: it has "
            "none, or it does not support set_attn_implementation"
        )


def collect_covariances(
    model: PreTrainedModel, batches: Sequence[torch.LongTensor], progress: bool = True
) -> dict[int, LayerCovariances]:
    """Exact float64 calibration targets of every full-attention layer over ``batches``, keyed by global layer id.

    Two passes (see :func:`observe_attention` for what a batch must be); sliding-window layers are skipped.
    """
    sums: dict[int, _LayerSums] = {}
    observe_attention(
        model,
        batches,
        lambda layer_id, q, k, v: sums.setdefault(layer_id, _LayerSums()).add_queries(q, k, v),
        "OSCAR calibration 1/2 (queries)",
        progress,
    )
    for layer_sums in sums.values():
        layer_sums.finish_queries()
    observe_attention(
        model,
        batches,
        lambda layer_id, q, k, v: sums[layer_id].add_values(k, v),
        "OSCAR calibration 2/2 (values)",
        progress,
    )
    covariances = {layer_id: sums[layer_id].result() for layer_id in sorted(sums)}
    logger.info("calibrated %d layers on %d tokens", len(covariances), next(iter(covariances.values())).tokens)
    return covariances


def collect_query_covariances(
    model: PreTrainedModel, batches: Sequence[torch.LongTensor], description: str, progress: bool = True
) -> dict[int, torch.Tensor]:
    """The first pass of :func:`collect_covariances` alone: ``C_Q^(h)`` of every full-attention layer, float64
    ``[H_kv, D, D]``, keyed by global layer id."""
    sums: dict[int, _LayerSums] = {}
    observe_attention(
        model,
        batches,
        lambda layer_id, q, k, v: sums.setdefault(layer_id, _LayerSums()).add_queries(q, k, v),
        description,
        progress,
    )
    for layer_sums in sums.values():
        layer_sums.finish_queries()
    return {layer_id: sums[layer_id].query_per_head for layer_id in sorted(sums)}


def rotations_from_covariances(
    covariances: dict[int, LayerCovariances], objective: str = "qqt_sst", factors: str = "UHP", per_head: bool = False
) -> RotationSet:
    """R_K and R_V of every layer from its targets: ``qqt_sst`` (OSCAR: C_Q, C_S) or ``ktk_vtv`` (K^T K, V^T V).

    ``factors`` selects the composition (see ``rotations.compose_rotation``). By default one R per
    layer comes from the targets pooled over KV heads; with ``per_head`` each KV head gets its own
    R from its own targets (``[H_kv, D, D]``: C_Q^(h) of its query group, C_S^(h) with its own
    weights). The ascending eigenvalues of the covariances are kept in the returned set.
    """
    key, value, key_eigenvalues, value_eigenvalues = {}, {}, {}, {}
    for layer_id, layer in covariances.items():
        key_target, value_target = layer.targets(objective, per_head)
        key[layer_id], key_eigenvalues[layer_id] = _rotations(key_target, factors)
        value[layer_id], value_eigenvalues[layer_id] = _rotations(value_target, factors)
    first = next(iter(covariances.values()))
    grouping = f", one per KV head ({first.query_heads.shape[0]})" if per_head else ""
    return RotationSet(
        head_dim=first.query_heads.shape[-1],
        key=key,
        value=value,
        description=f"OSCAR {objective} rotations ({factors or 'identity'}{grouping}), {first.tokens} calibration tokens",
        key_eigenvalues=key_eigenvalues,
        value_eigenvalues=value_eigenvalues,
    )


def _rotations(target: torch.Tensor, factors: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, eigenvalues) of a ``[D, D]`` target, or of each head of a ``[H_kv, D, D]`` one, stacked."""
    if target.ndim == 2:
        return rotation_from_covariance(target, factors)
    rotations, eigenvalues = zip(*(rotation_from_covariance(head, factors) for head in target.unbind(0)))
    return torch.stack(rotations), torch.stack(eigenvalues)


def fit_rotations(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    factors: str = "UHP",
    progress: bool = True,
    objective: str = "qqt_sst",
    per_head: bool = False,
) -> RotationSet:
    """OSCAR rotations of every full-attention layer: R_K from C_Q and R_V from C_S, each ``U·H·P`` by default.

    ``per_head``: one R per KV head from that head's own targets instead of one per layer.
    """
    return rotations_from_covariances(collect_covariances(model, batches, progress), objective, factors, per_head)
