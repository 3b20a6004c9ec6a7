"""Differences between the transformers versions we support (>=5.17,<6)."""

from __future__ import annotations

import functools
import inspect

import transformers
from packaging.version import Version
from transformers import PreTrainedModel


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword that passes a cache to ``model(...)``/``generate``: ``cache`` on newer 5.x, else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@functools.cache
def positive_crop_keeps_length() -> bool:
    """Whether the installed transformers reads a positive ``crop(n)`` as the length to keep (before 5.18,
    deprecated there) rather than refusing it (5.18 on; a negative ``n`` removes ``-n`` tokens in both)."""
    return Version(transformers.__version__).release < (5, 18)
