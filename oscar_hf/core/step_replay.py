"""Whole decode steps replayed from a CUDA graph: a model's one-token forwards on a frozen OscarCache.

In eager transformers a decode step launches a few hundred small kernels from Python; at batch 1 the
host, not the GPU, sets the pace (tens of ms a token on an 8B model while its memory roofline is a few
ms). A :class:`StaticDecoder` keeps ``model.generate`` in charge of everything it does (logits
processors, sampling, stopping criteria, streamers, return values) and only swaps how a one-token
forward on its cache runs:

1. the cache is frozen (:meth:`OscarCache.start_static`) and the step runs eagerly on the frozen
   cache, which also compiles every kernel it needs;
2. the next step is captured in a CUDA graph (model forward, cache update, attention, position
   increment), and every step after that is one graph replay.

A later cache of the same shapes, or this one frozen again, replays that graph without capturing
(:mod:`oscar_hf.core.step_reuse`).

Position ids live in a device buffer the graph increments, so the captured step stays valid; the
attention mask is not an input (only the sink can hold pads, and its mask is fixed when freezing).

:func:`route_decode_steps` sends a model's forwards to the decoder of the cache they carry: plain
``model.generate`` (and anything else that calls the model with an OscarCache made from it) then
replays whole steps (:func:`oscar_hf.core.freezing.step_decoder_for`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterator

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.frozen_decoding import captured
from oscar_hf.core.fused_projections import fused_projections
from oscar_hf.core.step_reuse import CapturedStep, keep_idle, step_signature, take_idle
from oscar_hf.log import get_logger

logger = get_logger(__name__)

# Arguments generate passes to a decode step that the captured step reproduces (others go eager).
_STEP_ARGUMENTS = {
    "input_ids",
    "attention_mask",
    "position_ids",
    "use_cache",
    "return_dict",
    "logits_to_keep",
    "past_key_values",
    "cache",
    "cache_position",
}


class StaticDecoder:
    """Runs one-token forwards of ``model`` on a frozen ``cache``, captured in a CUDA graph or not.

    Args:
        model: a causal LM running ``attn_implementation="oscar"``.
        cache: the OscarCache it decodes with.
        capacity: the most tokens the cache will hold (default: its ``max_cache_len``; with neither,
            the frozen cache grows by a few thousand rows when full, and the step is captured again).
        capture: replay a CUDA graph (needs CUDA); False runs the very same static steps eagerly,
            which is what the tests compare on CPU.
        compile: run the decoder layers through ``torch.compile`` inside the step (regional: one
            compiled graph serves every layer; the cache update and attention stay eager). It fuses
            the many small kernels of norms, RoPE and activations that a replay still runs one by
            one; compiling takes about a minute for an 8B model, once per process and batch size.
            True uses ``torch.compile``'s default mode; a string picks one of :data:`COMPILE_MODES`
            (``"max-autotune-no-cudagraphs"`` also lets Inductor time Triton GEMMs against cuBLAS's;
            its kernel tuning can run inside the capture and make it fail, so it is not the default).
        fuse_projections: while decoding, run each layer's q/k/v and gate/up projections as one GEMM
            over their stacked weights (:mod:`oscar_hf.core.fused_projections`; the same outputs up to
            rounding, no extra memory). At batch 1 the small k and v projections read their weights at
            a lower bandwidth than q's, which the stacked GEMM avoids (``eval/results/bench_graph.md``).
            The weights are views into the stacked ones until :meth:`stop` (or the end of the cache) clones
            them back; a step run on the stacked weights is not kept past that.

    Raises:
        ValueError: ``capture`` without CUDA, or a compile mode that is not one of :data:`COMPILE_MODES`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache,
        capacity: int | None = None,
        capture: bool = True,
        compile: bool | str = False,
        fuse_projections: bool = True,
    ):
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA-graph capture needs a CUDA model, this one is on {model.device}")
        mode = _compile_mode(compile)
        self.model, self.capture = model, capture
        self._cache = weakref.ref(cache)  # the cache owns its decoder: no reference cycle keeps its memory alive
        self.compile = compile
        self.capacity = capacity if capacity is not None else cache.capacity
        self.fuse_projections = fuse_projections
        self.fusion: contextlib.ExitStack | None = None  # from freezing the cache to leaving static decoding
        self.layers = list(model.get_decoder().layers)
        self.compiled_layers = [torch.compile(layer.forward, mode=mode) for layer in self.layers] if compile else []
        self.eager_forward = eager_forward(model)
        self.keyword = cache_keyword(model)
        self.current: CapturedStep | None = None  # the frozen cache's step, kept through a thaw
        self._ending = weakref.finalize(cache, _cache_ended, self)
        self._ending.atexit = False

    @property
    def cache(self):
        """The OscarCache this decoder runs (it raises once the cache is gone)."""
        cache = self._cache()
        if cache is None:
            raise RuntimeError("the OscarCache of this StaticDecoder no longer exists")
        return cache

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The CUDA graph the next step replays (None before its capture, or while not frozen)."""
        return self.current.graph if self._serves(self.cache) else None

    def _serves(self, cache) -> bool:
        """Whether ``current`` is the step of ``cache``'s present freeze (a thaw or another freeze ends it)."""
        return self.current is not None and self.current.static is cache.static

    def stop(self) -> None:
        """Leave static decoding: the cache back in its eager layout, the projections unfused. The step is
        kept (a freeze of the same shapes replays its graph again) unless it ran fused projections."""
        self.cache.stop_static()
        self._unfuse()

    def _unfuse(self) -> None:
        """Give the projections their own weights back. A step run on the stacked ones ends with them: its
        graph reads their addresses, which unfusing frees."""
        if self.fusion is not None:
            self.fusion.close()
            self.fusion = None
            self.current = None

    def close(self) -> None:
        """:meth:`stop`, and free the step instead of keeping it (for a decoder made for one call)."""
        self.stop()
        self.current = None
        self._ending.detach()

    def forward(self, *args, **kwargs) -> Any:
        """A model forward: static for plain one-token steps on our cache, eager for anything else."""
        if len(args) == 1 and "input_ids" not in kwargs:  # model(ids, ...) as well as model(input_ids=ids, ...)
            args, kwargs = (), {"input_ids": args[0], **kwargs}
        logits = self.step(kwargs) if not args and self._is_decode_step(kwargs) else None
        if logits is None:
            self.stop()
            return self.eager_forward(*args, **kwargs)
        return CausalLMOutputWithPast(logits=logits, **{self.keyword: self.cache})

    def _is_decode_step(self, kwargs: dict) -> bool:
        ids = kwargs.get("input_ids")
        extra = [k for k, v in kwargs.items() if k not in _STEP_ARGUMENTS and v is not None and v is not False]
        return (
            not extra
            and kwargs.get(self.keyword) is self.cache
            and isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and ids.shape[1] == 1
            and kwargs.get("use_cache", True) is not False
            and kwargs.get("logits_to_keep", 1) in (0, 1)
        )

    def step(self, kwargs: dict) -> torch.Tensor | None:
        """Logits ``[B, 1, vocab]`` of one decode step, or None when the cache cannot be static now."""
        cache = self.cache  # one weak-reference lookup a step
        cache.require_intact()  # a replay runs none of the cache's checks
        if cache.stays_eager:  # refused for good, reordered or rolled back: until reset()
            return None
        ids = kwargs["input_ids"]
        static = cache.static
        if static is not None and self._serves(cache) and static.grows and static.full():
            self.stop()  # a growing cache: freeze again with more rows, capture again
        if cache.static is None or not self._serves(cache):  # (re)freeze: a kept step, or a new one
            if not cache.start_static(self.capacity, kwargs.get("attention_mask"), stay_eager_if_refused=True):
                return None
            if self.fuse_projections and self.fusion is None:
                self.fusion = contextlib.ExitStack()
                self.fusion.enter_context(fused_projections(self.model))
            if not self._take_step(ids, kwargs) and not self._warmed_up():
                return self._first_step()
        else:
            self.current.input_ids.copy_(ids)
        step = self.current
        if not self.capture:
            logits = self._run().clone()
        else:
            if step.graph is None:
                self._capture()
            cache.static.advance_host()  # the replay runs no Python: mirror its lengths here
            try:
                step.graph.replay()
            except BaseException as error:  # the mirror has advanced; what the device holds is unknown
                cache.mark_broken(f"a replayed decode step raised {type(error).__name__} ({error})")
                self.current = None  # nor is the step kept for another cache
                raise
            logits = step.logits.clone()
        step.take_frames()
        return logits

    def _take_step(self, ids: torch.Tensor, kwargs: dict) -> bool:
        """Serve the frozen cache from a step of its shapes (this decoder's own from before a thaw, or
        one a gone cache left with the model) and say so; else start a new one."""
        signature = step_signature(self.cache, ids, (self.compile, self.fuse_projections))
        positions = self._first_positions(ids, kwargs)
        own = self.current
        kept = own if own is not None and own.frames is not None and own.signature == signature else None
        kept = kept or take_idle(self.model, signature)
        if kept is not None:
            kept.adopt(self.cache, ids, positions)
            self.current = kept
            logger.debug("decoding from the %s step kept for these shapes", "cache's own" if kept is own else "model's")
            return True
        self.current = CapturedStep(signature, self.cache.static, ids.clone(), positions)
        return False

    def _warmed_up(self) -> bool:
        """Whether a step of these shapes ran in this process (its kernels compiled, the layers' code
        compiled, cuBLAS initialised), so that the first step can be captured at once; marks them as run."""
        static = self.cache.static
        shapes = (
            tuple(self.current.input_ids.shape),
            static.sink_rows,
            static.history_capacity,
            static.sink_mask is None,
            self.compile,
            self.fuse_projections,
        )
        seen = _warm_shapes.setdefault(self.model, set())
        if not self.capture or shapes not in seen:
            seen.add(shapes)
            return False
        return True

    def _first_positions(self, ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
        positions = kwargs.get("position_ids")
        if positions is None:  # as the model itself would: right after the cached tokens
            positions = torch.full_like(ids, self.cache.get_seq_length())
        return positions[:, -1:].to(device=ids.device, dtype=torch.long).clone()

    def _first_step(self) -> torch.Tensor:
        """The first static step runs eagerly; with capture ahead, on a side stream (lazy initialisation
        of cuBLAS and friends belongs outside the graph), which also compiles every kernel the graph uses."""
        if not self.capture:
            return self._run().clone()
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            logits = self._run().clone()
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        return logits

    def _capture(self) -> None:
        step = self.current
        step.graph, step.logits = captured(self._run, None, torch.cuda.Stream(self.model.device))
        logger.info("captured a decode step of %s in a CUDA graph", type(self.model).__name__)

    def _run(self) -> torch.Tensor:
        """The step a graph captures: forward on the static inputs, then the next position."""
        step = self.current
        with torch.no_grad(), self._compiled_layers():
            output = self.eager_forward(
                input_ids=step.input_ids,
                position_ids=step.position_ids,
                use_cache=True,
                logits_to_keep=1,
                return_dict=True,
                **{self.keyword: self.cache},
            )
        step.position_ids.add_(1)
        return output.logits

    @contextlib.contextmanager
    def _compiled_layers(self) -> Iterator[None]:
        """The compiled layer forwards for the static step only (prefill shapes would recompile them).

        Each attention module hands its own ``layer_idx`` to the cache. Specialised on it, Dynamo
        compiled one graph per layer until its recompile limit (8), then ran the remaining layers
        eagerly: 28 of Qwen3-8B's 36. As a dynamic int (automatic dynamic, which ``dynamic=False``
        would forbid) it costs one recompile, and one graph serves every layer.
        """
        for layer, compiled in zip(self.layers, self.compiled_layers):
            layer.forward = compiled
        try:
            # a layer Dynamo cannot compile runs eagerly (logged by torch) rather than failing the step
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, suppress_errors=True):
                yield
        finally:
            for layer in self.layers[: len(self.compiled_layers)]:
                del layer.forward


def _cache_ended(decoder: StaticDecoder) -> None:
    """The decoder's cache is gone: leave its step with the model for the next cache (a step of fused
    projections ends with them instead)."""
    decoder._unfuse()
    if decoder.current is not None:
        keep_idle(decoder.model, decoder.current)
        decoder.current = None


# Per model, the shapes of steps already run in this process (StaticDecoder._warmed_up).
_warm_shapes: weakref.WeakKeyDictionary[PreTrainedModel, set[tuple]] = weakref.WeakKeyDictionary()

# torch.compile modes for the layers inside the captured step: the others capture CUDA graphs of
# their own (cudagraph trees), which cannot nest in the step's capture.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def _compile_mode(compile: bool | str) -> str | None:
    """``torch.compile``'s mode for ``StaticDecoder(compile=...)`` (None: its default)."""
    if isinstance(compile, bool):
        return None
    if compile not in COMPILE_MODES:
        raise ValueError(
            f"compile={compile!r}: use True, False or one of {COMPILE_MODES} (modes that capture "
            "CUDA graphs themselves cannot run inside the step's graph)"
        )
    return compile


def compiles_layers(model: PreTrainedModel) -> bool:
    """Whether decoders compile ``model``'s layers unless told: on CUDA, unless its generation config has
    ``disable_compile`` (as ``generate`` compiles its forward for transformers' static caches)."""
    return model.device.type == "cuda" and not getattr(model.generation_config, "disable_compile", False)


def route_decode_steps(model: PreTrainedModel) -> None:
    """Send every forward of ``model`` that carries a cache with a ``step_decoder`` through that decoder
    (:meth:`StaticDecoder.forward`); other forwards run as before. Installed once per model, as an
    instance-level ``forward`` over the one the model had (accelerate's hooks, for example, set one)."""
    if getattr(model.__dict__.get("forward"), "routes_decode_steps", False):
        return
    inner = model.forward
    keyword = cache_keyword(model)

    # generate inspects forward's signature to decide what to pass (position_ids among others)
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        decoder = getattr(kwargs.get(keyword), "step_decoder", None)
        return (inner if decoder is None else decoder.forward)(*args, **kwargs)

    forward.routes_decode_steps = True
    forward.eager_forward = inner
    model.forward = forward


def eager_forward(model: PreTrainedModel):
    """``model``'s forward beneath :func:`route_decode_steps`'s routing."""
    forward = model.forward
    return getattr(forward, "eager_forward", forward)
