"""Teacher-forced evaluation of a cache configuration in one forward pass.

Step-by-step decoding with an :class:`~oscar_hf.OscarCache` from the first token shows query ``i``
the keys ``[sink_start, sink_start + h(i))`` quantized (the history at that step) and every other
key in high precision. One forward pass with that per-(query, key) choice gives the same logits
as decoding token by token, without running thousands of decode steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .cache import OscarCache, OscarLayer
from .config import OscarConfig

TEACHER_FORCED = "oscar_teacher_forced"
_state: dict[str, object] = {}


def history_lengths(length: int, config: OscarConfig) -> torch.Tensor:
    """h(i): tokens in the quantized history when query ``i`` is decoded (no padding).

    The recent window holds ``recent``..``recent + block - 1`` tokens including the new one and is
    demoted ``block`` at a time, so h jumps by ``block`` each time the window reaches ``recent + block``.
    """
    steps = torch.arange(length)
    window = steps + 1 - config.sink  # the window's size if nothing had been demoted yet
    if not config.quantized:
        return torch.zeros(length, dtype=torch.long)
    demoted = config.block * torch.div(window - config.recent, config.block, rounding_mode="floor")
    return torch.where(window >= config.recent + config.block, demoted, torch.zeros_like(demoted))


def quantized_key_mask(length: int, config: OscarConfig, device: torch.device) -> torch.Tensor:
    """Boolean ``[query, key]``: whether query ``i`` sees key ``j`` through the quantized history."""
    keys = torch.arange(length, device=device)
    ends = config.sink + history_lengths(length, config).to(device)
    return (keys[None, :] >= config.sink) & (keys[None, :] < ends[:, None])


def _teacher_forced_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    cache: OscarCache = _state["cache"]
    layer = cache.layers[module.layer_idx]
    if not isinstance(layer, OscarLayer) or not layer.config.quantized:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if attention_mask is not None and attention_mask.dtype == torch.bool and not bool(attention_mask.any(-1).all()):
        raise ValueError("teacher-forced evaluation takes unpadded sequences")
    keys_hp, values_hp = layer.rotate_keys(key), layer.rotate_values(value)
    keys_q, values_q = layer.history_roundtrip(keys_hp, values_hp)
    batch, q_heads, length, head_dim = query.shape
    groups = q_heads // key.shape[1]
    # One fused softmax over two copies of every key: the quantized copy is visible to query i for the
    # keys in its history, the high-precision copy for every other causal key. Each (i, j) is counted
    # once, so this is exactly the mixed attention, without [T, T] score tensors per head.
    from_history = quantized_key_mask(length, layer.config, query.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    mask = torch.cat([from_history, causal & ~from_history], dim=1)
    keys = torch.cat([keys_q, keys_hp], dim=2).float().repeat_interleave(groups, dim=1)
    values = torch.cat([values_q, values_hp], dim=2).float().repeat_interleave(groups, dim=1)
    output = torch.nn.functional.scaled_dot_product_attention(
        layer.rotate_keys(query).float(), keys, values, attn_mask=mask,
        scale=scaling if scaling is not None else head_dim**-0.5,
    )
    output = layer.unrotate_values(output.to(query.dtype))
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(TEACHER_FORCED, _teacher_forced_attention)
AttentionMaskInterface.register(TEACHER_FORCED, sdpa_mask)


@contextlib.contextmanager
def _teacher_forced(model: PreTrainedModel, cache: OscarCache) -> Iterator[None]:
    previous = model.config._attn_implementation
    model.set_attn_implementation(TEACHER_FORCED)
    _state["cache"] = cache
    try:
        yield
    finally:
        _state.clear()
        model.set_attn_implementation(previous)


@torch.no_grad()
def teacher_forced_logits(model: PreTrainedModel, input_ids: torch.Tensor, cache: OscarCache) -> torch.Tensor:
    """Logits ``[batch, length, vocab]`` that decoding ``input_ids`` token by token with ``cache``'s configuration gives.

    ``cache`` only supplies the configuration and rotations; it is not filled.
    """
    with _teacher_forced(model, cache):
        return model(input_ids, use_cache=False).logits
