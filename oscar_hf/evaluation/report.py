"""Report writing shared by the evaluations: each result is a JSON file, a markdown table and a plot
beside each other, headed by its provenance (:mod:`oscar_hf.provenance`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def tokens_label(count: int) -> str:
    """``4096`` -> ``4K``; counts that are no whole multiple of 1024 stay as they are."""
    return f"{count // 1024}K" if count >= 1024 and count % 1024 == 0 else str(count)


def write_outputs(result: dict, stem: Path, markdown: str, plot: Callable[[dict, Path], None]) -> list[Path]:
    """``stem``.json, ``stem``.md and ``stem``.png of an evaluation (``stem`` may end in .json; parents are created)."""
    stem = Path(stem)
    if stem.suffix in (".json", ".md", ".png"):
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ext) for ext in (".json", ".md", ".png")]
    paths[0].write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    paths[1].write_text(markdown)
    plot(result, paths[2])
    return paths
