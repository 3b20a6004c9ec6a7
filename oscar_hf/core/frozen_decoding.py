"""Static decoding: an :class:`~oscar_hf.core.cache.OscarCache` frozen so that a decode step can be captured
in a CUDA graph.

An eager ``OscarLayer`` keeps its lengths as Python ints and grows its buffers as tokens arrive; a
CUDA graph replays the same kernels on the same addresses with no host in the loop. Freezing a cache
(after the prefill, once the sink is complete) makes every decode step shape-stable:

* each layer's history is allocated at its final capacity, and its recent window becomes a ring of
  ``recent + block`` rows (rounded up to whole blocks); the new token goes to a slot computed on the
  device;
* the lengths all layers share (history rows, ring start, ring rows) live in one device tensor,
  which the decode-attention kernel reads and each step advances on the device;
* demoting the oldest ``block`` ring rows of every layer is one launch per format, whose rows, and
  whether it does anything, are read on the device (:class:`~oscar_hf.kernels.quantize_many.WindowQuantizer`);
* the sink's padding mask is fixed when freezing (left padding never reaches past the sink).

Each step does exactly what the eager cache does (same demotion points, same quantized rows, same
attention), so greedy outputs match it; only the order in which attention sums the recent keys differs.
A host mirror of the lengths advances with every step (a graph runner advances it per replay), so
the cache thaws back into its eager layout without a device sync.

Plain ``model.generate`` uses the same layout (:meth:`OscarCache.freeze_for_decoding`). A cache made
from the model replays whole steps (:mod:`oscar_hf.core.step_replay`); one made from a config, or
under tensor parallelism, replays each layer's attention call and the step's advance from small CUDA
graphs of their own (:class:`ReplayedCall`) instead of launching their kernels one by one from Python.
Such a cache grows: when its history is full it thaws and freezes again with ``MAX_SLACK_ROWS`` more
rows (one copy of the history and new graphs every 4,096 tokens).
"""

from __future__ import annotations

import copy
import functools
import gc
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar_hf.kernels.decode_attention import kernel_supports_decode
from oscar_hf.kernels.quantize_many import WindowQuantizer
from oscar_hf.log import get_logger

logger = get_logger(__name__)


class ReplayedCall:
    """``fn(*tensors)`` run eagerly at its first call (which compiles its kernels), captured in a CUDA graph
    at the second and replayed from then on, its inputs copied into the graph's own.

    The result is the graph's output tensor, overwritten by the next replay. ``fn`` must be shape-stable
    and read nothing on the host; calls sharing ``pool`` must replay in the order they were captured.
    """

    def __init__(self, fn: Callable[..., torch.Tensor | None], pool: tuple, stream: torch.cuda.Stream):
        self.fn, self.pool, self.stream = fn, pool, stream
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.output: torch.Tensor | None = None

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        if self.graph is None:
            if self.calls == 1:
                return self.fn(*inputs)
            self._capture(inputs)
        if inputs:  # the advance has none, and _foreach_copy_ refuses an empty list
            torch._foreach_copy_(self.inputs, inputs)  # one launch where dtypes and strides agree
        self.graph.replay()
        return self.output

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> None:
        self.inputs = tuple(torch.empty_like(tensor) for tensor in inputs)
        try:
            self.graph, self.output = captured(lambda: self.fn(*self.inputs), self.pool, self.stream)
        except RuntimeError as error:
            raise RuntimeError(
                "capturing an OscarCache decode call in a CUDA graph failed; "
                "OscarCache(..., decode_graphs=False) decodes without graphs"
            ) from error


def captured(fn: Callable[[], Any], pool: tuple | None, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn()`` captured in a CUDA graph on ``stream`` (its memory from ``pool``; None: a private one), and
    what it returned. The cycle collector is paused meanwhile: a graph it frees during a capture (a dead
    cache's, say) invalidates the capture. Unlike ``torch.cuda.graph`` it neither synchronises nor empties
    the allocator's cache, which made a capture cost hundreds of milliseconds."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="thread_local")
            try:
                output = fn()
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    current.wait_stream(stream)
    return graph, output


def graphs_unsupported(layers: Sequence[Any], dim: int) -> str | None:
    """Why the decode steps of ``layers`` (:class:`~oscar_hf.core.layer.OscarLayer`) cannot be captured in CUDA
    graphs, or None: shapes and widths the decode kernel does not take run the torch reference, which reads
    the static lengths on the host."""
    for layer in layers:
        if not layer.config.quantized:
            return "the layers keep everything in BF16"
        key, value = layer.config.key, layer.config.value
        if not kernel_supports_decode(dim, key.bits, value.bits, dim // key.group_of(dim), dim // value.group_of(dim)):
            return f"the decode kernel does not take head_dim {dim} at K{key.bits} V{value.bits}"
    return None


class StaticDecoding:
    """The frozen state of an OscarCache: device lengths, rings and the demotion launches.

    Made by :meth:`OscarCache.start_static` or :meth:`OscarCache.freeze_for_decoding`; use those.
    ``capacity`` is the most tokens the cache will hold (prompt and generated); ``sink_mask`` is
    ``[batch, sink rows]``, True for real tokens, or None. ``replay``: replay each layer's attention
    and the step's advance from CUDA graphs of their own (:class:`ReplayedCall`; CUDA only).
    ``grows``: the owner grows a full cache (:meth:`OscarCache.freeze_for_decoding`) instead of raising.
    """

    def __init__(
        self, cache: Cache, capacity: int, sink_mask: torch.Tensor | None, replay: bool = False, grows: bool = False
    ):
        self._cache = weakref.ref(cache)  # the cache holds this state; no reference cycle delays its end
        self.grows = grows
        self.layers: list[CacheLayerMixin] = list(cache.layers)
        first = self.layers[0]
        config = first.config
        self.block = config.block
        # The eager window demotes when it would reach `recent + block` rows. The ring is rounded up to
        # whole blocks, so that a demoted block (which starts block-aligned) never wraps around its end.
        self.window_limit = config.recent + config.block
        self.ring_size = -(-self.window_limit // self.block) * self.block
        self.sink_rows = first.sink_keys.length
        self.history_rows, self.ring_start, self.ring_rows = first.history_length, 0, first.recent_keys.length
        if capacity - self.sink_rows < self.history_rows:
            raise ValueError(f"a capacity of {capacity} tokens is below the {self.stored_length} already stored")
        for layer in self.layers:
            layer.make_step_rotations(layer.dtype, layer.device)  # not inside a capture
            # A history preallocated by max_cache_len stays where it is if it is large enough (a left-
            # padded sink is longer than `sink`, so it needs fewer rows than were reserved for it).
            for history in (layer.history_keys, layer.history_values):
                history.fix_capacity(capacity - self.sink_rows, at_least=layer.capacity is not None)
            for buffer in (layer.recent_keys, layer.recent_values):
                buffer.fix_capacity(self.ring_size)
        self.history_capacity = min(layer.history_keys.codes.data.shape[2] for layer in self.layers)
        device = first.device
        self.device = device
        self.lengths = torch.tensor([self.history_rows, 0, self.ring_rows], device=device)
        self.window = torch.zeros(3, dtype=torch.long, device=device)  # WindowQuantizer: active, ring row, history row
        self._shift = torch.tensor([1, 1, -1], device=device) * self.block  # a demotion moves one block
        self._new_token = torch.tensor([0, 0, 1], device=device)
        self.sink_mask = None if sink_mask is None else sink_mask.to(device=device, dtype=torch.uint8).contiguous()
        self.demoters = self._demoters()
        self.replay = replay
        self.replayed: dict[tuple, ReplayedCall] | None = None
        if replay and device.type == "cuda":
            self.replayed, self._pool, self._stream = {}, torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        for layer in self.layers:
            layer.static = self

    def _demoters(self) -> list[WindowQuantizer]:
        """One launch per quantization format over every layer's K (and V) ring."""
        jobs: dict[tuple, list] = {}
        for layer in self.layers:
            pairs = (
                (layer.config.key, layer.recent_keys, layer.history_keys, layer.feedback_for(layer.recent_keys.data)),
                (layer.config.value, layer.recent_values, layer.history_values, None),
            )
            for spec, ring, history, feedback in pairs:
                key = (spec.bits, spec.group_of(layer.head_dim), spec.symmetric, feedback is not None)
                jobs.setdefault(key, []).append((ring.data, history.whole(), spec.clip_ratio, feedback))
        metadata_dtype = self.cache.oscar_config.metadata_dtype
        return [
            WindowQuantizer(
                [j[0] for j in same],
                [j[1] for j in same],
                self.block,
                self.window,
                bits,
                group,
                symmetric=symmetric,
                clip_ratios=[j[2] for j in same],
                metadata_dtype=metadata_dtype,
                feedback=[j[3] for j in same] if feeds_back else None,
            )
            for (bits, group, symmetric, feeds_back), same in jobs.items()
        ]

    @property
    def cache(self) -> Cache | None:
        """The cache this state freezes (None once it is gone)."""
        return self._cache()

    def __deepcopy__(self, memo: dict) -> StaticDecoding:
        """A copy that freezes the cache's copy (``memo`` holds it, :meth:`OscarCache.__deepcopy__`)."""
        clone = memo[id(self)] = copy.copy(self)
        cache = self.cache
        clone.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "_cache"}, memo))
        clone._cache = weakref.ref(memo.get(id(cache), cache))
        return clone

    def signature(self) -> tuple:
        """What must agree for another frozen cache to :meth:`take_over` this state's tensors."""
        mask = None if self.sink_mask is None else tuple(self.sink_mask.shape)
        sizes = (self.block, self.ring_size, self.sink_rows, self.history_capacity)
        return sizes, self.grows, self.replay, mask, self.device

    def take_over(self, other: StaticDecoding) -> None:
        """Serve ``other``'s cache, whose layers now hold this state's frames (same :meth:`signature`), from
        this state's lengths, mask and demotion launches, with ``other``'s values copied in."""
        self._cache, self.layers = other._cache, other.layers
        self.history_rows, self.ring_start, self.ring_rows = other.history_rows, other.ring_start, other.ring_rows
        self.lengths.copy_(other.lengths)
        self.window.copy_(other.window)
        if self.sink_mask is not None:
            self.sink_mask.copy_(other.sink_mask)
        for layer in self.layers:
            layer.static = self
        self.cache.static = self

    def release(self) -> None:
        """Forget the layers of the cache this state served, which is gone; its tensors stay."""
        self.layers = []

    @property
    def stored_length(self) -> int:
        return self.sink_rows + self.history_rows + self.ring_rows

    @property
    def capacity(self) -> int:
        return self.sink_rows + self.history_capacity

    # ------------------------------------------------------------------------------------ a step
    def advance(self) -> None:
        """Begin a decode step (at the first layer): demote every ring's oldest block when the window is
        full, as the eager cache would, and reserve the new token's ring slot; all on the device."""
        if not self._capturing():
            self.advance_host()  # a replayed graph runs no Python: its runner advances the mirror instead
        (self._replayed_call(("advance",), self._advance_device) or self._advance_device)()

    def _advance_device(self) -> None:
        due = (self.lengths[2:] + 1 >= self.window_limit).long()
        self.window.copy_(torch.cat([due, self.lengths[1:2], self.lengths[:1]]))
        for demote in self.demoters:
            demote()
        self.lengths.add_(due * self._shift + self._new_token)
        self.lengths[1:2].remainder_(self.ring_size)

    def full(self) -> bool:
        """Whether the next step's demotion would overflow the history."""
        return self.ring_rows + 1 >= self.window_limit and self.history_rows + self.block > self.history_capacity

    def advance_host(self) -> None:
        """Advance the host mirror of the lengths by one step; raises before the history would overflow."""
        rows = self.ring_rows + 1
        if rows >= self.window_limit:
            if self.full():
                raise RuntimeError(
                    f"the static OscarCache is full: it was frozen for {self.capacity} tokens "
                    "(pass a larger max_cache_len)"
                )
            self.history_rows += self.block
            self.ring_start = (self.ring_start + self.block) % self.ring_size
            rows -= self.block
        self.ring_rows = rows

    def attend(self, layer: CacheLayerMixin, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attend over all the layer's tiers and its new token, which the same launch stores in the ring's
        newest slot (reserved by :meth:`advance`): ``[B, 1, Hq, D]``."""
        keys, values = layer.take_pending()
        call = self._replayed_call(("attend", id(layer), scaling), self._attend, layer, scaling)
        if call is None:
            return self._attend(layer, scaling, query, keys, values)
        return call(query, keys, values)

    def _attend(
        self,
        layer: CacheLayerMixin,
        scaling: float | None,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        query, keys, values = layer.rotate_step(query, keys, values, into_window=False)
        # the step's advance wrote history and lengths; rotate_step ran since, so they are settled
        return layer.decode_over(query, layer.decode_tiers(keys, values, self.sink_mask, self.lengths), scaling)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _replayed_call(self, key: tuple, fn: Callable, *bound) -> ReplayedCall | None:
        """The :class:`ReplayedCall` of ``fn`` with its first arguments ``bound`` (made at the first ask),
        or None where calls run directly: without replay, or inside an outer graph's capture."""
        if self.replayed is None or self._capturing():
            return None
        call = self.replayed.get(key)
        if call is None:  # the partial is built once, not on every step
            call = self.replayed[key] = ReplayedCall(functools.partial(fn, *bound), self._pool, self._stream)
        return call

    # ------------------------------------------------------------------------------------- thaw
    def thaw(self, stay_eager: bool = False) -> None:
        """Return every layer to the eager layout (from the host mirror: no device sync); ``stay_eager``:
        plain generate stops freezing the cache (:attr:`OscarCache.stays_eager`)."""
        self.cache.stays_eager |= stay_eager
        self.replayed = None  # free the graphs now, never during a later capture
        for layer in self.layers:
            for buffer in (*layer.history_keys.buffers(), *layer.history_values.buffers()):
                buffer.unroll(0, self.history_rows)
            for buffer in (layer.recent_keys, layer.recent_values):
                buffer.unroll(self.ring_start, self.ring_rows)
            layer.static = None
        self.cache.static = None
        logger.debug("OscarCache left static decoding at %d tokens", self.stored_length)
