"""Calibration statistics for OSCAR rotations, captured through transformers' attention interface.

A private attention implementation sees the post-RoPE (and post q/k-norm) query and key and the raw
value of every attention layer, adds them to running float64 sums and then runs ordinary SDPA, so
the forward pass is unchanged and no activation is ever stored. The targets are exactly the
reference's (oscar-reference.md section 1.2):

* ``C_Q^(h) = Q_h^T Q_h / (n g)`` over the ``g`` query heads of KV head ``h`` (contiguous groups),
  ``C_Q`` = mean over KV heads, symmetrised; R_K is built from it.
* ``w_t^(h) = k_t C_Q^(h) k_t^T`` and ``C_S^(h) = sum_t w_t v_t^T v_t / sum_t w_t`` (the coded
  linearised surrogate of ``V^T S^T S V``), ``C_S`` = mean over KV heads, symmetrised; R_V is
  built from it.

``C_S`` needs the finished ``C_Q^(h)``, so the same batches go through the model twice.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .log import get_logger
from .rotations import RotationSet, rotation_from_covariance

logger = get_logger(__name__)

CALIBRATION_ATTENTION = "oscar_calibration"
# The reference floors the per-head weight sum before normalising the surrogate weights.
_MIN_WEIGHT_SUM = 1e-12


@dataclass
class LayerCovariances:
    """Calibration targets of one full-attention layer: ``query`` is C_Q ``[D, D]`` and ``value`` is C_S
    ``[D_v, D_v]`` (both float64, symmetric); ``tokens`` is the number of calibration tokens seen."""

    query: torch.Tensor
    value: torch.Tensor
    tokens: int


class _LayerSums:
    """Running float64 sums of one layer, kept per KV head."""

    def __init__(self) -> None:
        self.query_outer: torch.Tensor | None = None  # [H_kv, D, D]: sum of q q^T over the group's query rows
        self.group_size = 0
        self.tokens = 0
        self.query_per_head: torch.Tensor | None = None  # [H_kv, D, D]: C_Q^(h), set between the passes
        self.weighted_value_outer: torch.Tensor | None = None  # [H_kv, D_v, D_v]: sum of w v v^T
        self.weight_sum: torch.Tensor | None = None  # [H_kv]
        self.value_tokens = 0

    def add_queries(self, query: torch.Tensor, kv_heads: int) -> None:
        batch, query_heads, length, dim = query.shape
        if query_heads % kv_heads:
            raise ValueError(f"{query_heads} query heads cannot be grouped onto {kv_heads} KV heads")
        group = query_heads // kv_heads
        # Contiguous GQA grouping, as repeat_kv does: KV head h serves query heads h*g .. (h+1)*g - 1.
        grouped = query.to(torch.float64).reshape(batch, kv_heads, group, length, dim)
        outer = torch.einsum("bhgti,bhgtj->hij", grouped, grouped)
        self.query_outer = outer if self.query_outer is None else self.query_outer + outer
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
        query = _symmetrise(self.query_per_head.mean(dim=0))
        per_head_value = self.weighted_value_outer / self.weight_sum.clamp_min(_MIN_WEIGHT_SUM)[:, None, None]
        return LayerCovariances(query, _symmetrise(per_head_value.mean(dim=0)), self.tokens)


def _symmetrise(matrix: torch.Tensor) -> torch.Tensor:
    return (matrix + matrix.T) / 2


def _declared_full_attention(model: PreTrainedModel) -> Callable[[int], bool]:
    """Whether the config declares a layer id full attention (every layer when it has no ``layer_types``)."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    if layer_types is None:
        return lambda layer_id: True
    return lambda layer_id: layer_types[layer_id] == "full_attention"


class _Recorder:
    """Routes the attention inputs of full-attention layers into one of the two passes."""

    def __init__(self, is_full_attention: Callable[[int], bool]) -> None:
        self.is_full_attention = is_full_attention
        self.layers: dict[int, _LayerSums] = {}
        self.value_pass = False

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
        if self.value_pass:
            self.layers[layer_id].add_values(key, value)
        else:
            self.layers.setdefault(layer_id, _LayerSums()).add_queries(query, key.shape[1])


# The registry is global, so the registered function reads the recorder of the calibration in progress
# instead of capturing one (which would keep its sums alive in the registry afterwards).
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


def _forward_all(model: PreTrainedModel, batches: Sequence[torch.Tensor], description: str, progress: bool) -> None:
    # Only the attention inputs matter; keeping one logit skips most of the LM head where the model allows it.
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    for batch in tqdm(batches, desc=description, unit="batch", disable=not progress):
        model(input_ids=batch.to(model.device), use_cache=False, **extra)


def _as_batches(batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if len(batches) == 0:
        raise ValueError("calibration needs at least one batch of token ids")
    rows = [batch[None] if batch.ndim == 1 else batch for batch in batches]
    for batch in rows:
        if batch.ndim != 2 or batch.dtype != torch.long:
            raise ValueError(f"a batch must be a LongTensor [batch, seq_len], got {batch.dtype} {tuple(batch.shape)}")
    return rows


def collect_covariances(
    model: PreTrainedModel, batches: Sequence[torch.LongTensor], progress: bool = True
) -> dict[int, LayerCovariances]:
    """Exact float64 C_Q and C_S of every full-attention layer over ``batches``, keyed by global layer id.

    Each batch is a ``[batch, seq_len]`` (or ``[seq_len]``) LongTensor of real tokens: there is no
    attention mask, so every token counts and batches must not contain padding. Sliding-window
    layers are skipped. The model runs twice over the batches in eval mode with ``use_cache=False``;
    its attention implementation and training mode are restored afterwards, also on error.
    """
    global _active_recorder
    rows = _as_batches(batches)
    recorder = _Recorder(_declared_full_attention(model))
    AttentionInterface.register(CALIBRATION_ATTENTION, _calibration_attention)
    # Without a registered mask function under the same name, create_causal_mask silently returns None.
    AttentionMaskInterface.register(CALIBRATION_ATTENTION, sdpa_mask)
    previous = _attention_implementations(model)
    was_training = model.training
    try:
        _active_recorder = recorder
        model.eval()
        model.set_attn_implementation(CALIBRATION_ATTENTION)
        with torch.no_grad():
            _forward_all(model, rows, "OSCAR calibration 1/2 (queries)", progress)
            if not recorder.layers:
                raise ValueError(
                    f"{type(model).__name__} ran no full-attention layer through the attention interface: it has "
                    "none, or it does not support set_attn_implementation"
                )
            for sums in recorder.layers.values():
                sums.finish_queries()
            recorder.value_pass = True
            _forward_all(model, rows, "OSCAR calibration 2/2 (values)", progress)
    finally:
        _active_recorder = None
        model.set_attn_implementation(previous)
        model.train(was_training)
    covariances = {layer_id: recorder.layers[layer_id].result() for layer_id in sorted(recorder.layers)}
    logger.info("calibrated %d layers on %d tokens", len(covariances), next(iter(covariances.values())).tokens)
    return covariances


def _attention_implementations(model: PreTrainedModel) -> dict[str, str]:
    """The current implementation of the model and of each sub-config, in set_attn_implementation's dict form."""
    config = model.config
    implementations = {"": config._attn_implementation}
    for name in config.sub_configs:
        sub_config = getattr(config, name, None)
        if sub_config is not None:
            implementations[name] = sub_config._attn_implementation
    return implementations


def calibrate(
    model: PreTrainedModel, batches: Sequence[torch.LongTensor], factors: str = "UHP", progress: bool = True
) -> RotationSet:
    """OSCAR rotations of every full-attention layer: R_K from C_Q and R_V from C_S, each ``U·H·P`` by default.

    ``factors`` selects the composition (see ``rotations.compose_rotation``); the ascending
    eigenvalues of both covariances are kept in the returned set.
    """
    covariances = collect_covariances(model, batches, progress)
    key, value, key_eigenvalues, value_eigenvalues = {}, {}, {}, {}
    for layer_id, layer in covariances.items():
        key[layer_id], key_eigenvalues[layer_id] = rotation_from_covariance(layer.query, factors)
        value[layer_id], value_eigenvalues[layer_id] = rotation_from_covariance(layer.value, factors)
    first = next(iter(covariances.values()))
    return RotationSet(
        head_dim=first.query.shape[0],
        key=key,
        value=value,
        description=f"OSCAR qqt_sst rotations ({factors or 'identity'}), {first.tokens} calibration tokens",
        key_eigenvalues=key_eigenvalues,
        value_eigenvalues=value_eigenvalues,
    )


def token_batches(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    budget: int = 20000,
    seq_len: int = 2048,
    seed: int = 0,
) -> list[torch.LongTensor]:
    """Calibration batches of exactly ``budget`` tokens (fewer if the texts are shorter), as ``[1, <=seq_len]`` rows.

    The texts are tokenized without special tokens and joined with EOS into one stream, which is cut
    into consecutive ``seq_len`` windows; ``seed`` picks which windows are used (so the budget is
    spread over all texts rather than taken from the first), and the last one is shortened to fit
    the budget. Every row is real text, so no padding is needed.
    """
    if budget <= 0 or seq_len <= 0:
        raise ValueError(f"budget and seq_len must be positive, got {budget} and {seq_len}")
    stream = _token_stream(tokenizer, texts)
    starts = list(range(0, max(len(stream) - seq_len, 0) + 1, seq_len))
    random.Random(seed).shuffle(starts)
    rows, remaining = [], budget
    for start in starts:
        row = stream[start : start + min(seq_len, remaining)]
        rows.append(torch.tensor(row, dtype=torch.long)[None])
        remaining -= len(row)
        if remaining == 0:
            break
    if remaining:
        logger.warning("the calibration texts hold only %d of the %d requested tokens", budget - remaining, budget)
    return rows


def _token_stream(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[int]:
    separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    stream: list[int] = []
    for text in texts:
        if stream:
            stream += separator
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
    if not stream:
        raise ValueError("the calibration texts are empty")
    return stream
