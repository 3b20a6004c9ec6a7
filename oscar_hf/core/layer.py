"""``OscarLayer``: one full-attention layer of an ``OscarCache`` in the rotated basis (K·R_K, V·R_V).

Token lifecycle of one layer (positions in order, as the paper's cache layout keeps them):

    [ sink: first real tokens ] [ packed history ] [ recent: last `recent`..`recent+block-1` tokens ]

A step (one ``update`` + one attention call) works in three phases so that a chunk always attends
to its own unquantized K/V, as the reference's prefill does:

1. ``begin_step``: plan where the new tokens go and demote the oldest rows of the recent window
   (quantized from their stored rotated rows) if the window would overflow (``oscar_hf.core.layer_window``);
2. rotation and attention over ``[sink | history | recent | new]`` (``oscar_hf.core.layer_attention``): a
   prefill chunk is rotated by GEMMs (``rotate_chunk``), a decode step's q, K and V by one launch
   that writes K and V straight into the recent window (``rotate_step``, ``kernels/rotate.py``);
3. ``finish_step``: store the new tokens; those that land between the sink and the recent window
   are quantized now, exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from oscar_hf.config import OscarConfig, TensorQuantConfig
from oscar_hf.core.frozen_decoding import StaticDecoding
from oscar_hf.core.layer_attention import LayerAttention
from oscar_hf.core.layer_dense import DenseView
from oscar_hf.core.layer_edits import EditedLayer
from oscar_hf.core.layer_rotation import RotatedLayer
from oscar_hf.core.layer_window import StepPlan, WindowPlanning
from oscar_hf.core.memory import LayerMemory
from oscar_hf.core.storage import PackedHistory, RowBuffer
from oscar_hf.kernels.rotate import rotate_rows


@dataclass
class PendingChunk:
    """A chunk's post-RoPE K/V as the model produced them (not rotated yet); attention receives the
    same ``keys`` object, which is how it is recognised."""

    keys: torch.Tensor
    values: torch.Tensor


class OscarLayer(LayerAttention, DenseView, EditedLayer, RotatedLayer, WindowPlanning, CacheLayerMixin):
    """One full-attention layer of an :class:`OscarCache`.

    ``key_rotation`` / ``value_rotation`` are ``[D, D]`` (shared by all heads), ``[H_kv, D, D]`` (one
    per KV head; query head ``i`` uses its KV head's ``i // g``) or None (the identity); ``key_mean``
    (``[D]`` or ``[H_kv, D]``), if given, centers every stored key and ``key_feedback`` (``[D, D]`` or
    ``[H_kv, D, D]``), if given, feeds each key's quantization errors forward (:mod:`.layer_rotation`).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        config: OscarConfig,
        key_rotation: torch.Tensor | None,
        value_rotation: torch.Tensor | None,
        max_cache_len: int | None = None,
        key_mean: torch.Tensor | None = None,
        key_feedback: torch.Tensor | None = None,
    ):
        super().__init__()
        self.config = config
        self.set_rotations(key_rotation, value_rotation, key_mean, key_feedback)
        self.capacity = max_cache_len
        self.static: StaticDecoding | None = None  # set while the cache is frozen for static decoding
        self._clear()

    # ----------------------------------------------------------------------------------- state
    def _clear(self) -> None:
        self.is_initialized = False
        self.sink_end: int | None = None  # fixed once every row has shown its first real token
        self._pending: PendingChunk | None = None
        self._demoted_ahead = 0  # rows of the coming step's demotion already taken (OscarCache._demote_all)
        self._empty_rows: torch.Tensor | None = None
        self.sink_keys = self.sink_values = self.recent_keys = self.recent_values = None
        self.history_keys = self.history_values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        self.place_rotations(key_states.device, heads)
        if self.key_mean is not None:  # made now, not first inside a captured step
            self.rotated_key_mean(key_states)
        self.dtype, self.device, self.head_dim = key_states.dtype, key_states.device, head_dim

        def window() -> RowBuffer:
            return RowBuffer(batch, heads, (head_dim,), self.dtype, self.device)

        self.sink_keys, self.sink_values, self.recent_keys, self.recent_values = window(), window(), window(), window()
        if self.config.quantized:
            self.history_keys = self._history(self.config.key, batch, heads)
            self.history_values = self._history(self.config.value, batch, heads)
        self.is_initialized = True

    def _history(self, spec: TensorQuantConfig, batch: int, heads: int) -> PackedHistory:
        group = spec.group_of(self.head_dim)
        history = PackedHistory(batch, heads, self.head_dim, spec.bits, group, self.config.metadata_dtype, self.device)
        if self.capacity is not None:  # allocated once, at the addresses static decoding will use
            history.fix_capacity(max(0, self.capacity - self.config.sink))
        return history

    def _buffers(self) -> list[RowBuffer]:
        buffers = [self.sink_keys, self.sink_values, self.recent_keys, self.recent_values]
        for history in (self.history_keys, self.history_values):
            if history is not None:
                buffers.extend(history.buffers())
        return buffers

    @property
    def history_length(self) -> int:
        return 0 if self.history_keys is None else self.history_keys.length

    @property
    def stored_length(self) -> int:
        """Rows stored in the sink, history and recent window (not the chunk waiting for attention)."""
        if self.static is not None:
            return self.static.stored_length
        return self.sink_keys.length + self.history_length + self.recent_keys.length if self.is_initialized else 0

    def get_seq_length(self) -> int:
        pending = 0 if self._pending is None else self._pending.keys.shape[2]
        return self.stored_length + pending

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # ----------------------------------------------------------------------------------- steps
    def stash(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Receive a chunk of post-RoPE K/V; it is stored when attention over it has been computed."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise RuntimeError(
                "OscarCache received new key/value states before attention used the previous ones. "
                "The model's attention must go through attn_implementation='oscar' for every layer."
            )
        if self.config.check_finite:
            check_finite_states(key_states, "key")
            check_finite_states(value_states, "value")
        self._pending = PendingChunk(key_states, value_states)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def owns(self, key_states: torch.Tensor) -> bool:
        """Whether ``key_states`` is the chunk this layer is waiting to attend over."""
        return self._pending is not None and self._pending.keys is key_states

    def drop_pending(self) -> None:
        """Forget the pending chunk of a step that was refused or failed."""
        self._pending = None

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending chunk's K and V (not rotated), which the caller now rotates and stores."""
        if self._pending is None:
            raise RuntimeError("no pending chunk: call stash() first")
        chunk, self._pending = self._pending, None
        # The rows demoted ahead belong to this step, eager or frozen (a step that freezes the cache
        # never plans eagerly): a later step must not count them as still in the window.
        self._demoted_ahead = 0
        return chunk.keys, chunk.values

    def begin_step(self, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, StepPlan]:
        """Take the pending chunk (not rotated), plan its placement and demote overflowing recent rows."""
        self._leave_static()
        ahead = self._demoted_ahead
        keys, values = self.take_pending()
        self._observe_padding(attention_mask, keys.shape[2])
        plan = self._plan(keys.shape[2], ahead)
        self._demote(plan.demote)
        return keys, values, plan

    def dense_rotated(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Transient ``[sink | dequantized history | recent | new]`` K and V in the rotated basis."""
        keys = [self.sink_keys.view()]
        values = [self.sink_values.view()]
        if self.history_length:
            keys.append(self.history_keys.dequantize(self.dtype))
            values.append(self.history_values.dequantize(self.dtype))
        keys += [self.recent_keys.view(), new_keys]
        values += [self.recent_values.view(), new_values]
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain transformers contract: store the chunk and return all K/V, dequantized and un-rotated.

        Used when the model runs another attention implementation; the chunk itself is returned
        unquantized, so prefill semantics match the ``oscar`` path (but the sink ignores padding).
        """
        self.stash(key_states, value_states)
        new_keys, new_values, plan = self.begin_step(None)
        new_keys, new_values = self.rotate_chunk(new_keys, new_values)
        keys, values = self.dense_rotated(new_keys, new_values)
        self.finish_step(new_keys, new_values, plan)
        return self.unrotate_keys(keys), self.unrotate_values(values)

    def rotate_chunk(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's stored ``(K - mu)·R_K`` and ``V·R_V`` (prefill: GEMMs)."""
        return self.store_keys(keys), self.rotate_values(values)

    def rotate_step(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, into_window: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's ``q·R_K`` ``[B, Hq, D]``, ``K·R_K`` and ``V·R_V`` in one launch (kernels/rotate.py).

        ``into_window``: K and V are written straight into the recent window's next rows, which the
        window then holds, and the new rows returned are empty (``[B, Hkv, 0, D]``).
        """
        batch, q_heads, _, head_dim = query.shape
        rotated_query = query.new_empty(batch, q_heads, head_dim)
        if into_window:
            rotated_keys, rotated_values = (
                self.recent_keys.extend(keys.shape[2]),
                self.recent_values.extend(keys.shape[2]),
            )
        else:
            rotated_keys, rotated_values = torch.empty_like(keys), torch.empty_like(values)
        # The kernel maps each row to its KV head's R itself, so per-head rotations go as [H_kv, D, D].
        key_rotation = self.rotation_for("key", query, identity=True, expand=False)
        value_rotation = self.rotation_for("value", query, identity=True, expand=False)
        # centered keys (key_mean) subtract mu R_K in the same launch
        key_job = (keys, key_rotation, rotated_keys, *self._key_center(keys))
        rotate_rows([(query, key_rotation, rotated_query), key_job, (values, value_rotation, rotated_values)])
        if into_window:
            return rotated_query, self._no_rows(keys), self._no_rows(values)
        return rotated_query, rotated_keys, rotated_values

    def _no_rows(self, like: torch.Tensor) -> torch.Tensor:
        """An empty ``[B, H, 0, D]`` tier like ``like``, kept (a slice a call costs host time)."""
        empty = self._empty_rows
        if empty is None or empty.shape[:2] != like.shape[:2] or empty.dtype != like.dtype:
            self._empty_rows = empty = like.new_empty(like.shape[0], like.shape[1], 0, like.shape[-1])
        return empty

    # ------------------------------------------------------------------------ cache contract
    def reset(self) -> None:
        self._leave_static()
        self._clear()

    def _leave_static(self, stay_eager: bool = False) -> None:
        """Eager operations need the eager layout: thaw a frozen cache first (every layer at once).

        ``stay_eager``: the operation reorders or rolls back the cache (beam search, assisted decoding
        do so every step), so plain ``generate`` should stop freezing it (:attr:`OscarCache.stays_eager`).
        """
        if self.static is not None:
            self.static.thaw(stay_eager)

    def _require_idle(self, operation: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"cannot {operation} an OscarCache layer in the middle of a forward pass")

    # ------------------------------------------------------------------------------ reporting
    def memory(self, layer_idx: int) -> LayerMemory:
        self._leave_static()
        if not self.is_initialized:
            return LayerMemory(layer_idx, "oscar", 2, 0, 0, 0, 0, 0, 0, 0, 0)
        batch, heads = self.sink_keys.data.shape[:2]
        history = self.history_length
        code_bytes = metadata_bytes = 0
        if history:
            code_bytes = self.history_keys.code_bytes() + self.history_values.code_bytes()
            metadata_bytes = self.history_keys.metadata_bytes() + self.history_values.metadata_bytes()
        return LayerMemory(
            layer=layer_idx,
            kind="oscar",
            dtype_bytes=self.sink_keys.data.element_size(),
            sink_tokens=self.sink_keys.length,
            history_tokens=history,
            recent_tokens=self.recent_keys.length,
            elements_per_token=2 * batch * heads * self.head_dim,
            code_bytes=code_bytes,
            metadata_bytes=metadata_bytes,
            sink_bytes=self.sink_keys.used_bytes() + self.sink_values.used_bytes(),
            recent_bytes=self.recent_keys.used_bytes() + self.recent_values.used_bytes(),
        )


def check_finite_states(states: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(states).all()):
        raise ValueError(f"non-finite values (NaN/Inf) in the {name} states given to OscarCache")
