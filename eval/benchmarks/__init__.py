"""The GPU benchmarks of ``eval/bench_gpu.py``, one module per benchmark plus the helpers they share.

Benchmarks (each exports ``BENCHMARK``: its run function, its markdown tables, its plot, its defaults):

* :mod:`.kernel`: decode attention of one layer (BF16 SDPA, torch dequantize + SDPA, our kernel).
* :mod:`.e2e`: ``model.generate`` throughput per cache, and a real prefill.
* :mod:`.graph`: decode steps eager vs replayed from a CUDA graph, and a profile of one step.
* :mod:`.memory`: KV bytes, peak memory and the largest batch that fits.
* :mod:`.multigpu`: ``device_map="auto"`` and tensor parallelism (``eval/tp_decode.py``).

Shared helpers: :mod:`.config` (config overrides), :mod:`.cases` (guarded rows, speedups, rounds),
:mod:`.timing` (CUDA-event and CPU timing), :mod:`.models` (random-weight Qwen3 models, rotations),
:mod:`.caches` (building and synthetically filling caches), :mod:`.decoding` (timed decode loops),
:mod:`.report` (markdown tables and plot helpers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "eval" / "results"


@dataclass(frozen=True)
class Benchmark:
    """What ``eval/bench_gpu.py`` needs of a benchmark: rows from a config, their tables and their plot."""

    run: Callable[[dict], list[dict]]
    markdown: Callable[[dict], str]
    plot: Callable[[dict, Path], None]
    defaults: dict
