"""The caches a benchmark compares, by name, and filling them with a synthetic context.

A cache name is ``dynamic`` or ``static`` (transformers' BF16 caches) or an OscarCache method
(``oscar-int2``, ``quarot-int2``...), optionally with suffixes:

* ``<method>+absorbed``: that method on the model with R_V folded into v_proj/o_proj (:func:`model_for`).
* ``<method>+mixed-widths``: the bundled ``oscar-int2`` set's per-layer widths, mapped by depth onto the
  model's layers at the method's bits (:func:`with_bundled_widths`).
* ``<method>+key-feedback``: the rotations carry key feedback factors, as the bundled sets do
  (:func:`with_key_feedback`), so that history keys are written channel by channel.
* ``<method>+eager-layout``: ``OscarCache(decode_graphs=False)``: plain generate launches every kernel
  from Python (the default, on CUDA, replays whole steps from a CUDA graph); ``<method>+frozen``:
  ``decode_graphs=True``, which freezes on CPU too (without graphs), for CPU smoke tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from oscar_hf import OscarCache, OscarLayer, RotationSet
from oscar_hf.calibration.absorption import absorb_value_rotations
from oscar_hf.core.cache import ABSORBED_ATTRIBUTE
from oscar_hf.model_info import head_dim_of, text_config_of
from oscar_hf.quant import feedback_factor
from oscar_hf.rotations.files import load_ours
from oscar_hf.rotations.resolve import DEFAULT_ROTATIONS, bundled_rotations_dir

from .models import attention_device
from .timing import tensor_bytes

BF16_CACHES = ("dynamic", "static")  # transformers' own caches; any other name is an OscarCache method
ABSORBED_SUFFIX = "+absorbed"
DECODE_GRAPHS_SUFFIXES = {"+eager-layout": False, "+frozen": True}
MIXED_WIDTHS_SUFFIX = "+mixed-widths"
KEY_FEEDBACK_SUFFIX = "+key-feedback"


def attention_for(cache_name: str) -> str:
    return "sdpa" if cache_name in BF16_CACHES else "oscar"


def make_cache(
    cache_name: str, model: PreTrainedModel, max_len: int, rotations: RotationSet | None, preallocate: bool = False
):
    """``dynamic`` / ``static`` (transformers, BF16) or an OscarCache method (``oscar-int2``, ``quarot-int2``...).

    ``preallocate``: an OscarCache allocates its history for ``max_len`` tokens at once (static decoding).
    """
    if cache_name == "dynamic":
        return DynamicCache(config=model.config)
    if cache_name == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    method, decode_graphs = cache_name, None
    for suffix, value in DECODE_GRAPHS_SUFFIXES.items():
        if method.endswith(suffix):
            method, decode_graphs = method.removesuffix(suffix), value
    if method.endswith(MIXED_WIDTHS_SUFFIX):
        method, rotations = method.removesuffix(MIXED_WIDTHS_SUFFIX), with_bundled_widths(rotations)
    if method.endswith(KEY_FEEDBACK_SUFFIX):
        method, rotations = method.removesuffix(KEY_FEEDBACK_SUFFIX), with_key_feedback(rotations)
    return OscarCache(
        model, method, rotations=rotations, max_cache_len=max_len if preallocate else None, decode_graphs=decode_graphs
    )


def with_bundled_widths(rotations: RotationSet) -> RotationSet:
    """``rotations`` with the per-layer bit widths of the bundled ``oscar-int2`` set: its layer at the same
    relative depth decides each layer's widths, and where that leaves the history more or fewer bits than
    the method's, the deepest widened keys or 1-bit values go back to the base widths until it does not
    (a benchmark's mixed-width pattern on any model)."""
    bundled = load_ours(bundled_rotations_dir(DEFAULT_ROTATIONS))
    depth, layers = len(bundled.key), sorted(rotations.key)
    source = {layer: sorted(bundled.key)[i * depth // len(layers)] for i, layer in enumerate(layers)}
    key_bits = {i: bundled.key_bits[s] for i, s in source.items() if s in bundled.key_bits}
    value_bits = {i: bundled.value_bits[s] for i, s in source.items() if s in bundled.value_bits}
    base_key, base_value = bundled.base_bits
    surplus = sum(b - base_key for b in key_bits.values()) - sum(base_value - b for b in value_bits.values())
    while surplus > 0:
        surplus -= key_bits.pop(max(key_bits)) - base_key
    while surplus < 0:
        surplus += base_value - value_bits.pop(max(value_bits))
    return dataclasses.replace(rotations, key_bits=key_bits, value_bits=value_bits)


def with_key_feedback(rotations: RotationSet, seed: int = 0) -> RotationSet:
    """``rotations`` with a key feedback factor per layer (and KV head, as R_K is), each from a random
    positive definite stand-in for the rotated query covariance: the write path's work does not depend on it."""
    generator = torch.Generator().manual_seed(seed)

    def factor(key_rotation: torch.Tensor) -> torch.Tensor:
        dim = key_rotation.shape[-1]
        gaussian = torch.randn(*key_rotation.shape[:-1], 2 * dim, generator=generator, dtype=torch.float64)
        return feedback_factor(gaussian @ gaussian.transpose(-1, -2) / (2 * dim))

    return dataclasses.replace(rotations, key_feedback={layer: factor(r) for layer, r in rotations.key.items()})


@contextlib.contextmanager
def model_for(model: PreTrainedModel, cache_name: str, rotations: RotationSet | None):
    """Yield the cache method to run; for ``<method>+absorbed`` with R_V folded into the model meanwhile.

    The folded projections are restored afterwards (from a copy of their weights, not by un-folding,
    which would round twice), so the other cases of the run see the original model.
    """
    if not cache_name.endswith(ABSORBED_SUFFIX):
        yield cache_name
        return
    names = (".v_proj.", ".o_proj.")
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if any(k in n for k in names)}
    absorb_value_rotations(model, rotations)
    try:
        yield cache_name.removesuffix(ABSORBED_SUFFIX)
    finally:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name in saved:
                    parameter.copy_(saved[name])
        delattr(text_config_of(model), ABSORBED_ATTRIBUTE)


def write_chunk(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Store post-RoPE K/V rows as a forward pass would: OscarCache through its real write path."""
    layer = cache.layers[layer_idx]
    if isinstance(layer, OscarLayer):
        # rotate, place in sink / history / recent window, quantize the history rows exactly once
        layer.stash(keys, values)
        new_keys, new_values, plan = layer.begin_step(None)
        layer.finish_step(*layer.rotate_chunk(new_keys, new_values), plan)
    else:
        # transformers 5.17's StaticLayer indexes by cache_position; newer layers count for themselves
        positions = torch.arange(start, start + keys.shape[2], device=keys.device)
        cache.update(keys, values, layer_idx, {"cache_position": positions})


def fill_cache(cache, model: PreTrainedModel, batch: int, context: int, chunk_rows: int) -> None:
    """Fill every layer with ``context`` random K/V tokens, layer by layer, in chunks of ``chunk_rows / batch``.

    Stands in for a long prefill, which would dominate a decode benchmark's wall time; the cache
    ends in the state a prefill leaves (OscarCache: sink, packed history, recent window).
    """
    text = text_config_of(model)
    chunk = max(1, chunk_rows // batch)
    for layer_idx in range(len(cache.layers)):
        device = attention_device(model, layer_idx)
        for start in range(0, context, chunk):
            shape = (batch, text.num_key_value_heads, min(chunk, context - start), head_dim_of(model))
            keys = torch.randn(shape, device=device, dtype=model.dtype)
            write_chunk(cache, layer_idx, keys, torch.randn_like(keys), start)


def synthetic_fill(model: PreTrainedModel, batch: int, context: int, chunk_rows: int) -> Callable[[Any], None]:
    return lambda cache: fill_cache(cache, model, batch, context, chunk_rows)


def kv_bytes(cache) -> int:
    """Stored K/V bytes: OscarCache's own report (codes, metadata, windows); for BF16 caches their tensors."""
    if isinstance(cache, OscarCache):
        return cache.memory_report().total_bytes
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
