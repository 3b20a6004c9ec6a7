"""Evaluation and benchmarks of oscar-hf, outside the installed package: run each script as a module
from the repository root (``python -m eval.bench_gpu ...``), with oscar-hf installed."""
