"""How an :class:`~oscar_hf.core.cache.OscarCache` switches between its eager layout and the frozen one
(:mod:`oscar_hf.core.frozen_decoding`) that graph-replayed decoding needs, and when plain ``generate``
switches it.
"""

from __future__ import annotations

import torch

from oscar_hf.core.frozen_decoding import StaticDecoding, graphs_unsupported
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.layer_attention import allowed_keys
from oscar_hf.core.step_replay import StaticDecoder, compiles_layers, route_decode_steps
from oscar_hf.core.storage import MAX_SLACK_ROWS
from oscar_hf.log import get_logger
from oscar_hf.model_info import ATTENTION_NAME, tensor_parallel_rank

logger = get_logger(__name__)


class FrozenLayouts:
    """Freezing and thawing of :class:`~oscar_hf.core.cache.OscarCache` (a mixin: it reads the cache's
    ``layers``, ``static``, ``capacity``, ``decode_graphs``, ``stays_eager`` and ``step_decoder``)."""

    def start_static(
        self,
        capacity: int | None = None,
        attention_mask: torch.Tensor | None = None,
        stay_eager_if_refused: bool = False,
    ) -> bool:
        """Freeze the cache for static decoding (CUDA-graph capture); False, with the reason logged, if it
        cannot be frozen yet or at all.

        Args:
            capacity: the most tokens the cache will hold; defaults to ``max_cache_len``; with neither,
                the frozen cache grows when full (its owner freezes it again with more rows).
            attention_mask: the ``[batch, tokens]`` padding mask of the sequence so far; only the sink
                may hold pads (left padding), which is checked (one host sync).
            stay_eager_if_refused: a cache that can never be frozen (not merely not yet) sets
                ``stays_eager``, so that plain generate stops asking (a :class:`StaticDecoder` does).

        Each later one-token step then runs shape-stable on the device. Anything else (a longer chunk,
        ``crop``, reordering, a memory report) thaws the cache back to its eager layout first.
        """
        if self.static is not None and not self.static.grows:
            return True
        self.stop_static()  # frozen by plain generate: freeze again at this fixed capacity
        capacity = capacity or self.capacity
        if capacity is None:  # nothing fixes it: grow when full (StaticDecoder freezes again)
            frozen = self._freeze(self._grown_capacity(), attention_mask, grows=True)
        else:
            frozen = self._freeze(capacity, attention_mask)
        if not frozen and stay_eager_if_refused and static_not_yet(self) is None:
            self.stays_eager = True
        return frozen

    def freeze_for_decoding(self, layer_idx: int, attention_mask: torch.Tensor | None) -> None:
        """Freeze at the first layer's attention of a one-token step of plain ``generate``, where
        ``decode_graphs`` asks for it (see the constructor); the attention function calls this.

        That step's update already ran eagerly (its demotions included), so only its ring slot is
        reserved here. The frozen cache grows instead of filling up, by whole MAX_SLACK_ROWS buckets
        (:meth:`_grown_capacity`). Called when the cache cannot be frozen yet (before its
        sink is complete) it tries again next step; refused for good (padding after the sink,
        several devices...), it stays eager (the reason is logged at debug level).
        """
        if layer_idx != self._first_oscar_layer or self.stays_eager or self.decode_graphs is False:
            return
        if self.step_decoder is not None:  # it freezes the cache itself; this step it could not
            return
        device = self.layers[layer_idx].device
        if (self.decode_graphs is None and device.type != "cuda") or static_not_yet(self):
            return
        oscar_layers = [layer for layer in self.layers if isinstance(layer, OscarLayer)]
        if device.type == "cuda" and (reason := graphs_unsupported(oscar_layers, self.head_dim)) is not None:
            logger.debug("decoding eagerly: %s", reason)
            self.stays_eager = True
            return
        key_mask = None if attention_mask is None else allowed_keys(attention_mask)
        if not self._freeze(self._grown_capacity(), key_mask, replay=True, grows=True):
            self.stays_eager = True
            return
        self.static.advance()

    def _freeze(
        self, capacity: int, attention_mask: torch.Tensor | None, replay: bool = False, grows: bool = False
    ) -> bool:
        reason = static_unsupported(self)
        sink_mask = None
        if reason is None and attention_mask is not None:
            sink_rows = self.layers[0].sink_keys.length
            real = attention_mask.bool()
            if not bool(real[:, sink_rows:].all()):
                reason = "the attention mask has pads after the sink (only left padding is supported)"
            elif not bool(real[:, :sink_rows].all()):
                sink_mask = real[:, :sink_rows]
        if reason is not None:
            logger.debug("OscarCache stays eager: %s", reason)
            return False
        self.static = StaticDecoding(self, capacity, sink_mask, replay=replay, grows=grows)
        return True

    def _grown_capacity(self) -> int:
        """Tokens a growing frozen cache holds: the stored history and room for another block, rounded
        up to whole MAX_SLACK_ROWS rows. Caches of similar lengths then share shapes, and a step of shapes
        that already ran in this process is captured at once (:class:`StaticDecoder`)."""
        first = self.layers[self._first_oscar_layer]
        needed = first.history_length + first.config.block
        return first.sink_keys.length + -(-needed // MAX_SLACK_ROWS) * MAX_SLACK_ROWS

    def _grow_frozen(self) -> None:
        """A full cache frozen by plain generate: thaw, and freeze again with room for more history."""
        full = self.static
        full.thaw()
        self.static = StaticDecoding(self, self._grown_capacity(), full.sink_mask, replay=full.replay, grows=True)
        logger.debug("OscarCache grew its frozen history to %d tokens", self.static.capacity)

    def stop_static(self) -> None:
        """Thaw a frozen cache back to its eager layout (no device sync); nothing if it is not frozen."""
        if self.static is not None:
            self.static.thaw()


def step_decoder_for(model, cache: FrozenLayouts) -> StaticDecoder | None:
    """The decoder that replays ``cache``'s one-token steps on ``model`` whole, where it can: the model
    on CUDA (or ``decode_graphs="step"``: any device, without graphs off CUDA), not under tensor
    parallelism (a captured step would hold the ranks' collectives), with shapes the decode kernel
    takes. Routes the model's forwards to it. On CUDA the decoder layers are compiled inside the
    captured step (once per process and batch size) unless ``model.generation_config.disable_compile``.
    """
    cuda = model.device.type == "cuda"
    if not (cache.decode_graphs == "step" or (cache.decode_graphs is None and cuda)):
        return None
    if tensor_parallel_rank(model) is not None:
        return None
    layers = [layer for layer in cache.layers if isinstance(layer, OscarLayer)]
    if (
        cuda and (reason := graphs_unsupported(layers, cache.head_dim)) is not None
    ):  # the torch reference reads on the host
        logger.debug("decoding eagerly: %s", reason)
        return None
    route_decode_steps(model)
    # Fused projections would leave the model's weights as views after generate returns.
    return StaticDecoder(model, cache, capture=cuda, compile=compiles_layers(model), fuse_projections=False)


def static_unsupported(cache: FrozenLayouts) -> str | None:
    """Why ``cache`` cannot be frozen for static decoding now, or None when it can."""
    layers = cache.layers
    if not all(isinstance(layer, OscarLayer) for layer in layers):
        return "the model has sliding-window or other non-full-attention layers"
    if cache.text_config._attn_implementation != ATTENTION_NAME:
        return f"the model runs attn_implementation={cache.text_config._attn_implementation!r}, not 'oscar'"
    config = cache.oscar_config
    if not config.quantized:
        return f"method {config.method!r} keeps everything in BF16 (no window to demote)"
    if config.check_finite:
        return "check_finite=True reads every step's K/V on the host"
    reason = static_not_yet(cache)
    if reason is not None:
        return reason
    if len({layer.device for layer in layers}) > 1:  # one device tensor of lengths serves every layer
        return "the cache's layers live on several devices (device_map); static decoding needs one"
    lengths = {(layer.sink_keys.length, layer.history_length, layer.recent_keys.length) for layer in layers}
    if len(lengths) > 1:
        return f"layers hold different numbers of tokens {sorted(lengths)}"
    return None


def static_not_yet(cache: FrozenLayouts) -> str | None:
    """Why ``cache`` cannot be frozen yet, though it may be later (after its prefill), or None."""
    layers = [layer for layer in cache.layers if isinstance(layer, OscarLayer)]
    if not layers or not all(layer.is_initialized and layer.sink_end is not None for layer in layers):
        return "the prefill has not run yet"
    first = layers[0]
    if first.history_length == 0 and first.recent_keys.length == 0 and first.sink_keys.length < first.sink_end:
        return "the sink is not complete yet (new tokens still go to the sink)"
    return None
