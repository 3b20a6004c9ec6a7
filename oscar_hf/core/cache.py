"""``OscarCache``: a transformers ``Cache`` whose full-attention layers keep a BF16 sink, an INT2 history
and a BF16 recent window, all in the rotated basis (K·R_K, V·R_V).

Token lifecycle of one layer (positions in order, oscar-reference.md section 4):

    [ sink: first real tokens ] [ packed history ] [ recent: last `recent`..`recent+block-1` tokens ]

A step (one ``update`` + one attention call) works in three phases so that a chunk always attends
to its own unquantized K/V, as the reference's prefill does:

1. ``begin_step``: plan where the new tokens go and demote the oldest rows of the recent window
   (quantized from their stored rotated rows) if the window would overflow;
2. rotation and attention over ``[sink | history | recent | new]`` (``oscar_hf.core.attention``): a
   prefill chunk is rotated by GEMMs (``rotate_chunk``), a decode step's q, K and V by one launch
   that writes K and V straight into the recent window (``rotate_step``, ``kernels/rotate.py``);
3. ``finish_step``: store the new tokens; those that land between the sink and the recent window
   are quantized now, exactly once.
"""

from __future__ import annotations

import copy
from pathlib import Path
import weakref
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from oscar_hf.core.config import OscarConfig, TensorQuantConfig, check_bit_budget, resolve_method
from oscar_hf.log import get_logger, warning_once
from oscar_hf.core.memory import LayerMemory, MemoryReport
from oscar_hf.kernels.quantize import quantize_pack, quantize_pack_into
from oscar_hf.kernels.rotate import rotate_rows
from oscar_hf.quant import QuantizedRows, dequantize
from oscar_hf.core.rotation_set import RotationSet, per_query_head, require_power_of_two
from oscar_hf.core.frozen_decoding import StaticDecoding, static_not_yet, static_unsupported
from oscar_hf.core.storage import MAX_SLACK_ROWS, PackedHistory, RowBuffer

logger = get_logger(__name__)

ATTENTION_NAME = "oscar"
# Set on a model config by oscar_hf.rotations.absorption: the fingerprint of the R_V folded into its weights.
ABSORBED_ATTRIBUTE = "oscar_absorbed_value_rotation"

# The cache that received the latest ``update`` in this context; the attention function, which never
# sees the cache, finds its layer through it. A weak reference, so a finished cache can be freed.
_active_cache: ContextVar[weakref.ReferenceType | None] = ContextVar("oscar_active_cache", default=None)


def active_cache() -> "OscarCache | None":
    ref = _active_cache.get()
    return None if ref is None else ref()


@dataclass
class StepPlan:
    """Where the ``new`` tokens of one step go."""

    to_sink: int
    demote: int  # oldest recent-window rows quantized before attention
    quantize_new: int  # new rows quantized after attention; the rest join the recent window

    @property
    def joins_window(self) -> bool:
        """Whether every new row goes to the recent window."""
        return self.to_sink == 0 and self.quantize_new == 0


@dataclass
class PendingChunk:
    """A chunk's post-RoPE K/V as the model produced them (not rotated yet); attention receives the
    same ``keys`` object, which is how it is recognised."""

    keys: torch.Tensor
    values: torch.Tensor


def _rotate(states: torch.Tensor, rotation: torch.Tensor | None, heads_axis: int = 1) -> torch.Tensor:
    """``states @ rotation``, one GEMM in the states' dtype (``rotation`` is stored in it).

    A per-head rotation ``[H, D, D]`` (one R per head of ``states``, whose heads sit on ``heads_axis``)
    is one batched GEMM. For 16-bit models R is rounded to 16 bits, as the reference does:
    orthogonal to ~1e-3, far below the INT2 error, while a float32 product would cost two extra
    casts and a slow SIMT GEMM per call (measured: a third of the cache's per-step launches at batch 1).
    """
    if rotation is None:
        return states
    if rotation.ndim == 2 or heads_axis == 1:
        return states @ rotation
    return (states.transpose(1, heads_axis) @ rotation).transpose(1, heads_axis)


class OscarLayer(CacheLayerMixin):
    """One full-attention layer of an :class:`OscarCache`.

    ``key_rotation`` / ``value_rotation`` are ``[D, D]`` (shared by all heads), ``[H_kv, D, D]`` (one
    per KV head; query head ``i`` uses its KV head's ``i // g``) or None (the identity).
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
    ):
        super().__init__()
        self.config = config
        self.key_rotation, self.value_rotation = key_rotation, value_rotation
        self.capacity = max_cache_len
        self._rotation_copies: dict[tuple, torch.Tensor] = {}  # (which, dtype, device) -> R cast once
        self.static: StaticDecoding | None = None  # set while the cache is frozen for static decoding
        self._clear()

    # ----------------------------------------------------------------------------------- state
    def _clear(self) -> None:
        self.is_initialized = False
        self.sink_end: int | None = None  # fixed once every row has shown its first real token
        self._pending: PendingChunk | None = None
        self._empty_rows: torch.Tensor | None = None
        self.sink_keys = self.sink_values = self.recent_keys = self.recent_values = None
        self.history_keys = self.history_values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        for rotation in (self.key_rotation, self.value_rotation):
            if rotation is not None and rotation.ndim == 3 and rotation.shape[0] != heads:
                raise ValueError(
                    f"the per-head rotations hold {rotation.shape[0]} KV heads but this layer receives {heads}; "
                    "under tensor parallelism build the cache from the sharded model (OscarCache(model, ...)) so "
                    "each rank takes its own heads, or pass rotations.select_kv_heads(start, stop)"
                )
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
            _check_finite(key_states, "key")
            _check_finite(value_states, "value")
        self._pending = PendingChunk(key_states, value_states)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def owns(self, key_states: torch.Tensor) -> bool:
        """Whether ``key_states`` is the chunk this layer is waiting to attend over."""
        return self._pending is not None and self._pending.keys is key_states

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending chunk's K and V (not rotated), which the caller now rotates and stores."""
        if self._pending is None:
            raise RuntimeError("no pending chunk: call stash() first")
        chunk, self._pending = self._pending, None
        return chunk.keys, chunk.values

    def begin_step(self, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, StepPlan]:
        """Take the pending chunk (not rotated), plan its placement and demote overflowing recent rows."""
        self._leave_static()
        keys, values = self.take_pending()
        self._observe_padding(attention_mask, keys.shape[2])
        plan = self._plan(keys.shape[2])
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

    def finish_step(self, new_keys: torch.Tensor, new_values: torch.Tensor, plan: StepPlan) -> None:
        """Store the chunk: sink part, quantized middle part, recent part. Only the parts that exist are
        sliced: a decode step's one row goes to the recent window as it is (slicing costs host time)."""
        sink_end, middle_end = plan.to_sink, plan.to_sink + plan.quantize_new
        if sink_end:
            self.sink_keys.append(new_keys[:, :, :sink_end])
            self.sink_values.append(new_values[:, :, :sink_end])
        if plan.quantize_new:
            self._append_history(new_keys[:, :, sink_end:middle_end], new_values[:, :, sink_end:middle_end])
        if middle_end:
            new_keys, new_values = new_keys[:, :, middle_end:], new_values[:, :, middle_end:]
        self.recent_keys.append(new_keys)
        self.recent_values.append(new_values)

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
        """A chunk's ``K·R_K`` and ``V·R_V`` (prefill: GEMMs)."""
        return self.rotate_keys(keys), self.rotate_values(values)

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
            rotated_keys, rotated_values = self.recent_keys.extend(keys.shape[2]), self.recent_values.extend(keys.shape[2])
        else:
            rotated_keys, rotated_values = torch.empty_like(keys), torch.empty_like(values)
        # The kernel maps each row to its KV head's R itself, so per-head rotations go as [H_kv, D, D].
        key_rotation = self._rotation("key", query, identity=True, expand=False)
        value_rotation = self._rotation("value", query, identity=True, expand=False)
        rotate_rows([(query, key_rotation, rotated_query), (keys, key_rotation, rotated_keys),
                     (values, value_rotation, rotated_values)])  # fmt: skip
        if into_window:
            return rotated_query, self._no_rows(keys), self._no_rows(values)
        return rotated_query, rotated_keys, rotated_values

    def unrotate_output(self, output: torch.Tensor) -> torch.Tensor:
        """A decode step's attention output ``[B, Hq, D]`` mapped back (``o·R_V^T``), as ``[B, 1, Hq, D]``."""
        rotation = self._rotation("value", output, expand=False)
        if rotation is None:
            return output.unsqueeze(1)
        unrotated = torch.empty_like(output)
        rotate_rows([(output, rotation.mT, unrotated)])
        return unrotated.unsqueeze(1)

    def _no_rows(self, like: torch.Tensor) -> torch.Tensor:
        """An empty ``[B, H, 0, D]`` tier like ``like``, kept (a slice a call costs host time)."""
        empty = self._empty_rows
        if empty is None or empty.shape[:2] != like.shape[:2] or empty.dtype != like.dtype:
            self._empty_rows = empty = like.new_empty(like.shape[0], like.shape[1], 0, like.shape[-1])
        return empty

    def rotate_keys(self, states: torch.Tensor) -> torch.Tensor:
        """``x @ R_K`` of ``[B, H, T, D]`` states; queries are rotated like keys (each by its KV head's
        R_K) so that scores are unchanged."""
        return _rotate(states, self._rotation("key", states))

    def rotate_values(self, states: torch.Tensor) -> torch.Tensor:
        return _rotate(states, self._rotation("value", states))

    def unrotate_keys(self, keys: torch.Tensor) -> torch.Tensor:
        rotation = self._rotation("key", keys)
        return keys if rotation is None else _rotate(keys, rotation.mT)

    def unrotate_values(self, values: torch.Tensor, heads_axis: int = 1) -> torch.Tensor:
        """``x @ R_V^T``; also maps attention outputs back, ``o = o_rot @ R_V^T`` (``heads_axis=2`` for
        ``[B, T, H, D]`` outputs)."""
        rotation = self._rotation("value", values, heads_axis=heads_axis)
        return values if rotation is None else _rotate(values, rotation.mT, heads_axis)

    def _rotation(
        self, which: str, like: torch.Tensor, identity: bool = False, expand: bool = True, heads_axis: int = 1
    ) -> torch.Tensor | None:
        """R_K or R_V (kept in float32) on ``like``'s device and in its dtype, cast once; without one,
        None or (``identity``) the identity matrix. A per-head R is repeated over the GQA groups of
        ``like``'s heads (on ``heads_axis``) when ``expand``, else kept as ``[H_kv, D, D]``."""
        master = self.key_rotation if which == "key" else self.value_rotation
        if master is None and not identity:
            return None
        heads = like.shape[heads_axis] if expand and master is not None and master.ndim == 3 else None
        key = (which if master is not None else "identity", heads, like.dtype, like.device)
        if key not in self._rotation_copies:
            master = torch.eye(like.shape[-1]) if master is None else master
            if heads is not None:
                master = per_query_head(master, heads)
            self._rotation_copies[key] = master.to(device=like.device, dtype=like.dtype)
        return self._rotation_copies[key]

    def _observe_padding(self, attention_mask: torch.Tensor | None, new_tokens: int) -> None:
        """Fix ``sink_end`` so that the sink holds each row's first ``sink`` real tokens.

        With left padding rows start at different positions; the sink spans up to the latest first
        real token plus ``sink``, so shorter rows keep a few more BF16 tokens instead of losing
        their attention sinks to pads. One host sync per layer, only until every row has started.
        """
        if self.sink_end is not None:
            return
        if attention_mask is None:
            self.sink_end = self.config.sink
            return
        allowed = allowed_keys(attention_mask)  # the newest token's row shows every real key
        started = allowed.any(dim=-1)
        if bool(started.all()):
            self.sink_end = int(allowed.int().argmax(dim=-1).max()) + self.config.sink

    def planned_demotion(self, new_tokens: int) -> int:
        """Recent rows the next step of ``new_tokens`` will demote (its plan, computed ahead)."""
        return self._plan(new_tokens).demote

    def _plan(self, new_tokens: int) -> StepPlan:
        length = self.get_seq_length()
        # Until every row has started, everything seen so far may precede a row's first real token.
        sink_end = self.sink_end if self.sink_end is not None else length + new_tokens + self.config.sink
        to_sink = 0
        if self.history_length == 0 and self.recent_keys.length == 0:
            to_sink = max(0, min(new_tokens, sink_end - self.sink_keys.length))
        overflow = 0
        if self.config.quantized:
            window = self.recent_keys.length + new_tokens - to_sink
            if window >= self.config.recent + self.config.block:
                overflow = window - self.config.recent
        demote = min(overflow, self.recent_keys.length)
        return StepPlan(to_sink, demote, overflow - demote)

    def _demote(self, count: int) -> None:
        if count:
            quantize_jobs(self.demotion_jobs(count), self.config.metadata_dtype)

    def demotion_jobs(self, count: int) -> list[QuantizeJob]:
        """Drop the ``count`` oldest recent rows and reserve their history slots: K and V jobs to run."""
        return self._history_jobs(self.recent_keys.drop_front(count), self.recent_values.drop_front(count))

    def _append_history(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        quantize_jobs(self._history_jobs(keys, values), self.config.metadata_dtype)

    def _history_jobs(self, keys: torch.Tensor, values: torch.Tensor) -> list[QuantizeJob]:
        count = keys.shape[2]
        return [
            QuantizeJob(self.config.key, keys, self.history_keys.extend(count)),
            QuantizeJob(self.config.value, values, self.history_values.extend(count)),
        ]

    def history_roundtrip(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What rotated ``keys``/``values`` rows become once stored in this layer's history."""
        return (
            roundtrip_rows(keys, self.config.key, self.config.metadata_dtype),
            roundtrip_rows(values, self.config.value, self.config.metadata_dtype),
        )

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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._require_idle("reorder")
        self._leave_static(stay_eager=True)
        if self.is_initialized:
            for buffer in self._buffers():
                buffer.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._require_idle("repeat")
        self._leave_static(stay_eager=True)
        if self.is_initialized:
            for buffer in self._buffers():
                buffer.repeat_batch(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the end; only BF16 tokens can go (quantized history cannot be un-quantized).

        A negative value removes that many tokens; a positive one is the length to keep (the
        transformers 5.17 legacy meaning).
        """
        self._require_idle("crop")
        self._leave_static(stay_eager=True)
        length = self.get_seq_length()
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, length - tokens_to_remove)
        if remove == 0:
            return
        if remove > self.recent_keys.length and self.history_length:
            raise ValueError(
                f"cannot crop {remove} tokens: only the last {self.recent_keys.length} are in the BF16 recent "
                "window, the rest is already quantized"
            )
        if remove > length:
            raise ValueError(f"cannot crop {remove} tokens from a layer that holds {length}")
        from_recent = min(remove, self.recent_keys.length)
        for buffer in (self.recent_keys, self.recent_values):
            buffer.truncate(buffer.length - from_recent)
        for buffer in (self.sink_keys, self.sink_values):
            buffer.truncate(buffer.length - (remove - from_recent))

    def offload(self):
        raise NotImplementedError("OscarCache does not support offloading: its packed history is already ~7x smaller")

    def prefetch(self):
        self.offload()

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


@dataclass
class QuantizeJob:
    """Rotated rows to quantize as ``spec`` says, straight into their history slots."""

    spec: TensorQuantConfig
    rows: torch.Tensor  # [B, H, n, D]
    target: QuantizedRows  # views of the history buffers


def quantize_jobs(jobs: list[QuantizeJob], metadata_dtype: torch.dtype) -> None:
    """Run quantize jobs, one kernel launch per shared format (every layer's K and V of oscar-int2: one)."""
    by_format: dict[tuple, list[QuantizeJob]] = {}
    for job in jobs:
        spec = job.spec
        by_format.setdefault((spec.bits, spec.group_of(job.rows.shape[-1]), spec.symmetric, job.rows.shape), []).append(job)
    for (bits, group, symmetric, _), same in by_format.items():
        quantize_pack_into(
            [job.rows for job in same], [job.target for job in same], bits, group, symmetric=symmetric,
            clip_ratios=[job.spec.clip_ratio for job in same], metadata_dtype=metadata_dtype,
        )  # fmt: skip


def quantize_rows(rows: torch.Tensor, spec: TensorQuantConfig, metadata_dtype: torch.dtype) -> QuantizedRows:
    """Quantize rotated rows as ``spec`` says (clip, then per-token min-max or symmetric).

    The fused Triton kernel on GPU, the torch reference elsewhere; both give identical codes.
    """
    return quantize_pack(
        rows,
        spec.bits,
        spec.group_of(rows.shape[-1]),
        symmetric=spec.symmetric,
        clip_ratio=spec.clip_ratio,
        metadata_dtype=metadata_dtype,
    )


def roundtrip_rows(rows: torch.Tensor, spec: TensorQuantConfig, metadata_dtype: torch.dtype) -> torch.Tensor:
    """Rows as they come back out of a history quantized with ``spec``."""
    quantized = quantize_rows(rows, spec, metadata_dtype)
    return dequantize(quantized, spec.bits, spec.group_of(rows.shape[-1]), rows.dtype)


def _check_finite(states: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(states).all()):
        raise ValueError(f"non-finite values (NaN/Inf) in the {name} states given to OscarCache")


class OscarCache(Cache):
    """A transformers ``Cache`` that stores the KV cache at ~2 bits per element with OSCAR rotations.

    Args:
        config: the model (or its config) this cache serves.
        method: a name from :data:`oscar_hf.core.config.METHODS` (``none``, ``naive-int2``, ``quarot-int2``,
            ``oscar-int2``, ``int4``, ``oscar-k4v2``, ``oscar-k3v2``) or an :class:`OscarConfig`.
        rotations: per-layer R_K/R_V, required by calibrated methods (``oscar-*``).
        max_cache_len: optional most tokens (prompt and generated) the cache will hold; the history is
            then allocated once at that size, as static decoding (:func:`oscar_hf.generate`) wants.
        decode_graphs: how one-token steps of plain ``model.generate`` run. None (default): on CUDA,
            the cache freezes into the static layout at the first such step (:mod:`oscar_hf.core.frozen_decoding`)
            and each layer's attention is replayed from a CUDA graph of its own, which cuts most of
            its host time; elsewhere it stays eager. True: freeze on any device (without
            graphs off CUDA: what the CPU tests compare). False: always the eager layout. Greedy
            tokens are the eager cache's either way (:func:`freeze_for_decoding`).
        **overrides: fields of :class:`OscarConfig` to change, e.g. ``sink=64, recent=256, block=8``.

    Full-attention layers become :class:`OscarLayer`; other layer types (sliding windows, linear
    attention) keep transformers' own layers in the model dtype. Memory and speed benefits need
    ``model.set_attn_implementation("oscar")``; with any other implementation the cache still works
    but hands dequantized K/V to that attention.

    Example::

        cache = OscarCache(model, "oscar-int2", rotations=from_pretrained(path))
        model.generate(**inputs, past_key_values=cache)
    """

    def __init__(
        self,
        config: PretrainedConfig | PreTrainedModel,
        method: str | OscarConfig = "oscar-int2",
        rotations: RotationSet | None = None,
        max_cache_len: int | None = None,
        decode_graphs: bool | None = None,
        **overrides,
    ):
        model_config = config.config if isinstance(config, PreTrainedModel) else config
        self.text_config = model_config.get_text_config(decoder=True)
        self.oscar_config = resolve_method(method, **overrides)
        head_dim = head_dim_of(self.text_config)
        self.oscar_config.validate(head_dim)
        stock_layers = DynamicCache(config=model_config).layers
        quantized_ids = [i for i, layer in enumerate(stock_layers) if type(layer) is DynamicLayer]
        if not quantized_ids:
            raise ValueError("this model has no full-attention layers for OscarCache to quantize")
        rotations = self._resolve_rotations(rotations, head_dim, quantized_ids, kv_heads_of(self.text_config))
        self.rotations = rotations = _own_kv_heads(rotations, config, kv_heads_of(self.text_config))
        self.capacity = max_cache_len  # (transformers 5.17 has a read-only Cache.max_cache_len)
        self.static: StaticDecoding | None = None
        self.decode_graphs = decode_graphs
        # Set when an operation that reorders or rolls back the cache thaws it, or when freezing is
        # refused for good: plain generate stops freezing the cache until reset().
        self.stays_eager = False
        layers = [self._layer(i, rotations, head_dim) if i in quantized_ids else layer
                  for i, layer in enumerate(stock_layers)]  # fmt: skip
        check_bit_budget(self.oscar_config, [layers[i].config for i in quantized_ids])
        self._first_oscar_layer = quantized_ids[0]
        super().__init__(layers=layers)

    def _layer(self, layer_id: int, rotations: RotationSet, head_dim: int) -> OscarLayer:
        config = self.oscar_config.for_layer(
            rotations.key_clip.get(layer_id), rotations.value_clip.get(layer_id),
            rotations.key_bits.get(layer_id), rotations.value_bits.get(layer_id),
        )  # fmt: skip
        config.validate(head_dim)
        key_rotation, value_rotation = rotations.for_layer(layer_id)
        if self.values_prerotated:
            value_rotation = None  # v_proj already emits v @ R_V and o_proj expects rotated outputs
        return OscarLayer(config, key_rotation, value_rotation, self.capacity)

    @classmethod
    def from_zoo(
        cls,
        model: PreTrainedModel | PretrainedConfig | str,
        rotations: str | Path = "default",
        method: str | OscarConfig = "oscar-int2",
        **kwargs,
    ) -> "OscarCache":
        """An OscarCache with published or bundled rotations; see :func:`oscar_hf.rotations.zoo.resolve_rotations`.

        ``model`` is the model (best: the cache then follows its attention setting), its config, or a
        model id (``"default"`` for the default model), whose config is loaded; a cache made from an id
        assumes the model runs ``attn_implementation="oscar"`` and raises a clear error otherwise.
        ``rotations`` is ``"default"`` (bundled for the model), a local directory (ours or the
        official RotationZoo layout), or a hub repo id; hub options (``revision``, ``subfolder``,
        ``calibration``, ...) go through ``kwargs``, cache options (``sink``, ``recent``, ...) too.
        A method with ``shared_rotations`` (``oscar-int2-paper``) takes a folder's shared rotations and
        the bundled set made without the clip search.
        """
        from oscar_hf.rotations.zoo import ZOO_OPTIONS, resolve_rotations

        if isinstance(model, str):
            from oscar_hf.core.models import load_config

            model = load_config(model)
            model._attn_implementation = ATTENTION_NAME
        zoo_options = {k: kwargs.pop(k) for k in list(kwargs) if k in ZOO_OPTIONS}
        return cls(model, method, rotations=resolve_rotations(model, rotations, method=method, **zoo_options), **kwargs)

    @property
    def values_prerotated(self) -> bool:
        """Whether the model's weights already apply R_V (``oscar_hf.rotations.absorption``)."""
        return getattr(self.text_config, ABSORBED_ATTRIBUTE, None) is not None

    def _resolve_rotations(
        self, rotations: RotationSet | None, head_dim: int, layer_ids: list[int], kv_heads: int
    ) -> RotationSet:
        config = self.oscar_config
        absorbed = getattr(self.text_config, ABSORBED_ATTRIBUTE, None)
        if absorbed is not None and (config.rotation != "calibrated" or rotations is None
                                     or rotations.value_fingerprint() != absorbed):
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
                "(OscarCache.from_zoo(...), oscar_hf.rotations.zoo.from_pretrained(...) or oscar_hf.rotations.calibration.calibrate(...))"
            )
        if config.shared_rotations and rotations.per_head:
            raise ValueError(
                f"method {config.method!r} uses one rotation per layer, but these rotations are per KV head; "
                "load the shared ones (per_head=False, or --shared-rotations) or use 'oscar-int2'"
            )
        rotations.check_model(head_dim, layer_ids, kv_heads)
        missing = [i for i in layer_ids if i not in rotations.key or i not in rotations.value]
        if missing:
            raise ValueError(f"the rotations lack R_K or R_V for layers {missing}")
        return rotations

    # The cache's bookkeeping (Python ints, a context variable, host-side plans) runs eagerly under
    # torch.compile: a compiled model breaks its graph here and compiles the layers around it.
    @torch.compiler.disable
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if not isinstance(layer, OscarLayer):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        _active_cache.set(weakref.ref(self))
        implementation = self.text_config._attn_implementation  # a config attribute read costs ~10 us
        static_step = key_states.shape[2] == 1 and implementation == ATTENTION_NAME
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
            layer.stash(key_states, value_states)
            return key_states, value_states
        warning_once(
            logger,
            f"OscarCache is used with attn_implementation={implementation!r}: it works, but "
            "attention then reads a dequantized BF16 copy of the history and left padding may fill the sink. "
            "Call model.set_attn_implementation('oscar') for the memory and speed benefits.",
        )
        return layer.update(key_states, value_states)

    def _demote_all(self, new_tokens: int) -> None:
        """Demote every layer's overflowing recent rows before the step: all layers' K and V in one launch.

        Layers advance together, so when the first is reached the rows every layer will demote
        this step are known; each layer's own plan then finds nothing left to demote.
        """
        jobs, metadata_dtype = [], self.oscar_config.metadata_dtype
        for layer in self.layers:
            if isinstance(layer, OscarLayer) and layer.is_initialized and layer.config.quantized:
                count = layer.planned_demotion(new_tokens)
                if count:
                    jobs += layer.demotion_jobs(count)
        quantize_jobs(jobs, metadata_dtype)

    def start_static(self, capacity: int | None = None, attention_mask: torch.Tensor | None = None) -> bool:
        """Freeze the cache for static decoding (CUDA-graph capture); False, with the reason logged, if it
        cannot be frozen yet or at all.

        Args:
            capacity: the most tokens the cache will hold; defaults to ``max_cache_len``.
            attention_mask: the ``[batch, tokens]`` padding mask of the sequence so far; only the sink
                may hold pads (left padding), which is checked (one host sync).

        Each later one-token step then runs shape-stable on the device. Anything else (a longer chunk,
        ``crop``, reordering, a memory report) thaws the cache back to its eager layout first.
        """
        if self.static is not None and not self.static.grows:
            return True
        self.stop_static()  # frozen by plain generate: freeze again at this fixed capacity
        return self._freeze(capacity or self.capacity, attention_mask)

    def freeze_for_decoding(self, layer_idx: int, attention_mask: torch.Tensor | None) -> None:
        """Freeze at the first layer's attention of a one-token step of plain ``generate``, where
        ``decode_graphs`` asks for it (see the constructor); the attention function calls this.

        That step's update already ran eagerly (its demotions included), so only its ring slot is
        reserved here. The frozen cache grows instead of filling up: MAX_SLACK_ROWS more history rows,
        as the eager cache's buffers would. Called when the cache cannot be frozen yet (before its
        sink is complete) it tries again next step; refused for good (padding after the sink,
        several devices...), it stays eager (the reason is logged at debug level).
        """
        if layer_idx != self._first_oscar_layer or self.stays_eager or self.decode_graphs is False:
            return
        device = self.layers[layer_idx].device
        if (self.decode_graphs is None and device.type != "cuda") or static_not_yet(self):
            return
        key_mask = None if attention_mask is None else allowed_keys(attention_mask)
        if not self._freeze(self._grown_capacity(), key_mask, replay=True, grows=True):
            self.stays_eager = True
            return
        self.static.advance()

    def _freeze(self, capacity: int | None, attention_mask: torch.Tensor | None, replay: bool = False,
                grows: bool = False) -> bool:  # fmt: skip
        reason = static_unsupported(self)
        if reason is None and capacity is None:
            reason = "no capacity: pass max_cache_len to the cache (or a capacity here)"
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
        """Tokens a growing frozen cache holds: its allocated history while that has room for another
        block (a copy of the history is put off until it is needed), else MAX_SLACK_ROWS more rows."""
        first = self.layers[self._first_oscar_layer]
        allocated, stored = first.history_keys.codes.data.shape[2], first.history_length
        history = allocated if allocated >= stored + first.config.block else stored + MAX_SLACK_ROWS
        return first.sink_keys.length + history

    def _grow_frozen(self) -> None:
        """A full cache frozen by plain generate: thaw, and freeze again with room for more history."""
        full = self.static
        full.thaw()
        self.static = StaticDecoding(self, self._grown_capacity(), full.sink_mask, replay=full.replay, grows=True)
        logger.debug("OscarCache grew its frozen history to %d tokens", self.static.capacity)

    def reset(self) -> None:
        self.stays_eager = False
        super().reset()

    def stop_static(self) -> None:
        """Thaw a frozen cache back to its eager layout (no device sync); nothing if it is not frozen."""
        if self.static is not None:
            self.static.thaw()

    def memory_report(self) -> MemoryReport:
        """Bytes of packed codes, metadata, sink and recent window per layer, with BPE and the BF16 baseline."""
        entries = []
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, OscarLayer):
                entries.append(layer.memory(idx))
            elif isinstance(layer, CacheLayerMixin):
                entries.append(LayerMemory.dense(idx, layer.keys, layer.values))
        return MemoryReport(self.oscar_config.method, entries)

    def __deepcopy__(self, memo: dict) -> "OscarCache":
        # The model config is shared, not copied: the copy must follow the model's attention setting.
        memo[id(self.text_config)] = self.text_config
        clone = copy.copy(self)
        clone.__dict__ = copy.deepcopy(self.__dict__, memo)
        return clone


def allowed_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[batch, keys]``, True where the newest query may attend, from a decode step's 4D mask (bool,
    or additive float)."""
    allowed = attention_mask[:, 0, -1, :]
    return allowed if allowed.dtype == torch.bool else allowed == 0


def kv_heads_of(text_config: PretrainedConfig) -> int:
    """The model's KV head count (all ranks together under tensor parallelism)."""
    return getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads


def tensor_parallel_rank(model: PreTrainedModel) -> tuple[int, int] | None:
    """(rank, size) of a model sharded by transformers' tensor parallelism (``tp_plan="auto"``), else None."""
    size = getattr(model, "tp_size", None)
    if not size or size == 1:
        return None
    manager = getattr(model, "_mesh_manager", None)  # transformers keeps the TP mesh there
    if manager is not None:
        return manager.get_mesh("tp").get_local_rank(), size
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() == size:
        return torch.distributed.get_rank(), size
    raise ValueError(f"cannot tell this process's rank in the model's tensor-parallel group of {size}")


def _own_kv_heads(rotations: RotationSet, model: PretrainedConfig | PreTrainedModel, kv_heads: int) -> RotationSet:
    """Under tensor parallelism, the per-head rotations of this rank's KV heads (transformers' colwise
    k_proj/v_proj give rank r the contiguous heads ``r * H / W .. (r + 1) * H / W - 1``)."""
    parallel = tensor_parallel_rank(model) if isinstance(model, PreTrainedModel) else None
    if parallel is None or not rotations.per_head:
        return rotations
    rank, size = parallel
    if kv_heads % size:
        raise ValueError(f"per-head rotations need the {kv_heads} KV heads split evenly over {size} ranks")
    local = kv_heads // size
    return rotations.select_kv_heads(rank * local, (rank + 1) * local)


def head_dim_of(text_config: PretrainedConfig) -> int:
    head_dim = getattr(text_config, "head_dim", None)
    return head_dim or text_config.hidden_size // text_config.num_attention_heads
