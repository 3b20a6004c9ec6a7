"""Growable per-layer buffers: ``[batch, heads, capacity, *row]`` tensors whose first ``length`` rows are valid.

Capacity grows by half of itself, but by at most ``MAX_SLACK_ROWS``: geometric growth keeps
appends amortised O(1) while buffers are small, and the cap bounds the unused tail of a long
history (plain 1.5x growth left ~48% of a 100K-token INT2 history allocated but unused, which cut
the number of sequences that fit on a GPU by a third). A regrowth copies the buffer once per
``MAX_SLACK_ROWS`` appended rows, a negligible cost per token. From ``2 * MAX_SLACK_ROWS`` rows on, a
buffer holds whole buckets of ``MAX_SLACK_ROWS`` rows: the layout plain ``generate`` freezes a history in
(:meth:`~oscar_hf.core.freezing.FrozenLayouts.freeze_for_decoding`), which then needs no copy. Static
decoding (``oscar_hf.core.frozen_decoding``) fixes the capacity and writes by index on the device.

Capacities are whole multiples of ``ROW_ALIGNMENT`` rows, so that each head's rows start 16-row
aligned: the decode kernels then read a tile's per-row scales and zeros as 16-byte vectors, and the
Gluon history span can stage them in shared memory (``cp.async`` needs 4-byte aligned copies).
"""

from __future__ import annotations

import torch

from oscar_hf.kernels._triton import ROW_ALIGNMENT
from oscar_hf.quant import QuantizedRows, dequantize

_MIN_CAPACITY = 64
_GROWTH = 1.5
MAX_SLACK_ROWS = 4096


def aligned_rows(rows: int) -> int:
    """``rows`` rounded up to a whole multiple of ``ROW_ALIGNMENT``."""
    return -(-rows // ROW_ALIGNMENT) * ROW_ALIGNMENT


class RowBuffer:
    """Rows appended along dim 2 of a preallocated tensor; the valid rows are ``start .. start + length``.

    Dropping rows from the front only moves ``start``; the rows are moved back to the front when an
    append reaches the end of the capacity, so a sliding window costs one copy every many drops
    instead of one per drop.
    """

    def __init__(self, batch: int, heads: int, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.data = torch.empty(batch, heads, 0, *row_shape, dtype=dtype, device=device)
        self.start = 0
        self.length = 0
        self._view: tuple[int, int, torch.Tensor] | None = None  # (start, length, view) of the current data

    def view(self) -> torch.Tensor:
        """The valid rows. Kept while they do not change: a decode step asks for each tier's rows
        several times, and slicing costs host time (~3-5 us) at every call."""
        cached = self._view
        if cached is None or cached[0] != self.start or cached[1] != self.length:
            self._view = cached = (self.start, self.length, self.data.narrow(2, self.start, self.length))
        return cached[2]

    def append(self, rows: torch.Tensor) -> None:
        if rows.shape[2]:
            self.extend(rows.shape[2]).copy_(rows)

    def extend(self, count: int) -> torch.Tensor:
        """Make room for ``count`` more rows and return them (uninitialised) for the caller to fill."""
        self._reserve(self.length + count)
        end = self.start + self.length
        self.length += count
        return self.data[:, :, end : end + count]

    def drop_front(self, count: int) -> torch.Tensor:
        """Remove the oldest ``count`` rows and return them: a view, valid until the next append."""
        dropped = self.data[:, :, self.start : self.start + count]
        self.start += count
        self.length -= count
        return dropped

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def fix_capacity(self, capacity: int, at_least: bool = False) -> None:
        """Hold exactly ``capacity`` rows (``at_least``: or more, if already allocated), the valid ones
        first: fixed addresses for static decoding. Reallocates only when the layout does not fit."""
        if capacity < self.length:
            raise ValueError(f"a capacity of {capacity} rows cannot hold the {self.length} stored")
        allocated = self.data.shape[2]
        if self.start == 0 and (allocated == capacity or (at_least and allocated > capacity)):
            return
        fixed = self.data.new_empty(*self.data.shape[:2], capacity, *self.data.shape[3:])
        fixed[:, :, : self.length] = self.view()
        self._replace(fixed)

    def unroll(self, start: int, length: int) -> None:
        """Take the buffer as a ring whose ``length`` valid rows begin at ``start`` (wrapping around its
        end) and lay them out plainly again, oldest first."""
        if start:
            self._replace(torch.roll(self.data, -start, dims=2))
        self.start, self.length = 0, length

    def move_into(self, data: torch.Tensor) -> None:
        """Hold ``data``, a tensor of this buffer's shape, instead, with this buffer's rows copied in."""
        if data.shape != self.data.shape or data.dtype != self.data.dtype:
            raise ValueError(f"cannot move a {tuple(self.data.shape)} buffer into a {tuple(data.shape)} tensor")
        data.copy_(self.data)
        self._replace(data, self.start)

    def select_batch(self, index: torch.Tensor) -> None:
        self._replace(self.data.index_select(0, index.to(self.data.device)), self.start)

    def repeat_batch(self, repeats: int) -> None:
        self._replace(self.data.repeat_interleave(repeats, dim=0), self.start)

    def used_bytes(self) -> int:
        return self.view().numel() * self.data.element_size()

    def _reserve(self, needed: int) -> None:
        """Room for ``needed`` valid rows after ``start``; else move them to the front of a (larger) buffer."""
        capacity = self.data.shape[2]
        if self.start + needed <= capacity:
            return
        if self.start:  # a sliding window moved back to the front keeps room for half its rows again
            new_capacity = max(capacity, min(int(needed * _GROWTH), needed + MAX_SLACK_ROWS))
        elif needed >= 2 * MAX_SLACK_ROWS:  # a long buffer: whole buckets, the layout a frozen cache takes
            new_capacity = -(-needed // MAX_SLACK_ROWS) * MAX_SLACK_ROWS
        else:  # a full buffer grows by half of itself, capped
            new_capacity = max(needed, min(int(capacity * _GROWTH), needed + MAX_SLACK_ROWS), _MIN_CAPACITY)
        shape = (*self.data.shape[:2], aligned_rows(new_capacity), *self.data.shape[3:])
        moved = torch.empty(shape, dtype=self.data.dtype, device=self.data.device)
        moved[:, :, : self.length] = self.view()
        self._replace(moved)

    def _replace(self, data: torch.Tensor, start: int = 0) -> None:
        """Hold ``data`` instead (its valid rows from ``start``); the old tensor is freed with its view."""
        self.data, self.start, self._view = data, start, None


class PackedHistory:
    """The quantized history of one tensor (K or V) of one layer: packed codes plus (scale, zero) per group."""

    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        bits: int,
        group_size: int,
        metadata_dtype: torch.dtype,
        device: torch.device,
    ):
        self.bits, self.group_size = bits, group_size
        groups = head_dim // group_size
        self.codes = RowBuffer(batch, heads, (head_dim * bits // 8,), torch.uint8, device)
        self.scale = RowBuffer(batch, heads, (groups,), metadata_dtype, device)
        self.zero = RowBuffer(batch, heads, (groups,), metadata_dtype, device)

    @property
    def length(self) -> int:
        return self.codes.length

    def extend(self, count: int) -> QuantizedRows:
        """Room for ``count`` more rows, returned as views for a kernel to write in place."""
        return QuantizedRows(self.codes.extend(count), self.scale.extend(count), self.zero.extend(count))

    def packed(self) -> QuantizedRows:
        return QuantizedRows(self.codes.view(), self.scale.view(), self.zero.view())

    def whole(self) -> QuantizedRows:
        """Every allocated row, valid or not (static decoding tracks the valid ones on the device)."""
        return QuantizedRows(self.codes.data, self.scale.data, self.zero.data)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """A transient dense copy ``[batch, heads, length, head_dim]``; callers must not keep it."""
        return dequantize(self.packed(), self.bits, self.group_size, dtype)

    def buffers(self) -> tuple[RowBuffer, RowBuffer, RowBuffer]:
        return self.codes, self.scale, self.zero

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` rows (the newest go first, as ``crop`` removes them)."""
        for buffer in self.buffers():
            buffer.truncate(length)

    def fix_capacity(self, rows: int, at_least: bool = False) -> None:
        """Room for ``rows`` rows (rounded up to whole ``ROW_ALIGNMENT`` rows) at fixed addresses."""
        for buffer in self.buffers():
            buffer.fix_capacity(aligned_rows(rows), at_least)

    def code_bytes(self) -> int:
        return self.codes.used_bytes()

    def metadata_bytes(self) -> int:
        return self.scale.used_bytes() + self.zero.used_bytes()
