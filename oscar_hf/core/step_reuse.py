"""Captured decode steps kept for the next cache of the same shapes.

A CUDA graph replays fixed addresses: those of the frozen cache it was captured on. Capturing a whole
decode step runs the model's forward once from Python (tens of milliseconds for an 8B model), which a
fresh cache would pay again, and lm-eval, pipelines and most scripts make a fresh cache per call. So a
:class:`~oscar_hf.core.step_replay.StaticDecoder` holds its step as a :class:`CapturedStep` (the graph, its
inputs and output, and every tensor of the frozen cache the graph reads) and, when its cache is gone,
leaves it with the model (:func:`keep_idle`). The next cache of that model whose frozen layout has the same
shapes (batch, sink rows, history capacity bucket, dtype, widths and clip ratios) copies its rows and
rotations into those tensors, takes them as its own and replays the graph at once
(:meth:`CapturedStep.adopt`).

As transformers keeps a StaticCache on the model for the next ``generate``, this keeps one frozen cache's
memory per model after the cache is gone; :func:`release_captured_steps` frees it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from oscar_hf.core.frozen_decoding import StaticDecoding


@dataclass(eq=False)
class CapturedStep:
    """One frozen cache's decode step: what a CUDA graph of it reads and writes.

    ``frames`` are the layers' :meth:`~oscar_hf.core.layer_edits.EditedLayer.frame`, taken once the step has
    run (the rotations it uses are made then); a step without them cannot be adopted yet.
    """

    signature: tuple
    static: StaticDecoding
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    frames: list | None = None

    def take_frames(self) -> None:
        if self.frames is None:
            self.frames = [layer.frame() for layer in self.static.layers]

    def adopt(self, cache, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Move frozen ``cache`` (of this step's signature) into this step's tensors, ``ids`` and
        ``positions`` into its inputs."""
        fresh = cache.static
        for layer, frame in zip(fresh.layers, self.frames, strict=True):
            layer.move_into(frame)
        self.static.take_over(fresh)
        self.input_ids.copy_(ids)
        self.position_ids.copy_(positions)


def step_signature(cache, ids: torch.Tensor, options: tuple) -> tuple:
    """What must agree for frozen ``cache`` to adopt a step: the inputs' shape, the decoder's ``options``
    (compiled layers, fused projections), the frozen sizes and every layer's layout and quantization."""
    static = cache.static
    layers = tuple(layer.frame_signature() for layer in static.layers)
    return tuple(ids.shape), ids.dtype, options, static.signature(), layers


# Per model, the step of its last cache that ended (one: it holds that cache's frozen memory).
_idle: weakref.WeakKeyDictionary[PreTrainedModel, CapturedStep] = weakref.WeakKeyDictionary()


def keep_idle(model: PreTrainedModel, step: CapturedStep) -> None:
    """Keep the step of a cache that is gone for the next cache of ``model`` (replacing the one kept)."""
    if step.frames is None:
        return
    step.static.release()
    _idle[model] = step


def take_idle(model: PreTrainedModel, signature: tuple) -> CapturedStep | None:
    """The step kept for ``model``, if its signature is ``signature`` (it is then no longer kept)."""
    step = _idle.pop(model, None)  # taken first: a cache ending meanwhile (a finalizer) may keep another
    if step is not None and step.signature != signature:
        _idle.setdefault(model, step)
        return None
    return step


def release_captured_steps(model: PreTrainedModel | None = None) -> None:
    """Free the decode step (its CUDA graph and frozen buffers) kept for ``model``'s next cache; without a
    model, every model's. The next cache then captures its own."""
    if model is None:
        _idle.clear()
    else:
        _idle.pop(model, None)
