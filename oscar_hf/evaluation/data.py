"""Where local evaluation data lives. Files are read in place and never copied into the repository."""

from __future__ import annotations

import os
from pathlib import Path

from oscar_hf.provenance import DATA_DIR_ENV

WIKITEXT2_TEST = "wikitext2_raw/wiki.test.raw"


def data_dir() -> Path | None:
    """``$OSCAR_HF_DATA_DIR`` if it names a folder, else ``None`` (commands then ask for ``--data-dir``)."""
    candidate = os.environ.get(DATA_DIR_ENV)
    if not candidate:
        return None
    path = Path(candidate).expanduser()
    return path if path.is_dir() else None
