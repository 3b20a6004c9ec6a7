"""The ``multigpu`` benchmark: ``device_map="auto"`` over 2 GPUs (OscarCache buffers must follow their
layer) and tensor parallelism (``eval.tp_decode`` under torchrun). Skipped, with the reason, on fewer GPUs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from oscar_hf import OscarLayer

from . import REPO, Benchmark
from .caches import synthetic_fill
from .cases import add_speedups, guarded
from .decoding import DECODE_DEFAULTS, decode_case
from .models import DTYPES, attention_device, model_rotations, model_spec, random_tokens, save_random_model
from .report import Column, bars, figure, no_data, table


def tensors_of(
    obj: Any, prefix: str = "", depth: int = 4, seen: set[int] | None = None
) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj``'s attributes, lists and dicts (not relying on a layer's internals)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (list, tuple)):
        for index, item in enumerate(obj):
            yield from tensors_of(item, f"{prefix}[{index}]", depth - 1, seen)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from tensors_of(item, f"{prefix}[{key!r}]", depth - 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        for key, item in vars(obj).items():
            yield from tensors_of(item, f"{prefix}.{key}" if prefix else key, depth - 1, seen)


def placement_check(model: PreTrainedModel) -> Callable[[Any], dict]:
    """An ``inspect`` for :func:`decode_case`: every OscarCache layer tensor must sit on its attention's device."""

    def check(cache) -> dict:
        wrong, devices = [], set()
        for layer_idx, layer in enumerate(cache.layers):
            if not isinstance(layer, OscarLayer):
                continue
            want = attention_device(model, layer_idx)
            devices.add(str(want))
            wrong += [
                f"layer {layer_idx} {name} on {t.device}, attention on {want}"
                for name, t in tensors_of(layer)
                if t.device != want
            ]
        if wrong:
            raise AssertionError(f"{len(wrong)} OscarCache tensors off their layer's device, e.g. {wrong[0]}")
        return {"buffers_on_layer_device": True, "cache_devices": sorted(devices)} if devices else {}

    return check


def device_map_cases(config: dict, gpus: int) -> list[dict]:
    """``from_pretrained(device_map="auto")`` over the GPUs, decoding at a synthetic context per cache."""
    from transformers import AutoModelForCausalLM

    part, dtype = config["device_map"], DTYPES[config["dtype"]]
    name, spec = model_spec(config["model"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="oscar_bench_") as directory:
        save_random_model(spec, Path(directory), "cuda:0", dtype)
        model = AutoModelForCausalLM.from_pretrained(directory, device_map="auto", dtype=dtype).eval()
    devices = sorted({str(p.device) for p in model.parameters()})
    rotations = model_rotations(model, config)
    ids = random_tokens(model, part["batch"], part["context"] + 1)
    fill = synthetic_fill(model, part["batch"], part["context"], part["fill_chunk_rows"])
    for cache_name in tqdm(part["caches"], desc="device_map"):
        row = {
            "part": "device_map",
            "model": name,
            "context": part["context"],
            "batch": part["batch"],
            "cache": cache_name,
            "model_devices": devices,
        }

        def measure() -> dict:
            if len(devices) < gpus:
                raise AssertionError(f"device_map='auto' put the model on {devices} only; expected {gpus} GPUs")
            return decode_case(model, cache_name, fill, ids, part, rotations, inspect=placement_check(model))

        rows.append(guarded(row, measure))
    return rows


def torchrun_command(gpus: int, config_path: Path, out_path: Path) -> list[str]:
    """``torchrun --standalone --nproc_per_node N -m eval.tp_decode`` through this interpreter (run from the
    repository root)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        "-m",
        "eval.tp_decode",
        "--config",
        str(config_path),
        "--out",
        str(out_path),
    ]


def tensor_parallel_cases(config: dict, gpus: int) -> list[dict]:
    """Run eval.tp_decode under torchrun and turn its JSON into rows."""
    part = config["tensor_parallel"]
    with tempfile.TemporaryDirectory(prefix="oscar_tp_") as directory:
        config_path, out_path = Path(directory) / "config.json", Path(directory) / "result.json"
        config_path.write_text(json.dumps({**part, "dtype": config["dtype"], "seed": config["seed"]}))
        process = subprocess.run(
            torchrun_command(gpus, config_path, out_path),
            capture_output=True,
            text=True,
            timeout=part["timeout_s"],
            cwd=REPO,
        )
        if process.returncode != 0:
            raise RuntimeError(f"torchrun exited with {process.returncode}: {process.stderr[-2000:]}")
        result = json.loads(out_path.read_text())
    shared = {k: result[k] for k in ("world_size", "model", "context", "batch", "new_tokens")}
    return [{"part": "tensor_parallel", **shared, **row} for row in result["rows"]]


def part_rows(part: str, cases: Callable[[], list[dict]]) -> list[dict]:
    """The rows of one part, or a single row with its error when the part failed before producing rows."""
    holder = guarded({"part": part}, lambda: {"rows": cases()})
    return holder.pop("rows", None) or [holder]


def bench_multigpu(config: dict) -> list[dict]:
    """The device_map and tensor-parallel rows, or one skipped row each on fewer GPUs than configured."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < config["gpus"]:
        reason = f"needs {config['gpus']} CUDA GPUs, found {gpus}"
        return [{"part": part, "status": "skipped", "reason": reason} for part in ("device_map", "tensor_parallel")]
    rows = part_rows("device_map", lambda: device_map_cases(config, config["gpus"]))
    rows += part_rows("tensor_parallel", lambda: tensor_parallel_cases(config, config["gpus"]))
    add_speedups(rows, ("part",), {"cache": "dynamic"}, {"tokens_per_s": True})
    return rows


MULTIGPU_COLUMNS: list[Column] = [
    ("part", "part", ""),
    ("model", "model", ""),
    ("context", "context", ""),
    ("batch", "batch", ""),
    ("cache", "cache", ""),
    ("tokens/s", "tokens_per_s", ".1f"),
    ("median step ms", "step_ms", ".2f"),
    ("speedup vs Dynamic", "speedup_tokens_per_s", ".2f"),
    ("checks", "checks", ""),
]


def multigpu_markdown(result: dict) -> str:
    """One table of both parts, with each row's checks in one column."""
    names = (
        "buffers_on_layer_device",
        "heads_per_rank_ok",
        "frozen_on_every_rank",
        "identical_across_ranks",
        "matches_single_gpu",
    )
    rows = [{**row, "checks": ", ".join(f"{k}={row[k]}" for k in names if k in row)} for row in result["cases"]]
    return table(rows, MULTIGPU_COLUMNS)


def multigpu_plot(result: dict, path: Path) -> None:
    """Decode tokens/s per part and cache, or the reason nothing ran."""
    rows = [r for r in result["cases"] if r.get("status") == "ok" and r.get("tokens_per_s")]
    fig, axes = figure()
    if rows:
        parts = sorted({r["part"] for r in rows})
        caches = sorted({r["cache"] for r in rows})
        values = {(r["part"], r["cache"]): r["tokens_per_s"] for r in rows}
        bars(axes[0][0], parts, {c: [values.get((p, c)) for p in parts] for c in caches}, "decode tokens/s")
    else:
        reasons = sorted({r.get("reason") or r.get("error") or "" for r in result["cases"]})
        no_data(axes[0][0], "skipped: " + "; ".join(reasons))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


DEFAULTS = {
    "dtype": "bfloat16",
    "seed": 0,
    "gpus": 2,
    "model": "qwen3-4b",
    "device_map": {"context": 32768, "batch": 1, "caches": ["dynamic", "oscar-int2"], **DECODE_DEFAULTS},
    "tensor_parallel": {
        "model": "qwen3-4b",
        "context": 8192,
        "batch": 1,
        "new_tokens": 32,
        "caches": ["dynamic", "oscar-int2"],
        "repeats": 3,
        "warmup_steps": 3,
        "steps": 16,
        "single_gpu_reference": True,
        "timeout_s": 420,
    },
}
BENCHMARK = Benchmark(bench_multigpu, multigpu_markdown, multigpu_plot, DEFAULTS)
