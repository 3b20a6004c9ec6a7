"""Steps that reach every layer or none: an OscarCache either stores a forward pass in all its quantized
layers, or is marked broken and refuses every further use until ``reset()``.

A forward runs layer by layer, and a layer stores the step as soon as its attention has run; a
failure in a later layer (a non-finite value found by ``check_finite``, an out-of-memory error,
a wrong input) would leave the layers holding different numbers of tokens. What can be checked
before the first layer stores anything is (:meth:`StepGuard._open_step`); anything later marks the
cache broken, with the reason.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import NamedTuple

import torch
from transformers import PretrainedConfig

from oscar_hf.core.layer import check_finite_states
from oscar_hf.model_info import full_attention_layer_ids, head_dim_of, kv_heads_of


class _Step(NamedTuple):
    cache: weakref.ReferenceType
    layer_idx: int  # the layer whose update came last: its attention comes next in the same forward


# The step in progress in this context: the attention function, which never sees the cache, finds its
# layer through it. A weak reference, so that a finished cache can be freed.
_current_step: ContextVar[_Step | None] = ContextVar("oscar_current_step", default=None)


def waiting_cache(layer_idx: int):
    """The cache whose update for ``layer_idx`` came last in this context, or None.

    transformers runs each layer's cache update right before its attention; an attention whose layer
    was not the last one updated belongs to another forward (``use_cache=False``, another cache), and
    a step registered earlier is then over: it is forgotten, so that it cannot be mistaken for this one.
    """
    step = _current_step.get()
    if step is None:
        return None
    if step.layer_idx != layer_idx:
        _current_step.set(None)
        return None
    return step.cache()


class CacheBrokenError(RuntimeError):
    """A failed step left an OscarCache's layers out of step; ``reset()`` makes it usable again."""


class StepGuard:
    """The step bookkeeping of :class:`~oscar_hf.core.cache.OscarCache` (a mixin: it reads the cache's
    ``layers``, ``layer_ids``, ``head_dim``, ``text_config`` and ``oscar_config``)."""

    def _init_steps(self) -> None:
        self._step_open, self._finished_layers = False, 0
        self.broken: str | None = None  # why the cache can no longer be used, until reset()
        self._model_checked = False

    def _open_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse a broken cache and a step it cannot store, before any layer stores anything."""
        try:
            self.require_intact()
            self._check_step_inputs(key_states, value_states)
        except BaseException:
            self._release_step()
            raise
        self._step_open, self._finished_layers = True, 0

    def _register_update(self, layer_idx: int) -> None:
        """``layer_idx``'s update ran: its attention, next, finds this cache (:func:`waiting_cache`)."""
        _current_step.set(_Step(weakref.ref(self), layer_idx))

    def _release_step(self) -> None:
        """Forget a refused or failed step: no chunk stays pending and no later forward finds this cache."""
        step = _current_step.get()
        if step is not None and step.cache() is self:
            _current_step.set(None)
        for layer in self.layers:
            if getattr(layer, "has_pending", False):
                layer.drop_pending()

    def _check_step_inputs(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape != value_states.shape:
            raise ValueError(
                f"key and value states differ in shape: {tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if key_states.shape[-1] != self.head_dim:
            raise ValueError(
                f"this OscarCache was made for head_dim {self.head_dim}, but the model gives {key_states.shape[-1]}"
            )
        first = self.layers[self._first_oscar_layer]
        if first.is_initialized:
            given = (key_states.shape[0], key_states.shape[1], key_states.dtype, key_states.device)
            held = (first.sink_keys.data.shape[0], first.sink_keys.data.shape[1], first.dtype, first.device)
            for what, got, want in zip(("batch size", "KV heads", "dtype", "device"), given, held):
                if got != want:
                    raise ValueError(
                        f"this OscarCache holds {what} {want}, but the step gives {got}; "
                        "use a fresh cache (or cache.reset()) for a different batch or model"
                    )
        if self.oscar_config.check_finite:
            check_finite_states(key_states, "key")
            check_finite_states(value_states, "value")

    @contextlib.contextmanager
    def layer_step(self, layer_idx: int, stores: bool = True) -> Iterator[None]:
        """Layer ``layer_idx``'s part of the step in progress: an error inside breaks the cache if earlier
        layers stored the step; ``stores``: leaving the block normally means the layer stored it."""
        try:
            yield
        except BaseException as error:
            self.step_failed(layer_idx, error)
            raise
        if stores:
            self._layer_finished()

    def _layer_finished(self) -> None:
        self._finished_layers += 1
        if self._finished_layers == len(self.layer_ids):
            self._step_open = False

    def step_failed(self, layer_idx: int, error: BaseException) -> None:
        """A layer raised during the step in progress: the layers before it have stored the step."""
        self._release_step()
        if self._step_open:
            self._break(
                f"layer {layer_idx} raised {type(error).__name__} ({error}) after "
                f"{self._finished_layers} of {len(self.layer_ids)} quantized layers had stored the step"
            )

    def _fail_step(self, reason: str) -> None:
        self._release_step()
        if self._step_open:
            self._break(reason)
        raise ValueError(reason)

    def mark_broken(self, reason: str) -> None:
        """A step failed where no layer could tell (a replayed CUDA graph): refuse further use until ``reset()``."""
        self._release_step()
        self._break(reason)

    def _break(self, reason: str) -> None:
        self.broken, self._step_open = reason, False

    def require_intact(self) -> None:
        """Raise if a failed step left the layers out of step (they cannot be trusted until ``reset()``)."""
        if self._step_open and any(getattr(layer, "has_pending", False) for layer in self.layers):
            self._break(
                "a forward pass gave OscarCache key/value states that no attention used: the model's "
                "attention must go through attn_implementation='oscar' for every layer"
            )
        elif self._step_open:  # a step began and never finished: its error was raised elsewhere
            self._break(
                f"a forward pass stopped after {self._finished_layers} of {len(self.layer_ids)} "
                "quantized layers had stored its tokens"
            )
        if self.broken is not None:
            raise CacheBrokenError(
                f"this OscarCache cannot be used any more: {self.broken}. Call cache.reset() "
                "(or make a new cache) and run the prompt again."
            )

    def check_model(self, config: PretrainedConfig) -> None:
        """Refuse a model other than the one the cache was made for (its full-attention layers, head_dim
        and KV heads), naming the difference; checked once, at the first step under the oscar attention."""
        if self._model_checked:
            return
        theirs = (full_attention_layer_ids(config), head_dim_of(config), kv_heads_of(config))
        ours = (self.layer_ids, self.head_dim, kv_heads_of(self.text_config))
        for what, got, want in zip(("full-attention layers", "head_dim", "KV heads"), theirs, ours):
            if got != want:
                self._fail_step(
                    f"this OscarCache was made for a model with {what} {want}, but is used with one "
                    f"with {what} {got}; build the cache from this model"
                )
        self._model_checked = True
