"""The ``"oscar"`` attention implementation: exact softmax over ``[sink | history | recent | new]``.

transformers hands an attention function the new K/V that ``Cache.update`` returned, never the
cache. ``OscarCache.update`` records itself as the active cache, and this function finds the
layer's stored state through it and ``module.layer_idx``. Attention runs in the rotated basis:
``q·R_K`` against stored ``K·R_K`` (so scores equal ``q·k``), and the output is mapped back with
``o·R_V^T``.

Two paths: decoding one token goes through :func:`oscar_hf.kernels.decode_attention.decode_attention`
(the split-K Triton kernel reading packed history on GPU, its torch reference elsewhere); prefill
and chunked prefill dequantize one layer's history transiently and run SDPA (prefill is
compute-bound, and nothing dense outlives the call). On CUDA, plain ``generate`` sets up graph replay
at a cache's first one-token step (:meth:`OscarCache.freeze_for_decoding`): whole steps
(:mod:`oscar_hf.core.step_replay`), or each layer's decode call (:mod:`oscar_hf.core.frozen_decoding`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from oscar_hf.core.cache import OscarCache
from oscar_hf.core.model_info import ATTENTION_NAME
from oscar_hf.core.layer import OscarLayer, StepPlan, allowed_keys
from oscar_hf.core.step_guard import waiting_cache
from oscar_hf.kernels.decode_attention import decode_attention


@torch.compiler.disable  # it reads the cache's state on the host; compiled layers break around it
def oscar_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for layers of an :class:`OscarCache`; plain SDPA for everything else.

    "Everything else" is a forward without an OscarCache (``use_cache=False``, scoring), and layer
    types the cache keeps in BF16 (sliding windows), whose K/V arrive complete.
    """
    cache, layer = _waiting_layer(module, key)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    try:
        if module.layer_idx == cache.layer_ids[0] and hasattr(module, "config"):
            cache.check_model(module.config)
        output = _attend(cache, layer, module, query, key, value, attention_mask, kwargs)
    except BaseException as error:
        cache.step_failed(module.layer_idx, error)
        raise
    cache.layer_finished()
    return output, None


def _attend(
    cache: OscarCache,
    layer: OscarLayer,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
) -> torch.Tensor:
    """Attention over ``layer``'s tiers and the new chunk, which the layer then stores."""
    plain_decode = _is_plain_decode(layer, query, module, kwargs)
    if plain_decode and layer.static is None:
        cache.freeze_for_decoding(module.layer_idx, attention_mask)
    if layer.static is not None:  # a frozen cache: shape-stable, nothing read on the host
        if not plain_decode:
            raise ValueError("static decoding computes plain softmax attention of one token (no soft-capping, "
                             "learned sinks or dropout)")  # fmt: skip
        return layer.static.attend(layer, query, kwargs.get("scaling"))
    new_keys, new_values, plan = layer.begin_step(attention_mask)
    if plain_decode:
        return _decode(layer, query, new_keys, new_values, plan, attention_mask, kwargs.get("scaling"))
    new_keys, new_values = layer.rotate_chunk(new_keys, new_values)
    if layer.stored_length == 0:
        # A first chunk attends only to itself: the K/V as given yield the same attention as their
        # rotated copies, without rotating q, concatenating tiers and rotating the output back.
        output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    else:
        keys, values = layer.dense_rotated(new_keys, new_values)
        output, _ = sdpa_attention_forward(module, layer.rotate_keys(query), keys, values, attention_mask, **kwargs)
        output = layer.unrotate_values(output, heads_axis=2)  # sdpa_attention_forward returns [B, T, H, D]
        del keys, values
    layer.finish_step(new_keys, new_values, plan)
    return output


def _is_plain_decode(layer: OscarLayer, query: torch.Tensor, module: torch.nn.Module, kwargs: dict) -> bool:
    """One query token of softmax attention the decode kernel computes exactly.

    Logit soft-capping, learned sinks and dropout are not in the kernel; those go the SDPA way.
    """
    return (
        query.shape[2] == 1
        and layer.config.quantized
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and not (module.training and kwargs.get("dropout", 0.0))
    )


def _decode(
    layer: OscarLayer,
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    plan: StepPlan,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """``[B, 1, Hq, D]`` attention output of one token over all tiers of ``layer``, which then stores it.

    One launch rotates q, K and V; K and V go straight into the recent window when the plan puts
    them there, so the window already holds them when attention reads it.
    """
    query, new_keys, new_values = layer.rotate_step(query, new_keys, new_values, into_window=plan.joins_window)
    key_mask = None if attention_mask is None else allowed_keys(attention_mask)
    history_k, history_v = layer.history_keys.packed(), layer.history_values.packed()
    output = decode_attention(
        query, layer.sink_keys.view(), layer.sink_values.view(),
        history_k.codes, history_k.scale, history_k.zero, history_v.codes, history_v.scale, history_v.zero,
        layer.recent_keys.view(), layer.recent_values.view(), new_keys, new_values,
        k_bits=layer.config.key.bits, v_bits=layer.config.value.bits, sm_scale=scaling, key_mask=key_mask,
        history_settled=True,  # it last changed in an earlier finish_step; kernels since write no history
    )  # fmt: skip
    layer.finish_step(new_keys, new_values, plan)
    return layer.unrotate_output(output)


def _waiting_layer(module: torch.nn.Module, key: torch.Tensor) -> tuple[OscarCache | None, OscarLayer | None]:
    """The active cache and its layer waiting for ``key``, or Nones when no OscarLayer is."""
    layer_idx = getattr(module, "layer_idx", None)
    cache = None if layer_idx is None else waiting_cache(layer_idx)
    if cache is None or layer_idx >= len(cache.layers):
        return None, None
    layer = cache.layers[layer_idx]
    if not isinstance(layer, OscarLayer):
        return None, None
    if layer.owns(key):
        return cache, layer
    if layer.has_pending:
        raise RuntimeError(
            f"layer {layer_idx}: attention received key states that OscarCache did not return; "
            "the model changes K/V between the cache update and attention, which OscarCache does not support"
        )
    return None, None


AttentionInterface.register(ATTENTION_NAME, oscar_attention_forward)
# Without a mask function for the name, transformers silently builds no mask (no causal, no padding).
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@contextlib.contextmanager
def swapped_attention(model: PreTrainedModel, name: str, forward: Callable | None = None) -> Iterator[None]:
    """Run ``model`` with the attention implementation ``name`` inside the block.

    ``forward`` is registered under ``name`` first, with transformers' SDPA mask function (without a mask
    function for the name, transformers silently builds no mask). The implementation of the model and of
    each sub-config is restored afterwards, also on error.
    """
    if forward is not None:
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, sdpa_mask)
    previous = _attention_implementations(model)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _attention_implementations(model: PreTrainedModel) -> dict[str, str]:
    """The current implementation of the model and of each sub-config, in set_attn_implementation's dict form."""
    config = model.config
    implementations = {"": config._attn_implementation}
    for name in config.sub_configs:
        sub_config = getattr(config, name, None)
        if sub_config is not None:
            implementations[name] = sub_config._attn_implementation
    return implementations
