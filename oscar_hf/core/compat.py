"""Differences between the transformers versions we support (>=5.17,<6)."""

from __future__ import annotations

import inspect

from transformers import PreTrainedModel


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword that passes a cache to ``model(...)``/``generate``: ``cache`` on newer 5.x, else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
