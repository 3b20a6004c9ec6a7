"""The edits made to a cache layer between steps: those transformers makes (reorder and repeat the
batch for beam search, crop the newest tokens for assisted decoding, and what it may ask but OscarCache
refuses), and moving the layer's tensors to the addresses a captured decode step reads
(:mod:`oscar_hf.core.step_reuse`)."""

from __future__ import annotations

import operator

import torch
import transformers

from oscar_hf.core.compat import positive_crop_keeps_length


class EditedLayer:
    """Batch reordering, repetition, cropping and moving of :class:`~oscar_hf.core.layer.OscarLayer`'s tiers (a
    mixin: it reads the layer's buffers; the edits transformers makes leave the frozen layout first)."""

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
        """Remove the newest tokens (window, then the history's end, then the sink), e.g. rejected candidates.

        Negative: that many tokens. Positive: as the installed transformers' own layers read it, the length
        to keep before 5.18, refused from 5.18 on. 5.17 passes a 0-d tensor, which must not turn the
        buffers' lengths into tensors.
        """
        tokens_to_remove = operator.index(tokens_to_remove)
        if tokens_to_remove > 0 and not positive_crop_keeps_length():
            raise ValueError(
                f"crop({tokens_to_remove}): transformers {transformers.__version__} takes a negative "
                "count of tokens to remove, as its own cache layers do"
            )
        self._require_idle("crop")
        self._leave_static(stay_eager=True)
        length = self.get_seq_length()
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, length - tokens_to_remove)
        if remove > length:
            raise ValueError(f"cannot crop {remove} tokens from a layer that holds {length}")
        from_recent = min(remove, self.recent_keys.length)
        from_history = min(remove - from_recent, self.history_length)
        from_sink = remove - from_recent - from_history
        for buffer in (self.recent_keys, self.recent_values):
            buffer.truncate(buffer.length - from_recent)
        if from_history:
            for history in (self.history_keys, self.history_values):
                history.truncate(history.length - from_history)
        for buffer in (self.sink_keys, self.sink_values):
            buffer.truncate(buffer.length - from_sink)

    def frame(self) -> tuple[list[torch.Tensor], dict[tuple, torch.Tensor], torch.Tensor | None]:
        """The tensors a frozen decode step of this layer reads and writes: its tiers' storage, the
        rotations as the step uses them and the key feedback factor (:meth:`move_into` takes another layer's)."""
        return [buffer.data for buffer in self._buffers()], self.rotation_copies(), self.key_feedback

    def frame_signature(self) -> tuple:
        """What must agree for this layer to :meth:`move_into` another's frame: its quantization (the
        kernels take widths and clip ratios as constants) and its storage's layout."""
        layout = [(b.start, tuple(b.data.shape), b.data.stride(), b.data.dtype, b.data.device) for b in self._buffers()]
        feedback = None if self.key_feedback is None else tuple(self.key_feedback.shape)
        return self.config, tuple(layout), feedback

    def move_into(self, frame: tuple[list[torch.Tensor], dict[tuple, torch.Tensor], torch.Tensor | None]) -> None:
        """Hold the tensors of ``frame`` (another layer's :meth:`frame`, of the same signature), with this
        layer's rows, rotations and feedback factor copied in; the tensors this layer held are freed."""
        storage, rotations, feedback = frame
        for buffer, data in zip(self._buffers(), storage, strict=True):
            buffer.move_into(data)
        self.move_rotation_copies_into(rotations)
        if feedback is not None:
            self.key_feedback = feedback.copy_(self.key_feedback)

    def offload(self):
        raise NotImplementedError("OscarCache does not support offloading: its packed history is already ~7x smaller")

    def prefetch(self):
        self.offload()
