"""Where a step's tokens go in an :class:`~oscar_hf.core.layer.OscarLayer`: the sink until every row has shown
its first ``sink`` real tokens, then the recent window, whose oldest rows are demoted into the packed
history (quantized once) when it would pass ``recent + block`` rows; a chunk too long for the window
has its middle quantized straight into the history."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_hf.core.layer_attention import allowed_keys
from oscar_hf.core.quantize_jobs import QuantizeJob, quantize_jobs, roundtrip_rows


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


class WindowPlanning:
    """Planning, demotion and storing of a step's tokens (a mixin of :class:`~oscar_hf.core.layer.OscarLayer`:
    it reads and writes the layer's tiers)."""

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

    def demotion_jobs_ahead(self, new_tokens: int) -> list[QuantizeJob]:
        """The demotions of the next step of ``new_tokens``, taken before it starts (the cache runs every
        layer's at once); the step's own plan then counts those rows as still in the window."""
        self._demoted_ahead = self._plan(new_tokens, 0).demote
        return self.demotion_jobs(self._demoted_ahead) if self._demoted_ahead else []

    def _plan(self, new_tokens: int, ahead: int) -> StepPlan:
        """Where ``new_tokens`` go, ``ahead`` of the window's oldest rows already demoted for this step."""
        length = self.get_seq_length()
        # Until every row has started, everything seen so far may precede a row's first real token.
        sink_end = self.sink_end if self.sink_end is not None else length + new_tokens + self.config.sink
        to_sink = 0
        if self.history_length == 0 and self.recent_keys.length == 0:
            to_sink = max(0, min(new_tokens, sink_end - self.sink_keys.length))
        overflow = 0
        if self.config.quantized:
            window = self.recent_keys.length + ahead + new_tokens - to_sink
            if window >= self.config.recent + self.config.block:
                overflow = window - self.config.recent
        demote = min(overflow, self.recent_keys.length + ahead)
        return StepPlan(to_sink, demote - ahead, overflow - demote)

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
            QuantizeJob(self.config.key, keys, self.history_keys.extend(count), self.feedback_for(keys)),
            QuantizeJob(self.config.value, values, self.history_values.extend(count)),
        ]

    def history_roundtrip(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What rotated ``keys``/``values`` rows become once stored in this layer's history."""
        return (
            roundtrip_rows(keys, self.config.key, self.config.metadata_dtype, self.feedback_for(keys)),
            roundtrip_rows(values, self.config.value, self.config.metadata_dtype),
        )
