"""Fast decoding with fixed options: ``model.generate`` whose one-token steps replay a CUDA graph of a
:class:`~oscar_hf.core.step_replay.StaticDecoder` made for this call (capacity, compiled layers, fused
projections). Plain ``model.generate`` replays whole steps too (the cache sets up a decoder of its own
at its first one-token step); this function picks the decoder's options and undoes them afterwards.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, PreTrainedModel

from oscar_hf.core.cache import OscarCache
from oscar_hf.core.step_replay import StaticDecoder, compiles_layers, route_decode_steps
from oscar_hf.log import get_logger

logger = get_logger(__name__)


def generate(
    model: PreTrainedModel,
    inputs: torch.Tensor | None = None,
    *,
    capture: bool | None = None,
    compile: bool | str | None = None,
    fuse_projections: bool = True,
    **kwargs,
):
    """``model.generate`` with its decode steps replayed from a CUDA graph: same arguments, same outputs.

    Pass the OscarCache as in ``model.generate`` (``past_key_values=`` or, on newer transformers,
    ``cache=``). Greedy decoding gives the tokens of the eager OscarCache path; sampling, logits
    processors, stopping criteria and streamers are transformers' own.

    Args:
        model: a causal LM with ``attn_implementation="oscar"``, full attention in every layer.
        inputs, **kwargs: as ``model.generate``.
        capture: None (default) captures on CUDA and falls back to plain ``model.generate`` elsewhere
            (CPU has no CUDA graphs); False runs the static steps without a graph (for tests).
        compile: compile the decoder layers inside the captured step: True, False, or a mode of
            :data:`COMPILE_MODES` (see :class:`StaticDecoder`); None (default) as plain ``generate``
            does (:func:`~oscar_hf.core.step_replay.compiles_layers`).
        fuse_projections: stacked q/k/v and gate/up GEMMs while decoding (see :class:`StaticDecoder`).

    Beam search, assisted decoding and caches that cannot be frozen run eagerly (logged).

    Example::

        cache = OscarCache.from_zoo(model, "default", max_cache_len=4096)
        out = oscar_hf.generate(model, **inputs, past_key_values=cache, max_new_tokens=256)
    """
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(cache, OscarCache):
        raise ValueError("oscar_hf.generate needs an OscarCache, passed as past_key_values= (or cache=)")
    config = _generation_config(model, kwargs)
    eager_reason = None
    if capture is None and model.device.type != "cuda":
        eager_reason = f"no CUDA graphs on {model.device}"
    elif (config.num_beams or 1) > 1 or kwargs.get("assistant_model") is not None:
        eager_reason = "beam search and assisted decoding reorder or roll back the cache"
    if eager_reason is not None:
        logger.info("oscar_hf.generate decodes eagerly: %s", eager_reason)
        return model.generate(inputs, **kwargs)
    prompt = inputs if inputs is not None else kwargs.get("input_ids")
    capacity = cache.capacity or _capacity(prompt, config, cache)
    compile = compiles_layers(model) if compile is None else compile
    decoder = StaticDecoder(
        model, cache, capacity, capture=capture is not False, compile=compile, fuse_projections=fuse_projections
    )
    route_decode_steps(model)
    previous, cache.step_decoder = cache.step_decoder, decoder
    try:
        return model.generate(inputs, **kwargs)
    finally:
        decoder.close()  # unfuse the projections; the cache thaws
        cache.step_decoder = previous


def _generation_config(model: PreTrainedModel, kwargs: dict) -> GenerationConfig:
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
    return config


def _capacity(prompt: torch.Tensor | None, config: GenerationConfig, cache: OscarCache) -> int:
    """Tokens the cache must hold: the prompt (or what the cache has) plus every token to generate."""
    prompt_tokens = prompt.shape[-1] if prompt is not None else cache.get_seq_length()
    if config.max_new_tokens is not None:
        return prompt_tokens + config.max_new_tokens + 1
    return max(config.max_length or GenerationConfig().max_length or 20, prompt_tokens) + 1
