"""lm-evaluation-harness model ``oscar``: Hugging Face's ``HFLM`` with an OscarCache in every call.

Importing this module registers the model under the name ``"oscar"``. The stock command line finds
it without any import, through the installed ``oscar_hf_lm_eval.pth`` (see
:mod:`oscar_hf.evaluation.lm_eval_plugin`)::

    lm_eval --model oscar --model_args pretrained=default,method=oscar-int2 --tasks gsm8k --limit 2

Offline, write the local-data tasks first (``oscar-hf lm-eval-tasks --data-dir D --out T``) and add
``--include_path T --tasks oscar_gsm8k``.

Model arguments (besides HFLM's: ``batch_size``, ``max_length``, ``max_gen_toks``, ...):

- ``pretrained``: a hub id, a local directory, ``default`` (SmolLM2-135M-Instruct, through
  :func:`oscar_hf.core.models.load_model`) or an already loaded model (with ``tokenizer=``).
- ``method``: one of :data:`oscar_hf.config.METHODS`.
- ``rotations``: a rotations directory (default: the bundled ones for the default model).
- ``sink``, ``recent``: the BF16 windows (64 and 256, as in the paper).
- ``think_end_token``: e.g. ``</think>`` (or a token id): stop strings only fire on the text after
  it, both while generating and when the answer is cut.
- ``max_gen_toks``: a cap on generated tokens, applied even where a task asks for more (AIME asks
  for 32,768).
- ``loglikelihood``: ``teacher-forced`` (default) or ``prefill``; see :meth:`OscarLM._model_call`.

Every ``generate`` call gets a fresh :class:`~oscar_hf.core.cache.OscarCache` (a filled cache means
"continue from here" and would silently cut the next prompt), passed under
:func:`oscar_hf.core.compat.cache_keyword`.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.models.utils_hf import stop_sequences_criteria

from oscar_hf.calibration.teacher_forcing import teacher_forced_logits
from oscar_hf.config import METHODS
from oscar_hf.core.cache import OscarCache
from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.models import DTYPES, load_model
from oscar_hf.log import get_logger
from oscar_hf.rotations.resolve import resolve_rotations
from oscar_hf.rotations.rotation_set import RotationSet

logger = get_logger(__name__)

LOGLIKELIHOOD_MODES = ("teacher-forced", "prefill")


class StopAfterThinking(transformers.StoppingCriteria):
    """Per-row stop strings that only count in the text after the last ``think_end`` marker.

    ``think_end`` is a string (``"</think>"``) or a token id. Rows stop independently (the returned
    bool tensor is per row); text inside the reasoning never stops a row.
    """

    def __init__(self, tokenizer, stops: list[str], think_end: str | int, prompt_length: int, batch_size: int):
        self.tokenizer, self.stops, self.think_end = tokenizer, [s for s in stops if s], think_end
        self.prompt_length = prompt_length
        longest = max([len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stops] + [1])
        self.lookback = longest + 2
        marker = think_end if isinstance(think_end, str) else tokenizer.decode([think_end])
        self.marker_lookback = len(tokenizer.encode(marker, add_special_tokens=False)) + 2
        self.answer_start: list[int | None] = [None] * batch_size  # generated-token index after the marker
        self.done = [False] * batch_size

    def _found_marker(self, row: torch.Tensor) -> bool:
        if isinstance(self.think_end, int):
            return int(row[-1]) == self.think_end
        return self.think_end in self.tokenizer.decode(row[-self.marker_lookback :])

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_length :]
        for i in range(generated.shape[0]):
            if self.done[i] or generated.shape[1] == 0:
                continue
            row = generated[i]
            if self._found_marker(row):  # a new (later) marker restarts the answer
                self.answer_start[i] = max(0, row.shape[0] - self.marker_lookback)
                continue
            if self.answer_start[i] is None:
                continue
            start = max(self.answer_start[i], row.shape[0] - self.lookback - self.marker_lookback)
            text = self.tokenizer.decode(row[start:])
            if isinstance(self.think_end, str):
                text = text.split(self.think_end)[-1]
            self.done[i] = any(stop in text for stop in self.stops)
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)


@register_model("oscar")
class OscarLM(HFLM):
    """``HFLM`` whose every generate/forward call runs through a fresh OscarCache of ``method``."""

    def __init__(
        self,
        pretrained: str | transformers.PreTrainedModel = "default",
        method: str = "oscar-int2",
        rotations: RotationSet | str | None = None,
        sink: int = 64,
        recent: int = 256,
        think_end_token: str | int | None = None,
        max_gen_toks: int | None = None,
        loglikelihood: str = "teacher-forced",
        tokenizer: Any = None,
        dtype: str | torch.dtype | None = "auto",
        device: str | None = None,
        **kwargs,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {sorted(METHODS)}")
        if loglikelihood not in LOGLIKELIHOOD_MODES:
            raise ValueError(f"loglikelihood must be one of {LOGLIKELIHOOD_MODES}, not {loglikelihood!r}")
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's command line says "cuda" unless told otherwise
        if isinstance(pretrained, str):
            torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
            pretrained, loaded_tokenizer = load_model(pretrained, dtype=torch_dtype, device=device)
            tokenizer = tokenizer or loaded_tokenizer
        elif tokenizer is None:
            raise ValueError("pass tokenizer= together with an already loaded model")
        if pretrained.config._attn_implementation != "oscar":
            logger.warning(
                "the model runs attn_implementation=%r, not 'oscar'; OscarCache then hands it dequantized copies",
                pretrained.config._attn_implementation,
            )
        if isinstance(think_end_token, str) and think_end_token.isdigit():
            think_end_token = int(think_end_token)
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, think_end_token=think_end_token, **kwargs)
        self.method, self.sink, self.recent = method, int(sink), int(recent)
        self.loglikelihood_mode = loglikelihood
        self.gen_cap = int(max_gen_toks) if max_gen_toks else None
        self.rotations = self._resolve_rotations(rotations)
        self.caches_created = 0
        logger.info(
            "lm-eval model 'oscar': method=%s sink=%d recent=%d keyword=%s",
            method,
            self.sink,
            self.recent,
            cache_keyword(self.model),
        )

    def _resolve_rotations(self, rotations: RotationSet | str | None) -> RotationSet | None:
        """None for methods without calibrated rotations; else ``rotations`` (a set, a directory or a hub
        id) or the set bundled for this model, checked against it (:func:`oscar_hf.rotations.resolve.resolve_rotations`)."""
        if METHODS[self.method].rotation != "calibrated":
            return None
        return resolve_rotations(self.model, rotations if rotations is not None else "default", method=self.method)

    # ---------------------------------------------------------------------------------- caches
    def new_cache(self) -> OscarCache:
        """A fresh, empty cache for one call."""
        self.caches_created += 1
        return OscarCache(self.model, self.method, rotations=self.rotations, sink=self.sink, recent=self.recent)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        do_sample = generation_kwargs.get("do_sample")
        if generation_kwargs["temperature"] == 0.0 and do_sample is None:
            generation_kwargs["do_sample"] = do_sample = False
        if do_sample is False and generation_kwargs["temperature"] == 0.0:
            generation_kwargs.pop("temperature", None)
            generation_kwargs.pop("top_p", None)
        if self.think_end_token is None:
            criteria = stop_sequences_criteria(self.tokenizer, stop, context.shape[1], context.shape[0])
        else:
            criteria = transformers.StoppingCriteriaList(
                [StopAfterThinking(self.tokenizer, stop, self.think_end_token, context.shape[1], context.shape[0])]
            )
        generation_kwargs[cache_keyword(self.model)] = self.new_cache()
        mixed = getattr(self, "mixed_precision_dtype", None)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=mixed, enabled=mixed is not None):
            return self.model.generate(
                input_ids=context,
                max_length=max_length,
                stopping_criteria=criteria,
                pad_token_id=self.tokenizer.pad_token_id,
                use_cache=True,
                **generation_kwargs,
            )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if self.gen_cap:
            for request in requests:
                context, gen_kwargs = request.arguments[0], request.arguments[1]
                kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
                if kwargs["max_gen_toks"] > self.gen_cap:
                    kwargs["max_gen_toks"] = self.gen_cap
                request.arguments = (context, kwargs, *request.arguments[2:])
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits for loglikelihood requests, with a fresh OscarCache per forward.

        ``teacher-forced`` (default): the logits that decoding the sequence token by token with this
        method's cache gives (token j is seen quantized by query i iff it sat in the INT2 history
        when i was decoded; :func:`oscar_hf.calibration.teacher_forcing.teacher_forced_logits`). ``prefill``:
        one forward into a fresh cache; a prompt attends to its own unquantized K/V, so these
        logits equal BF16's by design and only the cache's contents are quantized.
        lm-eval pads loglikelihood batches on the right, which keeps every real token's positions.
        """
        if attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with torch.no_grad():
            cache = self.new_cache()
            if self.loglikelihood_mode == "teacher-forced" and cache.oscar_config.quantized:
                return teacher_forced_logits(self.model, inps, cache)
            return self.model(inps, **{cache_keyword(self.model): cache}, use_cache=True).logits

    @property
    def max_gen_toks(self) -> int:
        return self.gen_cap or 256  # HFLM's default when a task sets none

    def get_model_info(self) -> dict:
        # HFLM's asks the hub for the model's commit; this one stays offline.
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "model_name": getattr(self.model.config, "_name_or_path", None),
            "oscar_method": self.method,
            "oscar_sink": self.sink,
            "oscar_recent": self.recent,
        }
