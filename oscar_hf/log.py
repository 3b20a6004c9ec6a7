"""The library logger: everything logs under ``oscar_hf`` and stays silent unless the user configures logging."""

from __future__ import annotations

import logging

_ROOT = logging.getLogger("oscar_hf")
_ROOT.addHandler(logging.NullHandler())
_already_said: set[tuple[str, str]] = set()


def get_logger(name: str) -> logging.Logger:
    """Return a child of the ``oscar_hf`` logger."""
    return logging.getLogger(name)


def warning_once(logger: logging.Logger, message: str) -> None:
    """Log ``message`` as a warning the first time it is seen for ``logger``."""
    key = (logger.name, message)
    if key not in _already_said:
        _already_said.add(key)
        logger.warning(message)
