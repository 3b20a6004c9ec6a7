"""GPU benchmark suite: one config-driven script, one JSON config per benchmark.

    python -m eval.bench_gpu --config eval/configs/bench_kernel.json [--out eval/results] [--set KEY=JSON ...]

The config's ``benchmark`` field picks what runs (``--set decode.repeats=5`` overrides a field):

* ``kernel``: decode attention of one layer at the Qwen3-8B attention shape: BF16 SDPA, the
  reference's path (torch dequantize + concatenate + SDPA) and our split-K Triton kernel; eager and
  CUDA-graph-replayed time, bytes read and bandwidth, speedup vs SDPA, kernel vs torch reference.
* ``e2e``: ``model.generate`` on random-weight Qwen3-4B/8B shapes over a synthetically filled cache
  (DynamicCache, StaticCache, OscarCache), plus a real 32K prefill (the quantize-on-write cost).
* ``memory``: KV bytes and peak memory at 128K, then the largest batch at 100K, predicted from the
  measured caches and verified by running it, and the decode throughput there.
* ``graph``: per-step decode time of eager DynamicCache, StaticCache under transformers'
  compiled generate, eager OscarCache and OscarCache with its step captured in a CUDA graph
  (``oscar_hf.StaticDecoder``), each beside its memory roofline; ``oscar_hf.generate`` tokens/s; and a
  profiler summary of one captured step.
* ``multigpu``: ``device_map="auto"`` over 2 GPUs (OscarCache buffers must follow their layer) and
  tensor parallelism (``eval/tp_decode.py`` under torchrun). Skipped, with the reason, on fewer GPUs.

Each run writes ``<out>/<name>.json``, ``.md`` (tables) and ``.png`` with the command, the machine and
the UTC date, and prints the tables. Runs of one benchmark split to fit a time limit (one a batch, say)
become one result with ``--merge PART.json ... --name NAME``, each run's provenance kept. Every case
is guarded: an OOM or error is recorded in its row and the run goes on. Timing is a median after
warm-up, with CUDA events on a GPU (``triton.testing.do_bench``; ``do_bench_cudagraph`` for
graph-replayed kernels) and ``time.perf_counter`` on CPU, which only the smoke test
(tests/test_bench_gpu.py) uses. Baselines run in the same process, on the same inputs' shapes.

This script is the harness (config, result files, command line); each benchmark lives in its module
under ``eval/benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eval.benchmarks import RESULTS, e2e, graph, kernel, memory, multigpu
from eval.benchmarks.config import apply_sets, deep_merge, union_configs
from oscar_hf.provenance import command_line, provenance, provenance_line

BENCHMARKS = {
    "kernel": kernel.BENCHMARK,
    "e2e": e2e.BENCHMARK,
    "memory": memory.BENCHMARK,
    "graph": graph.BENCHMARK,
    "multigpu": multigpu.BENCHMARK,
}


def resolve_config(config: dict) -> dict:
    """The config over its benchmark's defaults."""
    if config.get("benchmark") not in BENCHMARKS:
        raise ValueError(f"config 'benchmark' must be one of {sorted(BENCHMARKS)}, got {config.get('benchmark')!r}")
    return deep_merge(BENCHMARKS[config["benchmark"]].defaults, config)


def run_benchmark(config: dict, out_dir: Path, name: str, command: str) -> dict:
    """Run one benchmark and write ``<out_dir>/<name>.json``, ``.md`` and ``.png``; returns the result."""
    config = resolve_config(config)
    bench = BENCHMARKS[config["benchmark"]]
    started = time.perf_counter()
    torch.manual_seed(config.get("seed", 0))
    with torch.no_grad():
        cases = bench.run(config)
    result = {
        "name": name,
        "benchmark": config["benchmark"],
        "description": config.get("description", ""),
        **provenance(command),
        "seconds": round(time.perf_counter() - started, 1),
        "config": config,
        "cases": cases,
    }
    write_result(result, out_dir)
    return result


# The settings that name a case in the benchmarks' rows (a merge keeps the latest run's case of each name).
CASE_KEYS = ("part", "model", "context", "batch", "cache", "method", "kernel", "shape", "head_dim", "k_bits", "v_bits")


def merge_runs(parts: list[dict], name: str) -> dict:
    """One result from several runs of one benchmark: their cases in order, each marked with the settings
    its run differs in (e.g. ``k_bits``), a later run's case replacing an earlier one of the same
    :data:`CASE_KEYS` (a rerun), a config whose lists hold every run's values, and each run's command,
    machine, date, time and config under ``runs`` (a part that is itself a merge brings its runs). A
    setting that one run's config lacks (added to the benchmark after that run) marks its cases with
    ``None``."""
    if len({part["benchmark"] for part in parts}) != 1:
        raise ValueError(f"--merge takes runs of one benchmark, got {sorted({p['benchmark'] for p in parts})}")
    runs = [
        run
        for part in parts
        for run in part.get("runs") or [{key: part[key] for key in ("command", "machine", "date", "seconds", "config")}]
    ]
    configs = [part["config"] for part in parts]
    settings = [_scalar_settings(config) for config in configs]
    keys = dict.fromkeys(key for setting in settings for key in setting)
    differing = [key for key in keys if len({repr(setting.get(key)) for setting in settings}) > 1]
    cases: dict[tuple, dict] = {}
    for part, setting in zip(parts, settings):
        for case in part["cases"]:
            case = {**{key: setting.get(key) for key in differing}, **case}
            cases[tuple(repr(case.get(key)) for key in (*CASE_KEYS, *differing))] = case
    return {
        **{key: value for key, value in parts[0].items() if key not in ("name", "cases", "runs")},
        "name": name,
        "seconds": round(sum(part["seconds"] for part in parts), 1),
        "config": union_configs(configs),
        "cases": list(cases.values()),
        "runs": runs,
    }


def _scalar_settings(config: dict) -> dict:
    """A run's scalar settings: the config's own and those one level down, by their own names (the kernel
    shape's ``head_dim``); lists (the runs' axes) and the description are left out."""
    settings = {}
    for key, value in config.items():
        if isinstance(value, dict):
            settings.update({name: inner for name, inner in value.items() if not isinstance(inner, (dict, list))})
        elif key != "description" and not isinstance(value, list):
            settings[key] = value
    return settings


def write_result(result: dict, out_dir: Path) -> None:
    """``<out_dir>/<name>.json``, ``.md`` and ``.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / result["name"]
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, ensure_ascii=False, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    BENCHMARKS[result["benchmark"]].plot(result, stem.with_suffix(".png"))


def markdown(result: dict) -> str:
    body = BENCHMARKS[result["benchmark"]].markdown(result)
    runs = result.get("runs", [result])
    footer = "\n\n".join(f"{provenance_line(run)} ({run['seconds']} s)." for run in runs)
    description = f"{result['description']}\n\n" if result["description"] else ""
    return f"# {result['name']}\n\n{description}{body}\n\n{footer}\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path)
    source.add_argument(
        "--merge", type=Path, nargs="+", metavar="PART", help="result JSON files to merge (with --name)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", help="output file name (default: the config's name, else its file stem)")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override a config field, e.g. --set batches=[1] --set decode.repeats=5",
    )
    args = parser.parse_args(argv)
    if args.merge:
        if not args.name:
            parser.error("--merge needs --name")
        result = merge_runs([json.loads(path.read_text()) for path in args.merge], args.name)
        write_result(result, args.out)
        print(markdown(result))
        return result
    config = apply_sets(json.loads(args.config.read_text()), args.sets)
    command = command_line("python -m eval.bench_gpu", argv)
    result = run_benchmark(config, args.out, args.name or config.get("name") or args.config.stem, command)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
