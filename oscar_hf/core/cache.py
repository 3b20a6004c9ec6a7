"""``OscarCache``: a transformers ``Cache`` whose full-attention layers are :class:`~oscar_hf.core.layer.OscarLayer`
(a BF16 sink, an INT2 history and a BF16 recent window in the rotated basis); other layers keep
transformers' own. The container resolves the method and rotations, dispatches ``update`` to its
layers, and switches them into the frozen layout for graph-replayed decoding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar_hf.config import OscarConfig, check_bit_budget, resolve_method
from oscar_hf.core.freezing import FrozenLayouts, step_decoder_for
from oscar_hf.core.frozen_decoding import StaticDecoding
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.memory import LayerMemory, MemoryReport
from oscar_hf.core.models import load_config
from oscar_hf.core.quantize_jobs import quantize_jobs
from oscar_hf.core.step_guard import StepGuard
from oscar_hf.core.step_replay import StaticDecoder
from oscar_hf.log import get_logger, warning_once
from oscar_hf.model_info import ATTENTION_NAME, full_attention_layer_ids, head_dim_of, kv_heads_of
from oscar_hf.rotations.resolve import ZOO_OPTIONS, resolve_rotations
from oscar_hf.rotations.rotation_set import RotationSet, own_kv_heads, require_power_of_two

logger = get_logger(__name__)

# Set on a model config by oscar_hf.calibration.absorption: the fingerprint of the R_V folded into its weights.
ABSORBED_ATTRIBUTE = "oscar_absorbed_value_rotation"


class OscarCache(StepGuard, FrozenLayouts, Cache):
    """A transformers ``Cache`` that stores the KV cache at ~2 bits per element with OSCAR rotations.

    Args:
        config: the model (or its config) this cache serves.
        method: a name from :data:`oscar_hf.config.METHODS` (``none``, ``naive-int2``, ``quarot-int2``,
            ``oscar-int2``, ``int4``, ``oscar-k4v2``, ``oscar-k3v2``) or an :class:`OscarConfig`.
        rotations: per-layer R_K/R_V, required by calibrated methods (``oscar-*``).
        max_cache_len: optional most tokens (prompt and generated) the cache will hold; the history is
            then allocated once at that size, as static decoding (:func:`oscar_hf.generate`) wants.
        decode_graphs: how one-token steps of plain ``model.generate`` run. None (default): a cache
            made from a model on CUDA gets a :class:`~oscar_hf.core.step_replay.StaticDecoder`, which
            freezes it into the static layout (:mod:`oscar_hf.core.frozen_decoding`) at its first
            one-token step and replays whole steps from one CUDA graph; a cache made from a config (or
            under tensor parallelism) freezes and replays each layer's attention from a graph of its
            own; elsewhere it stays eager. ``"step"``: whole steps on any device (without graphs off CUDA),
            True: per-layer freezing on any device (what the CPU tests compare). False: always the
            eager layout. Greedy tokens are the eager cache's either way (:func:`freeze_for_decoding`).
        **overrides: fields of :class:`OscarConfig` to change, e.g. ``sink=64, recent=256, block=8``.

    Full-attention layers become :class:`OscarLayer`; other layer types (sliding windows, linear
    attention) keep transformers' own layers in the model dtype. Memory and speed benefits need
    ``model.set_attn_implementation("oscar")``; with any other implementation the cache still works
    but hands dequantized K/V to that attention.

    Example::

        cache = OscarCache(model, "oscar-int2", rotations=load_rotations(path))
        model.generate(**inputs, past_key_values=cache)
    """

    def __init__(
        self,
        config: PretrainedConfig | PreTrainedModel,
        method: str | OscarConfig = "oscar-int2",
        rotations: RotationSet | None = None,
        max_cache_len: int | None = None,
        decode_graphs: bool | str | None = None,
        **overrides,
    ):
        if decode_graphs not in (None, True, False, "step"):
            raise ValueError(f"decode_graphs must be None, True, False or 'step', not {decode_graphs!r}")
        model_config = config.config if isinstance(config, PreTrainedModel) else config
        self.step_decoder: StaticDecoder | None = None
        self.text_config = model_config.get_text_config(decoder=True)
        self.oscar_config = resolve_method(method, **overrides)
        head_dim = head_dim_of(self.text_config)
        self.oscar_config.validate(head_dim)
        stock_layers = DynamicCache(config=model_config).layers
        quantized_ids = full_attention_layer_ids(model_config)
        if not quantized_ids:
            raise ValueError("this model has no full-attention layers for OscarCache to quantize")
        rotations = self._resolve_rotations(rotations, head_dim, quantized_ids, kv_heads_of(self.text_config))
        self.rotations = rotations = own_kv_heads(rotations, config, kv_heads_of(self.text_config))
        self.windows = self._take_windows(method, rotations, overrides)
        self.capacity = max_cache_len  # (transformers 5.17 has a read-only Cache.max_cache_len)
        self.static: StaticDecoding | None = None
        self.decode_graphs = decode_graphs
        # Set when an operation that reorders or rolls back the cache thaws it, or when freezing is
        # refused for good: plain generate stops freezing the cache until reset().
        self.stays_eager = False
        layers = [
            self._layer(i, rotations, head_dim) if i in quantized_ids else layer for i, layer in enumerate(stock_layers)
        ]
        check_bit_budget(self.oscar_config, [layers[i].config for i in quantized_ids])
        self._first_oscar_layer = quantized_ids[0]
        self.head_dim, self.layer_ids = head_dim, quantized_ids
        self._init_steps()
        super().__init__(layers=layers)
        if isinstance(config, PreTrainedModel):
            self.step_decoder = step_decoder_for(config, self)

    def _take_windows(self, method: str | OscarConfig, rotations: RotationSet, overrides: dict) -> str:
        """Take the sink and recent windows the rotation set was calibrated for, where the caller passed
        neither a window nor a whole OscarConfig; returns the windows used and where they came from, in words."""
        config = self.oscar_config
        taken = {}
        if config.rotation == "calibrated" and rotations.windows is not None and isinstance(method, str):
            taken = {k: v for k, v in zip(("sink", "recent"), rotations.windows) if k not in overrides}
        if taken:
            self.oscar_config = config = config.with_overrides(**taken)
            logger.info("windows from the rotation set: %s", taken)
        sources = {name: "the rotation set's" if name in taken else "" for name in ("sink", "recent")}
        return ", ".join(f"{sources[name]} {name} {getattr(config, name)}".strip() for name in ("sink", "recent"))

    def _layer(self, layer_id: int, rotations: RotationSet, head_dim: int) -> OscarLayer:
        config = self.oscar_config.for_layer(
            rotations.key_clip.get(layer_id),
            rotations.value_clip.get(layer_id),
            rotations.key_bits.get(layer_id),
            rotations.value_bits.get(layer_id),
            rotations.base_bits,
        )
        config.validate(head_dim)
        key_rotation, value_rotation = rotations.for_layer(layer_id)
        if self.values_prerotated:
            value_rotation = None  # v_proj already emits v @ R_V and o_proj expects rotated outputs
        key_mean = rotations.key_mean.get(layer_id) if config.quantized else None
        feeds_back = config.quantized and config.key_feedback and config.key.bits > 1
        key_feedback = rotations.key_feedback.get(layer_id) if feeds_back else None
        return OscarLayer(config, key_rotation, value_rotation, self.capacity, key_mean, key_feedback)

    @classmethod
    def from_zoo(
        cls,
        model: PreTrainedModel | PretrainedConfig | str,
        rotations: str | Path = "default",
        method: str | OscarConfig = "oscar-int2",
        **kwargs,
    ) -> "OscarCache":
        """An OscarCache with published or bundled rotations; see :func:`oscar_hf.rotations.resolve.resolve_rotations`.

        ``model`` is the model (best: the cache then follows its attention setting), its config, or a
        model id (``"default"`` for the default model), whose config is loaded; a cache made from an id
        assumes the model runs ``attn_implementation="oscar"`` and raises a clear error otherwise.
        ``rotations`` is ``"default"`` (bundled for the model), a local directory (ours or the
        official RotationZoo layout), or a hub repo id; hub options (``revision``, ``subfolder``,
        ``calibration``, ...) go through ``kwargs``, cache options (``sink``, ``recent``, ...) too; a set
        that records the windows it was calibrated for gives them to the cache unless these are passed.
        A method with ``shared_rotations`` (``oscar-int2-paper``) takes a folder's shared rotations and
        the bundled set made without the clip search.
        """
        if isinstance(model, str):
            model = load_config(model)
            model._attn_implementation = ATTENTION_NAME
        zoo_options = {key: kwargs.pop(key) for key in list(kwargs) if key in ZOO_OPTIONS}
        resolved = resolve_rotations(model, rotations, method=method, **zoo_options)
        return cls(model, method, rotations=resolved, **kwargs)

    @property
    def values_prerotated(self) -> bool:
        """Whether the model's weights already apply R_V (``oscar_hf.calibration.absorption``)."""
        return getattr(self.text_config, ABSORBED_ATTRIBUTE, None) is not None

    def _resolve_rotations(
        self, rotations: RotationSet | None, head_dim: int, layer_ids: list[int], kv_heads: int
    ) -> RotationSet:
        config = self.oscar_config
        if rotations is not None and not isinstance(rotations, RotationSet):
            raise TypeError(
                f"rotations must be a RotationSet, got {type(rotations).__name__}: load one with "
                "oscar_hf.load_rotations(path_or_hub_id), or build the cache with OscarCache.from_zoo(model, path)"
            )
        if rotations is not None and config.rotation != "calibrated":
            logger.warning(
                "method %r does not use calibrated rotations; the rotations passed are ignored", config.method
            )
        absorbed = getattr(self.text_config, ABSORBED_ATTRIBUTE, None)
        if absorbed is not None and (
            config.rotation != "calibrated" or rotations is None or rotations.value_fingerprint() != absorbed
        ):
            raise ValueError(
                "this model has R_V folded into its v_proj/o_proj weights; only a calibrated method with the "
                "same rotations it was folded with can use it (or reload the model without absorption)"
            )
        if config.rotation == "identity":
            return RotationSet.identity(head_dim)
        if config.rotation == "hadamard":
            require_power_of_two(head_dim, f"method {config.method!r}")
            return RotationSet.hadamard(head_dim, layer_ids)
        if rotations is None:
            raise ValueError(
                f"method {config.method!r} uses calibrated rotations: pass rotations= "
                "(OscarCache.from_zoo(...), oscar_hf.rotations.hub.load_rotations(...) or oscar_hf.calibrate(...).rotations)"
            )
        if config.shared_rotations and rotations.per_head:
            raise ValueError(
                f"method {config.method!r} uses one rotation per layer, but these rotations are per KV head; "
                "load the shared ones (per_head=False, or --shared-rotations) or use 'oscar-int2'"
            )
        rotations.check_model(head_dim, layer_ids, kv_heads)
        widths = rotations.key_bits or rotations.value_bits
        if widths and config.layer_bits and not config.takes_widths_for(rotations.base_bits):
            # The bundled sets carry an allocation for oscar-int2: other methods use them at their own widths.
            logger.info(
                "the rotations' per-layer bit widths were allocated for K%d V%d; method %r (K%d V%d) keeps "
                "its own widths",
                *rotations.base_bits,
                config.method,
                config.key.bits,
                config.value.bits,
            )
        return rotations

    # The cache's bookkeeping (Python ints, a context variable, host-side plans) runs eagerly under
    # torch.compile: a compiled model breaks its graph here and compiles the layers around it.
    @torch.compiler.disable
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            self._fail_step(f"the model has a layer {layer_idx}, but this cache was made for {len(self.layers)} layers")
        layer = self.layers[layer_idx]
        if not isinstance(layer, OscarLayer):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._register_update(layer_idx)
        implementation = self.text_config._attn_implementation  # a config attribute read costs ~10 us
        static_step = key_states.shape[2] == 1 and implementation == ATTENTION_NAME
        if layer_idx == self._first_oscar_layer:
            self._open_step(key_states, value_states)
        if self.static is not None and not static_step:
            self.static.thaw()
        if layer_idx == self._first_oscar_layer:
            if self.static is not None:
                if self.static.grows and self.static.full():
                    self._grow_frozen()
                self.static.advance()
            else:
                self._demote_all(key_states.shape[2])
        if implementation == ATTENTION_NAME:
            with self.layer_step(layer_idx, stores=False):  # its attention stores the chunk
                layer.stash(key_states, value_states)
            return key_states, value_states
        warning_once(
            logger,
            f"OscarCache is used with attn_implementation={implementation!r}: it works, but "
            "attention then reads a dequantized BF16 copy of the history and left padding may fill the sink. "
            "Call model.set_attn_implementation('oscar') for the memory and speed benefits.",
        )
        with self.layer_step(layer_idx):
            keys, values = layer.update(key_states, value_states)
        return keys, values

    def _demote_all(self, new_tokens: int) -> None:
        """Demote every layer's overflowing recent rows before the step: all layers' K and V in one launch.

        Layers advance together, so when the first is reached the rows every layer will demote
        this step are known; each layer's own plan then finds nothing left to demote.
        """
        jobs, metadata_dtype = [], self.oscar_config.metadata_dtype
        for layer in self.layers:
            if isinstance(layer, OscarLayer) and layer.is_initialized and layer.config.quantized:
                jobs += layer.demotion_jobs_ahead(new_tokens)
        quantize_jobs(jobs, metadata_dtype)

    def reset(self) -> None:
        """Empty every layer; also makes a cache usable again after a failed step."""
        self.stays_eager = False
        self._step_open, self.broken = False, None
        super().reset()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self.require_intact()
        return super().get_seq_length(layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self.require_intact()
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.require_intact()
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.require_intact()
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.require_intact()
        super().batch_repeat_interleave(repeats)

    def memory_report(self) -> MemoryReport:
        """Bytes of packed codes, metadata, sink and recent window per layer, with BPE and the BF16 baseline."""
        self.require_intact()
        entries = []
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, OscarLayer):
                entries.append(layer.memory(idx))
            elif isinstance(layer, CacheLayerMixin):
                entries.append(LayerMemory.dense(idx, layer.keys, layer.values))
        return MemoryReport(self.oscar_config.method, entries, self.windows)

    def __deepcopy__(self, memo: dict) -> "OscarCache":
        # The model config is shared, not copied: the copy must follow the model's attention setting.
        memo[id(self.text_config)] = self.text_config
        memo[id(self.step_decoder)] = None  # it holds the model; a copy sets up a decoder of its own
        clone = memo[id(self)] = copy.copy(self)  # a frozen state's weak reference finds the clone here
        clone.__dict__ = copy.deepcopy(self.__dict__, memo)
        if self.step_decoder is not None:
            clone.step_decoder = step_decoder_for(self.step_decoder.model, clone)
        return clone
