"""The ``"oscar"`` attention implementation: a thin adapter from transformers' attention interface to
the OscarCache layer whose update came just before (:meth:`OscarLayer.attend
<oscar_hf.core.layer_attention.LayerAttention.attend>` runs the step).

transformers hands an attention function the new K/V that ``Cache.update`` returned, never the
cache. ``OscarCache.update`` registers the step (:func:`oscar_hf.core.step_guard.waiting_cache`), and
this function finds the layer through it and ``module.layer_idx``, guards the layer's part of the step
and, at a plain decode step, lets the cache switch every layer's layout first (on CUDA, plain
``generate`` replays decode steps from CUDA graphs: :meth:`OscarCache.freeze_for_decoding`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from oscar_hf.core.cache import OscarCache
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.step_guard import waiting_cache
from oscar_hf.model_info import ATTENTION_NAME


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
    with cache.layer_step(module.layer_idx):
        if module.layer_idx == cache.layer_ids[0] and hasattr(module, "config"):
            cache.check_model(module.config)
        plain_decode = layer.is_plain_decode(query, module, kwargs)
        if plain_decode and layer.static is None:
            cache.freeze_for_decoding(module.layer_idx, attention_mask)  # every layer's layout at once
        output = layer.attend(module, query, key, value, attention_mask, plain_decode, kwargs)
    return output, None


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


def oscar_mask(**kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask, but none for one causal query token without padding, which may attend
    to every key: a mask tensor would grow by a key every step, and compiled layers that take it would
    recompile for each new length."""
    positions = kwargs.get("cache_position")  # transformers before 5.24 pass these, later ones q_length
    query_tokens = kwargs.get("q_length", None if positions is None else positions.shape[0])
    if (
        query_tokens == 1
        and kwargs.get("attention_mask") is None
        and kwargs.get("local_size") is None
        and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
    ):
        return None
    return sdpa_mask(**kwargs)


AttentionInterface.register(ATTENTION_NAME, oscar_attention_forward)
# Without a mask function for the name, transformers silently builds no mask (no causal, no padding).
AttentionMaskInterface.register(ATTENTION_NAME, oscar_mask)


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
