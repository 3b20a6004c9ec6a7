"""Fast decoding: ``model.generate`` whose one-token steps replay a CUDA graph over a frozen OscarCache.

In eager transformers a decode step launches a few hundred small kernels from Python; at batch 1 the
host, not the GPU, sets the pace (tens of ms a token on an 8B model while its memory roofline is a few
ms). :func:`generate` keeps ``model.generate`` in charge of everything it does (logits processors,
sampling, stopping criteria, streamers, return values) and only swaps how a one-token forward runs:

1. the prefill runs eagerly, as always;
2. at the first one-token step the cache is frozen (:meth:`OscarCache.start_static`) and the step runs
   eagerly on the frozen cache, which also compiles every kernel it needs;
3. the next step is captured in a CUDA graph (model forward, cache update, attention, position
   increment), and every step after that is one graph replay.

Position ids live in a device buffer the graph increments, so the captured step stays valid; the
attention mask is not an input (only the sink can hold pads, and its mask is fixed when freezing).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Iterator

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from oscar_hf.core.cache import OscarCache
from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.fused_projections import fused_projections
from oscar_hf.log import get_logger

logger = get_logger(__name__)

# Arguments generate passes to a decode step that the captured step reproduces (others go eager).
_STEP_ARGUMENTS = {"input_ids", "attention_mask", "position_ids", "use_cache", "return_dict", "logits_to_keep",
                   "past_key_values", "cache", "cache_position"}  # fmt: skip


class StaticDecoder:
    """Runs one-token forwards of ``model`` on a frozen ``cache``, captured in a CUDA graph or not.

    Args:
        model: a causal LM running ``attn_implementation="oscar"``.
        cache: the OscarCache it decodes with.
        capacity: the most tokens the cache will hold (default: its ``max_cache_len``).
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
            rounding, no extra memory; default). At batch 1 the small k and v projections read their
            weights at a lower bandwidth than q's, which the stacked GEMM avoids
            (``eval/results/bench_graph.md``). The weights are
            views into the stacked ones until :meth:`stop` (which ``generate`` calls) clones them back.

    Raises:
        ValueError: ``capture`` without CUDA, or a compile mode that is not one of :data:`COMPILE_MODES`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: OscarCache,
        capacity: int | None = None,
        capture: bool = True,
        compile: bool | str = False,
        fuse_projections: bool = True,
    ):
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA-graph capture needs a CUDA model, this one is on {model.device}")
        mode = _compile_mode(compile)
        self.model, self.cache, self.capacity, self.capture = model, cache, capacity, capture
        self.fuse_projections = fuse_projections
        self.fusion: contextlib.ExitStack | None = None  # from freezing the cache to leaving static decoding
        self.layers = list(model.get_decoder().layers)
        self.compiled_layers = [torch.compile(layer.forward, mode=mode) for layer in self.layers] if compile else []
        self.eager_forward = model.forward
        self.keyword = cache_keyword(model)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.input_ids = self.position_ids = self.logits = None

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Route the model's one-token forwards through :meth:`forward` meanwhile (``generate`` calls it)."""
        own_forward = self.model.__dict__.get("forward")  # e.g. accelerate's device hooks wrap forward per instance

        # generate inspects forward's signature to decide what to pass (position_ids among others)
        @functools.wraps(self.eager_forward)
        def forward(*args, **kwargs):
            return self.forward(*args, **kwargs)

        self.model.forward = forward
        try:
            yield
        finally:
            _restore_forward(self.model, own_forward)
            self.stop()

    def stop(self) -> None:
        """Leave static decoding: the cache back in its eager layout, the projections unfused, the
        graph dropped (the next step freezes and captures again)."""
        self.cache.stop_static()
        if self.fusion is not None:
            self.fusion.close()
            self.fusion = None
        self.graph = self.input_ids = None

    def forward(self, *args, **kwargs) -> Any:
        """A model forward: static for plain one-token steps on our cache, eager for anything else."""
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
        ids = kwargs["input_ids"]
        if self.cache.static is None or self.input_ids is None:  # (re)freeze: new buffers, a new graph
            if not self.cache.start_static(self.capacity, kwargs.get("attention_mask")):
                return None
            if self.fuse_projections and self.fusion is None:
                self.fusion = contextlib.ExitStack()
                self.fusion.enter_context(fused_projections(self.model))
            self.input_ids = ids.clone()
            self.position_ids = self._first_positions(ids, kwargs)
            self.graph = None
            return self._first_step()
        self.input_ids.copy_(ids)
        if not self.capture:
            return self._run().clone()
        if self.graph is None:
            self._capture()
        self.cache.static.advance_host()  # the replay runs no Python: mirror its lengths here
        self.graph.replay()
        return self.logits.clone()

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
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()
        logger.info("captured a decode step of %s in a CUDA graph", type(self.model).__name__)

    def _run(self) -> torch.Tensor:
        """The step a graph captures: forward on the static inputs, then the next position."""
        with torch.no_grad(), self._compiled_layers():
            output = self.eager_forward(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=True,
                                        logits_to_keep=1, return_dict=True, **{self.keyword: self.cache})  # fmt: skip
        self.position_ids.add_(1)
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
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
                yield
        finally:
            for layer in self.layers[: len(self.compiled_layers)]:
                del layer.forward


# torch.compile modes for the layers inside the captured step: the others capture CUDA graphs of
# their own (cudagraph trees), which cannot nest in the step's capture.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def _compile_mode(compile: bool | str) -> str | None:
    """``torch.compile``'s mode for ``StaticDecoder(compile=...)`` (None: its default)."""
    if isinstance(compile, bool):
        return None
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile={compile!r}: use True, False or one of {COMPILE_MODES} (modes that capture "
                         "CUDA graphs themselves cannot run inside the step's graph)")  # fmt: skip
    return compile


def _restore_forward(module: torch.nn.Module, own_forward) -> None:
    """Undo an instance-level ``forward`` override: back to the module's own one, or to its class's."""
    if own_forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own_forward


def generate(
    model: PreTrainedModel,
    inputs: torch.Tensor | None = None,
    *,
    capture: bool | None = None,
    compile: bool | str = False,
    fuse_projections: bool = True,
    **kwargs,
):
    """``model.generate`` with its decode steps replayed from a CUDA graph: same arguments, same outputs.

    Pass the OscarCache as in ``model.generate`` (``past_key_values=`` or, on newer transformers,
    ``cache=``). Greedy decoding gives the tokens of the eager OscarCache path; sampling, logits
    processors, stopping criteria and streamers are transformers' own.

    Args:
        model: a causal LM with ``attn_implementation="oscar"``, full attention in every layer.
        inputs, **kwargs: as ``model.generate``.
        capture: None (default) captures on CUDA and falls back to plain ``model.generate`` elsewhere
            (CPU has no CUDA graphs); False runs the static steps without a graph (for tests).
        compile: also compile the decoder layers inside the captured step: True, or a mode of
            :data:`COMPILE_MODES` (see :class:`StaticDecoder`).
        fuse_projections: stacked q/k/v and gate/up GEMMs while decoding (see :class:`StaticDecoder`).

    Beam search, assisted decoding and caches that cannot be frozen run eagerly (logged).

    Example::

        cache = OscarCache.from_zoo(model, "default", max_cache_len=4096)
        out = oscar_hf.generate(model, **inputs, past_key_values=cache, max_new_tokens=256)
    """
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(cache, OscarCache):
        raise ValueError("oscar_hf.generate needs an OscarCache, passed as past_key_values= (or cache=)")
    config = _generation_config(model, kwargs)
    eager_reason = None
    if capture is None and model.device.type != "cuda":
        eager_reason = f"no CUDA graphs on {model.device}"
    elif (config.num_beams or 1) > 1 or kwargs.get("assistant_model") is not None:
        eager_reason = "beam search and assisted decoding reorder or roll back the cache"
    if eager_reason is not None:
        logger.info("oscar_hf.generate decodes eagerly: %s", eager_reason)
        return model.generate(inputs, **kwargs)
    prompt = inputs if inputs is not None else kwargs.get("input_ids")
    capacity = cache.capacity or _capacity(prompt, config, cache)
    decoder = StaticDecoder(model, cache, capacity, capture=capture is not False, compile=compile,
                            fuse_projections=fuse_projections)  # fmt: skip
    with decoder.patched():
        return model.generate(inputs, **kwargs)


def _generation_config(model: PreTrainedModel, kwargs: dict) -> GenerationConfig:
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
    return config


def _capacity(prompt: torch.Tensor | None, config: GenerationConfig, cache: OscarCache) -> int:
    """Tokens the cache must hold: the prompt (or what the cache has) plus every token to generate."""
    prompt_tokens = prompt.shape[-1] if prompt is not None else cache.get_seq_length()
    if config.max_new_tokens is not None:
        return prompt_tokens + config.max_new_tokens + 1
    return max(config.max_length or GenerationConfig().max_length or 20, prompt_tokens) + 1
