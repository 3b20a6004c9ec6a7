"""GPU benchmark suite (issue 4): one config-driven script, one JSON config per benchmark.

    python eval/bench_gpu.py --config eval/configs/bench_kernel.json [--out eval/results] [--set KEY=JSON ...]

The config's ``benchmark`` field picks what runs (``--set decode.repeats=5`` overrides a field):

* ``kernel``: decode attention of one layer at the Qwen3-8B attention shape: BF16 SDPA, the
  reference's path (torch dequantize + concatenate + SDPA) and our split-K Triton kernel; eager and
  CUDA-graph-replayed time, bytes read and bandwidth, speedup vs SDPA, kernel vs torch reference.
* ``e2e``: ``model.generate`` on random-weight Qwen3-4B/8B shapes over a synthetically filled cache
  (DynamicCache, StaticCache, OscarCache), plus a real 32K prefill (the quantize-on-write cost).
* ``memory``: KV bytes and peak memory at 128K, then the largest batch at 100K, predicted from the
  measured caches and verified by running it, and the decode throughput there.
* ``graph`` (issue 7): per-step decode time of eager DynamicCache, StaticCache under transformers'
  compiled generate, eager OscarCache and OscarCache with its step captured in a CUDA graph
  (``oscar_hf.StaticDecoder``), each beside its memory roofline; ``oscar_hf.generate`` tokens/s; and a
  profiler summary of one captured step.
* ``multigpu``: ``device_map="auto"`` over 2 GPUs (OscarCache buffers must follow their layer) and
  tensor parallelism (``eval/tp_decode.py`` under torchrun). Skipped, with the reason, on fewer GPUs.

Each run writes ``<out>/<name>.json``, ``.md`` (tables) and ``.png`` with the command, the machine and
the UTC date, and prints the tables. Every case is guarded: an OOM or error is recorded in its row
and the run goes on. Timing is a median after warm-up, with CUDA events on a GPU
(``triton.testing.do_bench``; ``do_bench_cudagraph`` for graph-replayed kernels) and
``time.perf_counter`` on CPU, which only the smoke test (tests/test_bench_gpu.py) uses. Baselines run
in the same process, on the same inputs' shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import importlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # measure this checkout even when another oscar-hf is installed

from transformers import DynamicCache, PreTrainedModel, Qwen3Config, StaticCache  # noqa: E402

import oscar_hf  # noqa: E402
from oscar_hf import OscarCache, OscarLayer, RotationSet, StaticDecoder  # noqa: E402
from oscar_hf.rotations.absorption import absorb_value_rotations  # noqa: E402
from oscar_hf.core.cache import ABSORBED_ATTRIBUTE  # noqa: E402
from oscar_hf.core.compat import cache_keyword  # noqa: E402
from oscar_hf.provenance import provenance, provenance_line  # noqa: E402
from oscar_hf.quant import QuantizedRows, dequantize, quantize  # noqa: E402
from oscar_hf.core.storage import RowBuffer  # noqa: E402

RESULTS = REPO / "eval" / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BF16_CACHES = ("dynamic", "static")  # transformers' own caches; any other name is an OscarCache method
# "<method>+absorbed": that OscarCache method on the model with R_V folded into v_proj/o_proj.
ABSORBED_SUFFIX = "+absorbed"
# "<method>+eager-layout": OscarCache(decode_graphs=False): plain generate launches every kernel from
# Python (the default freezes the cache on CUDA and replays each layer's attention from a CUDA graph);
# "<method>+frozen": decode_graphs=True, which freezes on CPU too (without graphs), for CPU smoke tests.
DECODE_GRAPHS_SUFFIXES = {"+eager-layout": False, "+frozen": True}
# "<cache>+graph": its decode steps replayed from a CUDA graph (OscarCache: oscar_hf.StaticDecoder);
# "<cache>+graph+compile": with the decoder layers compiled inside the captured step;
# "<cache>+graph+autotune": compiled with mode "max-autotune-no-cudagraphs" (Inductor times its GEMMs);
# a last "+fused": with StaticDecoder(fuse_projections=True) (stacked q/k/v and gate/up GEMMs).
GRAPH_SUFFIX = "+graph"
COMPILE_SUFFIXES = {"+compile": True, "+autotune": "max-autotune-no-cudagraphs"}
FUSED_SUFFIX = "+fused"

# Qwen3 shapes from the models' config.json, with room for 128K positions (weights are random).
MODEL_PRESETS: dict[str, dict] = {
    "qwen3-4b": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=135168,
    ),
    "qwen3-8b": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=135168,
    ),
}  # fmt: skip

# ------------------------------------------------------------------------------------ plumbing


def deep_merge(base: dict, override: dict) -> dict:
    """``base`` with ``override`` applied key by key (nested dicts merged, everything else replaced)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_sets(config: dict, assignments: Iterable[str]) -> dict:
    """Apply ``--set a.b=JSON`` overrides (a value that is not JSON is taken as a string)."""
    config = copy.deepcopy(config)
    for assignment in assignments:
        path, _, raw = assignment.partition("=")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return config


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:500]


def guarded(case: dict, measure: Callable[[], dict]) -> dict:
    """Merge ``measure()`` into ``case``; an OOM or any error becomes the row's status, and the run goes on.

    ``measure`` may itself return ``{"status": "skipped", "reason": ...}``.
    """
    try:
        case.update(measure())
        case.setdefault("status", "ok")
    except torch.OutOfMemoryError as error:
        case.update(status="oom", error=_first_line(error))
    except Exception as error:  # noqa: BLE001 - one failing case must not end the benchmark
        case.update(status="error", error=f"{type(error).__name__}: {_first_line(error)}")
        tqdm.write(traceback.format_exc(), file=sys.stderr)
    # The exception (and the frames holding the case's tensors) is gone here, so memory can be returned.
    free_memory()
    return case


def synchronize(devices: Iterable[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def model_devices(model: PreTrainedModel) -> list[torch.device]:
    """Every device holding the model's weights (one, or several with ``device_map``)."""
    return sorted({p.device for p in model.parameters()}, key=str)


def elapsed_ms(fn: Callable[[], Any], devices: list[torch.device]) -> float:
    """Time of one call of ``fn``: CUDA events on a GPU, ``time.perf_counter`` on CPU.

    All ``devices`` are synchronised before and after, since a model spread over GPUs finishes on
    the last one; only those, so that a torchrun process never touches another rank's GPU.
    """
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    synchronize(cuda)
    stream = torch.cuda.current_stream(cuda[0])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    synchronize(cuda)
    return start.elapsed_time(end)


def cpu_median_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn, [torch.device("cpu")]) for _ in range(repeats))


def cycling(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    """Call ``fns`` in turn, so that a CUDA graph of unrolled calls reads distinct input copies (cold L2)."""
    calls = iter(range(sys.maxsize))
    return lambda: fns[next(calls) % len(fns)]()


def kernel_times(fns: list[Callable[[], Any]], device: torch.device, timing: dict) -> dict:
    """Median eager and graph-replayed times in microseconds; ``fns`` are one call on distinct input copies.

    Eager: ``triton.testing.do_bench`` (L2 flushed before each call, launch overhead included).
    Graph: ``do_bench_cudagraph`` over calls that cycle through the copies, so that no call finds
    its inputs in L2 from the previous one. On CPU (smoke test): ``perf_counter`` medians, no graph.
    """
    if device.type != "cuda":
        return {"eager_us": 1e3 * cpu_median_ms(fns[0], timing["cpu_warmup"], timing["cpu_repeats"]), "graph_us": None}
    from triton.testing import do_bench, do_bench_cudagraph

    eager = do_bench(fns[0], warmup=timing["warmup_ms"], rep=timing["rep_ms"], return_mode="median")
    times = {"eager_us": 1e3 * eager, "graph_us": None}
    try:
        times["graph_us"] = 1e3 * do_bench_cudagraph(cycling(fns), rep=timing["graph_rep_ms"], return_mode="median")
    except Exception as error:  # noqa: BLE001 - an uncapturable (or out of memory) call keeps its eager time
        times["graph_error"] = f"{type(error).__name__}: {_first_line(error)}"
    return times


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ------------------------------------------------------------------------------ models and caches


def model_spec(entry: str | dict) -> tuple[str, dict]:
    """``(name, Qwen3Config kwargs)`` from a preset name or a dict (``{"preset": ..., **overrides}``)."""
    if isinstance(entry, str):
        return entry, dict(MODEL_PRESETS[entry])
    entry = dict(entry)
    preset = entry.pop("preset", None)
    name = entry.pop("name", preset or "custom")
    return name, {**MODEL_PRESETS.get(preset, {}), **entry}


def add_model_arguments(parser) -> None:
    """``--model`` (a preset or a JSON object), ``--device``, ``--context``, ``--batch``, ``--out``: the
    options of the single-model diagnostics (``kernels/tools/profile_decode.py``, ``kernels/tools/host_time.py``)."""
    parser.add_argument("--model", default="qwen3-8b", type=lambda text: model_spec(json.loads(text) if
                        text.startswith("{") else text), help="a preset of eval/bench_gpu.py or a JSON object")  # fmt: skip
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("eval/results"))


def build_model(spec: dict, device: str | torch.device, dtype: torch.dtype, attn: str = "sdpa") -> PreTrainedModel:
    """A random-weight Qwen3 (normal, std 0.02) initialised directly on ``device`` in ``dtype``.

    Initialising billions of weights on the CPU takes minutes; on the GPU it takes seconds, and the
    speed of a forward pass does not depend on the values.
    """
    from transformers import Qwen3ForCausalLM

    config = Qwen3Config(**{"use_sliding_window": False, "pad_token_id": 0, **spec})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    model.set_attn_implementation(attn)
    return model


def text_config(model: PreTrainedModel):
    return model.config.get_text_config(decoder=True)


def head_dim(model: PreTrainedModel) -> int:
    text = text_config(model)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def full_attention_layers(model: PreTrainedModel) -> list[int]:
    text = text_config(model)
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return [i for i, kind in enumerate(types) if kind == "full_attention"]


def attention_device(model: PreTrainedModel, layer_idx: int) -> torch.device:
    """Where layer ``layer_idx``'s attention runs (with ``device_map`` layers live on different GPUs)."""
    return model.get_decoder().layers[layer_idx].self_attn.k_proj.weight.device


def input_device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


def random_rotations(head_dim: int, layer_ids: list[int], seed: int = 0, kv_heads: int | None = None) -> RotationSet:
    """A random orthogonal R_K and R_V per layer (QR of a Gaussian matrix), standing in for calibrated ones;
    with ``kv_heads``, one per KV head (``[kv_heads, D, D]``).

    Speed does not depend on which orthogonal matrix it is, and ``oscar-int2`` with rotations runs
    exactly the code a calibrated model runs (rotate, clip at 0.96/0.92, quantize).
    """
    generator = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()

    def orthogonal() -> torch.Tensor:
        return one() if kv_heads is None else torch.stack([one() for _ in range(kv_heads)])

    return RotationSet(head_dim, {i: orthogonal() for i in layer_ids}, {i: orthogonal() for i in layer_ids},
                       "random orthogonal (benchmark)")  # fmt: skip


def model_rotations(model: PreTrainedModel, config: dict) -> RotationSet:
    """The benchmark's rotations for ``model``: one per KV head when ``config["rotations"]`` is ``"per_kv_head"``."""
    kind = config.get("rotations", "per_kv_head")
    if kind not in ("per_kv_head", "per_layer"):
        raise ValueError(f"rotations must be 'per_kv_head' or 'per_layer', got {kind!r}")
    kv_heads = text_config(model).num_key_value_heads if kind == "per_kv_head" else None
    return random_rotations(head_dim(model), full_attention_layers(model), config["seed"], kv_heads)


def attention_for(cache_name: str) -> str:
    return "sdpa" if cache_name in BF16_CACHES else "oscar"


def make_cache(cache_name: str, model: PreTrainedModel, max_len: int, rotations: RotationSet | None,
               preallocate: bool = False):  # fmt: skip
    """``dynamic`` / ``static`` (transformers, BF16) or an OscarCache method (``oscar-int2``, ``quarot-int2``...).

    ``preallocate``: an OscarCache allocates its history for ``max_len`` tokens at once (static decoding).
    """
    if cache_name == "dynamic":
        return DynamicCache(config=model.config)
    if cache_name == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    method, decode_graphs = cache_name, None
    for suffix, value in DECODE_GRAPHS_SUFFIXES.items():
        if cache_name.endswith(suffix):
            method, decode_graphs = cache_name.removesuffix(suffix), value
    return OscarCache(model, method, rotations=rotations, max_cache_len=max_len if preallocate else None,
                      decode_graphs=decode_graphs)


@contextlib.contextmanager
def model_for(model: PreTrainedModel, cache_name: str, rotations: RotationSet | None):
    """Yield the cache method to run; for ``<method>+absorbed`` with R_V folded into the model meanwhile.

    The folded projections are restored afterwards (from a copy of their weights, not by un-folding,
    which would round twice), so the other cases of the run see the original model.
    """
    if not cache_name.endswith(ABSORBED_SUFFIX):
        yield cache_name
        return
    names = (".v_proj.", ".o_proj.")
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if any(k in n for k in names)}
    absorb_value_rotations(model, rotations)
    try:
        yield cache_name.removesuffix(ABSORBED_SUFFIX)
    finally:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name in saved:
                    parameter.copy_(saved[name])
        delattr(text_config(model), ABSORBED_ATTRIBUTE)


def write_chunk(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Store post-RoPE K/V rows as a forward pass would: OscarCache through its real write path."""
    layer = cache.layers[layer_idx]
    if isinstance(layer, OscarLayer):
        # rotate, place in sink / history / recent window, quantize the history rows exactly once
        layer.stash(keys, values)
        new_keys, new_values, plan = layer.begin_step(None)
        layer.finish_step(*layer.rotate_chunk(new_keys, new_values), plan)
    else:
        # transformers 5.17's StaticLayer indexes by cache_position; newer layers count for themselves
        positions = torch.arange(start, start + keys.shape[2], device=keys.device)
        cache.update(keys, values, layer_idx, {"cache_position": positions})


def fill_cache(cache, model: PreTrainedModel, batch: int, context: int, chunk_rows: int) -> None:
    """Fill every layer with ``context`` random K/V tokens, layer by layer, in chunks of ``chunk_rows / batch``.

    Stands in for a long prefill, which would dominate a decode benchmark's wall time; the cache
    ends in the state a prefill leaves (OscarCache: sink, packed history, recent window).
    """
    text = text_config(model)
    chunk = max(1, chunk_rows // batch)
    for layer_idx in range(len(cache.layers)):
        device = attention_device(model, layer_idx)
        for start in range(0, context, chunk):
            shape = (batch, text.num_key_value_heads, min(chunk, context - start), head_dim(model))
            keys = torch.randn(shape, device=device, dtype=model.dtype)
            write_chunk(cache, layer_idx, keys, torch.randn_like(keys), start)


def kv_bytes(cache) -> int:
    """Stored K/V bytes: OscarCache's own report (codes, metadata, windows); for BF16 caches their tensors."""
    if isinstance(cache, OscarCache):
        return cache.memory_report().total_bytes
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def generate(model: PreTrainedModel, cache, input_ids: torch.Tensor, new_tokens: int, runner: Callable | None = None,
             **options) -> torch.Tensor:  # fmt: skip
    """Greedy decoding of exactly ``new_tokens``; a filled cache makes generate run only the uncached tokens.

    ``runner`` is ``model.generate`` by default (or e.g. ``oscar_hf.generate`` bound to the model);
    ``options`` go to it. ``disable_compile`` defaults to True: generate would otherwise compile the
    forward for StaticCache on its own, and every cache must be timed running the same (eager) code
    unless a case asks for compilation.
    """
    options.setdefault("disable_compile", True)
    with torch.no_grad():
        return (runner or model.generate)(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, **{cache_keyword(model): cache}, **options,
        )  # fmt: skip


def generate_ms(model: PreTrainedModel, cache, input_ids: torch.Tensor, new_tokens: int, **options) -> float:
    """Time of one :func:`generate` call (options as there)."""
    return elapsed_ms(functools.partial(generate, model, cache, input_ids, new_tokens, **options), model_devices(model))


def decode_steps(model: PreTrainedModel, cache, batch: int, warmup: int, steps: int) -> list[float]:
    """Times (ms) of ``steps`` single-token forward passes after ``warmup``, each synchronised.

    Each step gets the all-ones attention mask ``generate`` passes, so both take the same attention
    path. Measured without it (H200): the BF16 steps ran cuDNN attention at ~1 ms of host time per
    layer and this loop was twice as slow as ``generate`` for DynamicCache; that the mask alone
    explains it is still to be checked on the device.
    """
    device, devices = input_device(model), model_devices(model)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []

    def step() -> None:
        nonlocal token
        mask = torch.ones(batch, cache.get_seq_length() + 1, dtype=torch.long, device=device)
        logits = model(token, attention_mask=mask, **{cache_keyword(model): cache}, use_cache=True,
                       logits_to_keep=1).logits  # fmt: skip
        token = logits[:, -1:].argmax(-1).to(device)

    with torch.no_grad():
        for index in range(warmup + steps):
            ms = elapsed_ms(step, devices)
            if index >= warmup:
                times.append(ms)
    return times


def roofline(model: PreTrainedModel, cache_bytes: int, step_ms: float, bandwidth: float | None) -> dict:
    """A decode step's memory roofline: every weight and the whole KV cache read once at ``bandwidth``.

    All parameters count, as in the issue's figures (16.4 GB for Qwen3-8B), though a step gathers
    only a few rows of an untied input embedding. Empty without a configured bandwidth.
    """
    if not bandwidth:
        return {}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    roofline_ms = (weight_bytes + cache_bytes) / bandwidth * 1e3
    return {"roofline_ms": roofline_ms, "step_over_roofline": step_ms / roofline_ms}


def decode_case(
    model: PreTrainedModel,
    cache_name: str,
    fill: Callable[[Any], None],
    input_ids: torch.Tensor,
    run: dict,
    rotations: RotationSet | None,
    inspect: Callable[[Any], dict] | None = None,
) -> dict:
    """Decode throughput of one cache: a manual step loop (median step) and timed ``generate`` calls.

    ``fill(cache)`` brings a fresh cache to ``input_ids.shape[1] - 1`` tokens (synthetic K/V or a real
    prefill, excluded from the timing); every timed ``generate`` gets a fresh cache, since it
    mutates it. The step loop's warm-up also warms up generate. ``inspect(cache)`` runs on the
    cache after the step loop and adds its entries to the row.
    """
    batch, context = input_ids.shape[0], input_ids.shape[1] - 1
    new_tokens = run["new_tokens"]
    max_len = context + max(new_tokens, run["warmup_steps"] + run["steps"]) + 8
    model.set_attn_implementation(attention_for(cache_name))

    def filled():
        cache = make_cache(cache_name, model, max_len, rotations)
        fill(cache)
        synchronize(model_devices(model))
        return cache

    cache = filled()
    row = {"kv_bytes": kv_bytes(cache)}
    steps = decode_steps(model, cache, batch, run["warmup_steps"], run["steps"])
    if inspect is not None:
        row.update(inspect(cache))
    del cache
    free_memory()
    generate_times = []
    for _ in range(run["repeats"]):
        cache = filled()
        generate_times.append(generate_ms(model, cache, input_ids, new_tokens))
        del cache
        free_memory()
    step_ms, total_ms = median(steps), median(generate_times)
    return {
        **row,
        **roofline(model, row["kv_bytes"], step_ms, run.get("bandwidth_bytes_per_s")),
        "step_ms": step_ms,
        "step_tokens_per_s": batch * 1e3 / step_ms,
        "generate_ms": total_ms,
        "tokens_per_s": batch * new_tokens * 1e3 / total_ms,
        "generate_ms_all": generate_times,
    }


def random_tokens(model: PreTrainedModel, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, text_config(model).vocab_size, (batch, length), generator=generator)
    return ids.to(input_device(model))


def synthetic_fill(model: PreTrainedModel, batch: int, context: int, chunk_rows: int) -> Callable[[Any], None]:
    return lambda cache: fill_cache(cache, model, batch, context, chunk_rows)


def add_speedups(rows: list[dict], keys: tuple[str, ...], baseline: dict[str, Any], metrics: dict[str, bool]) -> None:
    """``speedup_<metric>`` of each ok row against the ok row that matches ``baseline`` in the same group.

    ``metrics`` maps a metric to whether higher is better (throughput) or not (time).
    """
    def is_base(candidate: dict, row: dict) -> bool:
        return (candidate.get("status") == "ok" and all(candidate.get(k) == row.get(k) for k in keys)
                and all(candidate.get(k) == v for k, v in baseline.items()))  # fmt: skip

    for row in rows:
        base = next((r for r in rows if is_base(r, row)), None)
        if base is None or row.get("status") != "ok":
            continue
        for metric, higher_is_better in metrics.items():
            if row.get(metric) and base.get(metric):
                ratio = row[metric] / base[metric] if higher_is_better else base[metric] / row[metric]
                row[f"speedup_{metric}"] = float(f"{ratio:.3g}")  # significant digits: interpreted kernels are ~1e-4x


def model_cases(config: dict, run_model: Callable[[str, PreTrainedModel], list[dict]]) -> list[dict]:
    """Build each configured model in turn, run its cases, free it; a model that fails to build is a row."""
    rows = []
    device, dtype = config["device"], DTYPES[config["dtype"]]
    for entry in config["models"]:
        name, spec = model_spec(entry)
        holder: dict = {}
        row = guarded({"model": name, "part": "build"},
                      lambda: holder.update(model=build_model(spec, device, dtype)) or {})  # fmt: skip
        if "model" in holder:
            rows.extend(run_model(name, holder.pop("model")))
        else:
            rows.append(row)
        free_memory()
    return rows


# ------------------------------------------------------------------------------------ (a) kernel

TIER_NAMES = ("sink_k", "sink_v", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero",
              "recent_k", "recent_v", "new_k", "new_v")  # fmt: skip  (the kernel's positional order)


def dense_inputs(config: dict, context: int, batch: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """A query ``[B, Hq, D]`` and BF16 K/V ``[B, Hkv, context, D]`` for SDPA."""
    shape, dtype = config["shape"], DTYPES[config["dtype"]]
    generator = torch.Generator(device).manual_seed(seed)
    kv_shape = (batch, shape["kv_heads"], context, shape["head_dim"])
    return {
        "q": torch.randn(batch, shape["q_heads"], shape["head_dim"], generator=generator, device=device, dtype=dtype),
        "k": torch.randn(kv_shape, generator=generator, device=device, dtype=dtype),
        "v": torch.randn(kv_shape, generator=generator, device=device, dtype=dtype),
    }


def tiered_inputs(config: dict, context: int, batch: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """A query and the four tiers of one layer: sink, packed history, recent window, new token.

    History codes are random bytes with random positive scales (``codes: "random"``, as fast to read
    as real ones) or real quantized Gaussian rows (``codes: "quantize"``).
    """
    shape, dtype = config["shape"], DTYPES[config["dtype"]]
    kv_heads, dim = shape["kv_heads"], shape["head_dim"]
    history = context - config["sink"] - config["recent"] - config["new"]
    if history < 0:
        raise ValueError(f"context {context} is shorter than sink + recent + new")
    generator = torch.Generator(device).manual_seed(seed)

    def rows(count: int) -> torch.Tensor:
        return torch.randn(batch, kv_heads, count, dim, generator=generator, device=device, dtype=dtype)

    def as_stored(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in a cache's history buffer (capacity of whole aligned rows), as the cache holds it."""
        stored = RowBuffer(batch, kv_heads, tuple(tensor.shape[3:]), tensor.dtype, device)
        stored.append(tensor)
        return stored.view()

    def packed(bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if config["codes"] == "quantize":
            quantized = quantize(rows(history), bits, dim)
            return as_stored(quantized.codes), as_stored(quantized.scale), as_stored(quantized.zero)
        meta = (batch, kv_heads, history, 1)
        codes = torch.randint(0, 256, (batch, kv_heads, history, dim * bits // 8), generator=generator,
                              device=device, dtype=torch.uint8)  # fmt: skip
        scale = torch.rand(meta, generator=generator, device=device) * 0.5 + 0.05
        zero = torch.rand(meta, generator=generator, device=device) * (2**bits - 1)
        return as_stored(codes), as_stored(scale.to(torch.bfloat16)), as_stored(zero.to(torch.bfloat16))

    q = torch.randn(batch, shape["q_heads"], dim, generator=generator, device=device, dtype=dtype)
    k_codes, k_scale, k_zero = packed(config["k_bits"])
    v_codes, v_scale, v_zero = packed(config["v_bits"])
    sink, recent, new = config["sink"], config["recent"], config["new"]
    return dict(q=q, sink_k=rows(sink), sink_v=rows(sink), k_codes=k_codes, k_scale=k_scale, k_zero=k_zero,
                v_codes=v_codes, v_scale=v_scale, v_zero=v_zero, recent_k=rows(recent), recent_v=rows(recent),
                new_k=rows(new), new_v=rows(new))  # fmt: skip


def sdpa_bf16(x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The BF16 baseline: SDPA of one query token over the whole dense K/V, GQA inside SDPA."""
    return F.scaled_dot_product_attention(x["q"][:, :, None], x["k"], x["v"], enable_gqa=True)


def dequantize_sdpa(x: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The reference's decode path: dequantize the packed history, concatenate the tiers, SDPA."""
    dtype = x["q"].dtype

    def history(name: str, bits: int) -> torch.Tensor:
        rows = QuantizedRows(x[f"{name}_codes"], x[f"{name}_scale"], x[f"{name}_zero"])
        return dequantize(rows, bits, x["q"].shape[-1] // rows.scale.shape[-1], dtype)

    keys = torch.cat([x["sink_k"], history("k", config["k_bits"]), x["recent_k"], x["new_k"]], dim=2)
    values = torch.cat([x["sink_v"], history("v", config["v_bits"]), x["recent_v"], x["new_v"]], dim=2)
    return F.scaled_dot_product_attention(x["q"][:, :, None], keys, values, enable_gqa=True)


def decode_kernels():
    """The kernel module as currently imported (a test may have re-imported it for the interpreter)."""
    return importlib.import_module("oscar_hf.kernels.decode_attention")


def oscar_triton(x: dict[str, torch.Tensor], config: dict, span_variant=None) -> torch.Tensor:
    """Our split-K kernel, reading the packed history directly (the launcher, not the dispatcher). The
    history was written before the kernel ahead of each call, as in a decode step (``history_settled``):
    on Hopper a call's span then starts copying it while that kernel, the call before's merge, runs.
    ``span_variant``: the Gluon span's development variant (``kernels/tools/``; None: production)."""
    tiers = [x[name] for name in TIER_NAMES]
    scale = x["q"].shape[-1] ** -0.5
    return decode_kernels().decode_attention_triton(x["q"], *tiers, None, config["k_bits"], config["v_bits"], scale,
                                                    history_settled=True, span_variant=span_variant)  # fmt: skip


KERNEL_METHODS: dict[str, tuple[Callable, Callable]] = {
    "sdpa_bf16": (sdpa_bf16, dense_inputs),
    "torch_dequant_sdpa": (dequantize_sdpa, tiered_inputs),
    "oscar_triton": (oscar_triton, tiered_inputs),
}


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run here, or None."""
    triton_module = importlib.import_module("oscar_hf.kernels._triton")
    if not triton_module.HAS_TRITON:
        return "Triton is not installed"
    if device.type != "cuda" and not triton_module.INTERPRET:
        return "Triton kernels need CUDA (or TRITON_INTERPRET=1 set before import, on CPU)"
    return None


def check_kernel(x: dict[str, torch.Tensor], config: dict) -> dict:
    """The kernel's output against ``decode_attention_reference`` on the same inputs (bf16 tolerance)."""
    got = oscar_triton(x, config).float()
    try:
        want = decode_kernels().decode_attention_reference(
            x["q"], *[x[name] for name in TIER_NAMES], k_bits=config["k_bits"], v_bits=config["v_bits"]
        ).float()
    except torch.OutOfMemoryError:  # the float32 reference needs ~4x the dense K/V; the timing still counts
        return {"max_abs_err": None, "check": "reference ran out of memory"}
    tolerance = config["check"]
    error = (got - want).abs()
    ok = bool((error <= tolerance["atol"] + tolerance["rtol"] * want.abs()).all())
    return {"max_abs_err": float(error.max()), "check": "match" if ok else "MISMATCH"}


def input_copies(nbytes: int, device: torch.device, timing: dict) -> int:
    """Input sets to cycle through so that a graph replay reads at least ``l2_flush_bytes`` between reuses."""
    if device.type != "cuda":
        return 1
    return max(1, min(timing["max_copies"], math.ceil(timing["l2_flush_bytes"] / max(1, nbytes))))


def kernel_case(method: str, config: dict, context: int, batch: int, device: torch.device) -> dict:
    """Time one method at one shape: bytes read, eager and graph-replayed microseconds, bandwidth."""
    if method == "oscar_triton" and (reason := triton_unavailable(device)):
        return {"status": "skipped", "reason": reason}
    call, build = KERNEL_METHODS[method]
    first = build(config, context, batch, device, seed=0)
    nbytes = tensor_bytes(first.values())
    count = input_copies(nbytes, device, config["timing"])
    copies = [first] + [build(config, context, batch, device, seed=seed) for seed in range(1, count)]
    row = {"bytes_read": nbytes, "input_copies": len(copies)}
    if method == "oscar_triton":
        row.update(check_kernel(first, config))
    row.update(kernel_times([functools.partial(call, x, config) for x in copies], device, config["timing"]))
    best = row["graph_us"] or row["eager_us"]
    row["gb_per_s"] = nbytes / (best * 1e-6) / 1e9
    return row


def bench_kernel(config: dict) -> list[dict]:
    device = torch.device(config["device"])
    grid = [(c, b, m) for c in config["contexts"] for b in config["batches"] for m in config["methods"]]
    rows = []
    for context, batch, method in tqdm(grid, desc="kernel"):
        rows.append(guarded({"context": context, "batch": batch, "method": method},
                            lambda: kernel_case(method, config, context, batch, device)))  # fmt: skip
    add_speedups(rows, ("context", "batch"), {"method": "sdpa_bf16"}, {"graph_us": False, "eager_us": False})
    return rows


# --------------------------------------------------------------------------------------- (b) e2e


def prefill_case(model: PreTrainedModel, cache_name: str, context: int, batch: int, run: dict, rotations) -> dict:
    """Median time of a real prefill forward (``logits_to_keep=1``) into a fresh cache."""
    model.set_attn_implementation(attention_for(cache_name))
    ids = random_tokens(model, batch, context, seed=1)

    def once() -> float:
        cache = make_cache(cache_name, model, context + 8, rotations)
        forward = functools.partial(model, ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
        with torch.no_grad():
            ms = elapsed_ms(forward, model_devices(model))
        del forward, cache
        free_memory()
        return ms

    for _ in range(run["warmup"]):
        once()
    times = [once() for _ in range(run["repeats"])]
    return {"prefill_ms": median(times), "prefill_tokens_per_s": batch * context * 1e3 / median(times),
            "prefill_ms_all": times}  # fmt: skip


def e2e_model(config: dict, name: str, model: PreTrainedModel) -> list[dict]:
    """Decode rows per (context, batch, cache), then the prefill rows.

    ``decode.rounds`` > 1 measures the caches of a (context, batch) in turn, round after round, and
    reports each cache's median round: eager decoding is bound by host time, which drifted by 2x
    between device calls and would otherwise favour whichever cache ran in a fast stretch.
    """
    rotations = model_rotations(model, config)
    run, rows = config["decode"], []
    rounds = run.get("rounds", 1)
    grid = [(c, b, r, k) for c in config["contexts"] for b in config["batches"] for r in range(rounds)
            for k in config["caches"]]  # fmt: skip
    measured: dict[tuple, list[dict]] = {}
    for context, batch, _, cache_name in tqdm(grid, desc=f"e2e {name}"):
        def measure() -> dict:
            ids = random_tokens(model, batch, context + 1)
            fill = synthetic_fill(model, batch, context, run["fill_chunk_rows"])
            with model_for(model, cache_name, rotations) as method:
                return decode_case(model, method, fill, ids, run, rotations)

        measured.setdefault((context, batch, cache_name), []).append(guarded(
            {"part": "decode", "model": name, "context": context, "batch": batch, "cache": cache_name}, measure))
    rows += [median_round(results) for results in measured.values()]
    prefill = config["prefill"]
    for cache_name in tqdm(prefill["caches"], desc=f"prefill {name}"):
        rows.append(guarded({"part": "prefill", "model": name, "context": prefill["context"],
                             "batch": prefill["batch"], "cache": cache_name},
                            lambda: prefill_case(model, cache_name, prefill["context"], prefill["batch"], prefill,
                                                 rotations)))  # fmt: skip
    return rows


def median_round(results: list[dict], key: str = "tokens_per_s", higher_is_faster: bool = True) -> dict:
    """One row from rounds of the same case: the round of median ``key`` (the slower middle one of an
    even count), with every round's value as ``<key>_rounds`` (a failed round is the row if no round
    succeeded; rows without a status count as succeeded)."""
    done = sorted((r for r in results if r.get("status", "ok") == "ok"),
                  key=lambda r: r[key] if higher_is_faster else -r[key])  # fmt: skip
    if len(results) == 1 or not done:
        return results[0]
    return {**done[(len(done) - 1) // 2], f"{key}_rounds": [r.get(key) for r in results]}


def bench_e2e(config: dict) -> list[dict]:
    rows = model_cases(config, functools.partial(e2e_model, config))
    decode = [r for r in rows if r.get("part") == "decode"]
    add_speedups(decode, ("model", "context", "batch"), {"cache": "dynamic"}, {"tokens_per_s": True, "step_ms": False})
    prefill = [r for r in rows if r.get("part") == "prefill"]
    add_speedups(prefill, ("model",), {"cache": "dynamic"}, {"prefill_ms": False})
    return rows


# ------------------------------------------------------------------------------ (d) CUDA graphs


def graph_variant(cache_name: str) -> tuple[str, bool, dict]:
    """``"<cache>[+graph[+compile|+autotune][+fused]]"`` -> (cache name for :func:`model_for`, captured,
    the ``compile`` and ``fuse_projections`` arguments of :class:`oscar_hf.StaticDecoder`)."""
    base, graph, rest = cache_name.partition(GRAPH_SUFFIX)
    compiled, fused = rest.removesuffix(FUSED_SUFFIX), rest.endswith(FUSED_SUFFIX)
    if compiled and compiled not in COMPILE_SUFFIXES:
        raise ValueError(f"cache {cache_name!r}: after {GRAPH_SUFFIX!r} comes nothing or one of "
                         f"{list(COMPILE_SUFFIXES)}, then optionally {FUSED_SUFFIX!r}")
    return base, bool(graph), {"compile": COMPILE_SUFFIXES.get(compiled, False), "fuse_projections": fused}


def static_decoder(model: PreTrainedModel, cache, capacity: int, options: dict) -> StaticDecoder:
    """Captured on CUDA; elsewhere (the CPU smoke test) the same static steps run eagerly. ``options``:
    :func:`graph_variant`'s keyword arguments."""
    return StaticDecoder(model, cache, capacity, capture=input_device(model).type == "cuda", **options)


def graph_decode_steps(model: PreTrainedModel, decoder: StaticDecoder, batch: int, warmup: int, steps: int) -> dict:
    """Times (ms) of single-token steps through :class:`oscar_hf.StaticDecoder`, each synchronised.

    The first step freezes the cache and runs eagerly, the second captures the graph; both are part
    of ``warmup``.
    """
    device, devices = input_device(model), model_devices(model)
    cache = decoder.cache
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []

    def step() -> None:
        nonlocal token
        logits = decoder.step({"input_ids": token, cache_keyword(model): cache})
        token = logits[:, -1:].argmax(-1)

    for index in range(max(warmup, 2) + steps):
        ms = elapsed_ms(step, devices)
        if index >= max(warmup, 2):
            times.append(ms)
    captured = decoder.graph is not None
    decoder.stop()
    return {"step_ms_all": times, "captured": captured}


def graph_case(model: PreTrainedModel, method: str, captured: bool, options: dict, context: int, batch: int,
               run: dict, rotations: RotationSet | None) -> dict:  # fmt: skip
    """One cache's median decode step over a synthetic ``context`` (and generate tokens/s where cheap)."""
    capacity = context + run["warmup_steps"] + run["steps"] + run["new_tokens"] + 16
    model.set_attn_implementation(attention_for(method))
    fill = synthetic_fill(model, batch, context, run["fill_chunk_rows"])
    ids = random_tokens(model, batch, context + 1)

    def filled():
        cache = make_cache(method, model, capacity, rotations, preallocate=captured)
        fill(cache)
        synchronize(model_devices(model))
        return cache

    cache = filled()
    row = {"kv_bytes": kv_bytes(cache)}
    if captured:
        decoder = static_decoder(model, cache, capacity, options)
        row.update(graph_decode_steps(model, decoder, batch, run["warmup_steps"], run["steps"]))
        del decoder
    else:
        row["step_ms_all"] = decode_steps(model, cache, batch, run["warmup_steps"], run["steps"])
    del cache
    free_memory()
    if captured or method == "dynamic":  # the user-facing loop: generate's own sampling and stopping
        times = []
        for _ in range(run["repeats"] + 1):  # the first call warms up (compiles and captures)
            cache = filled()
            fast = dict(runner=functools.partial(oscar_hf.generate, model), **options) if captured else {}
            times.append(generate_ms(model, cache, ids, run["new_tokens"], **fast))
            del cache
            free_memory()
        row["generate_tokens_per_s"] = batch * run["new_tokens"] * 1e3 / median(times[1:])
    row["step_ms"] = median(row["step_ms_all"])
    return {**row, **roofline(model, row["kv_bytes"], row["step_ms"], run.get("bandwidth_bytes_per_s"))}


def compiled_static_case(model: PreTrainedModel, context: int, batch: int, run: dict) -> dict:
    """StaticCache under transformers' compiled generate: a step is the time difference of two lengths.

    Compilation and graph capture happen in the first call, which is not timed.
    """
    short, long = run["compiled_new_tokens"]
    capacity = context + long + 16
    model.set_attn_implementation("sdpa")
    fill = synthetic_fill(model, batch, context, run["fill_chunk_rows"])
    ids = random_tokens(model, batch, context + 1)
    times: dict[int, list[float]] = {short: [], long: []}
    for index, tokens in enumerate([short] + [short, long] * run["repeats"]):
        cache = make_cache("static", model, capacity, None)
        fill(cache)
        ms = generate_ms(model, cache, ids, tokens, disable_compile=False)  # StaticCache: transformers compiles
        if index:
            times[tokens].append(ms)
        del cache
        free_memory()
    step_ms = (median(times[long]) - median(times[short])) / (long - short)
    cache_bytes = 2 * text_config(model).num_hidden_layers * batch * text_config(model).num_key_value_heads
    cache_bytes *= capacity * head_dim(model) * DTYPES[run.get("dtype", "bfloat16")].itemsize
    return {"step_ms": step_ms, "kv_bytes": cache_bytes, "generate_ms_by_tokens": times,
            **roofline(model, cache_bytes, step_ms, run.get("bandwidth_bytes_per_s"))}  # fmt: skip


def profile_graph_step(model: PreTrainedModel, method: str, options: dict, context: int, batch: int, run: dict,
                       rotations) -> list[dict]:  # fmt: skip
    """Where a captured OscarCache step spends its GPU time: kernels by total time over replays."""
    from torch.profiler import ProfilerActivity, profile

    capacity = context + 64
    model.set_attn_implementation("oscar")
    cache = make_cache(method, model, capacity, rotations, preallocate=True)
    fill_cache(cache, model, batch, context, run["fill_chunk_rows"])
    device = input_device(model)
    decoder = static_decoder(model, cache, capacity, options)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    for _ in range(3):  # freeze, capture, replay once
        decoder.step({"input_ids": token, cache_keyword(model): cache})
    steps = run["profile_steps"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize([device])
    with profile(activities=activities) as trace:
        for _ in range(steps):
            decoder.step({"input_ids": token, cache_keyword(model): cache})
        synchronize([device])
    decoder.stop()
    events = [e for e in trace.key_averages() if e.device_time_total > 0] if device.type == "cuda" else []
    gpu_us = sum(e.device_time_total for e in events) / steps  # kernels only (self times), no overlap
    rows = [{"part": "profile", "kernel": e.key[:90], "calls_per_step": e.count / steps,
             "us_per_step": e.device_time_total / steps, "share": e.device_time_total / steps / gpu_us}
            for e in sorted(events, key=lambda e: -e.device_time_total)[: run["profile_top"]]]  # fmt: skip
    return [{"part": "profile", "kernel": "(all kernels)", "us_per_step": gpu_us, "share": 1.0}, *rows]


def graph_model(config: dict, name: str, model: PreTrainedModel) -> list[dict]:
    rotations = model_rotations(model, config)
    run, rows = {**config["decode"], "dtype": config["dtype"]}, []
    grid = [(c, b, k) for c in config["contexts"] for b in config["batches"] for k in config["caches"]]
    for context, batch, cache_name in tqdm(grid, desc=f"graph {name}"):
        def measure() -> dict:
            base, captured, options = graph_variant(cache_name)
            with model_for(model, base, rotations) as method:
                return graph_case(model, method, captured, options, context, batch, run, rotations)

        rows.append(guarded({"part": "decode", "model": name, "context": context, "batch": batch,
                             "cache": cache_name}, measure))  # fmt: skip
    compiled = config["compiled_static"]
    if name in compiled["models"]:
        for context, batch in [(c, b) for c in compiled["contexts"] for b in compiled["batches"]]:
            rows.append(guarded({"part": "decode", "model": name, "context": context, "batch": batch,
                                 "cache": "static+compiled"},
                                lambda: compiled_static_case(model, context, batch, run)))  # fmt: skip
    profiled = config["profile"]
    if name == profiled["model"]:
        holder: list = []
        base, _, options = graph_variant(profiled["cache"])

        def trace() -> dict:
            with model_for(model, base, rotations) as method:
                holder.extend(profile_graph_step(model, method, options, profiled["context"], profiled["batch"],
                                                 {**run, **profiled}, rotations))  # fmt: skip
            return {}

        row = guarded({"part": "profile", "model": name, "context": profiled["context"], "batch": profiled["batch"],
                       "cache": profiled["cache"]}, trace)  # fmt: skip
        if holder:
            rows.extend({**row, **entry} for entry in holder)
        else:
            rows.append(row)
    return rows


def bench_graph(config: dict) -> list[dict]:
    rows = model_cases(config, functools.partial(graph_model, config))
    decode = [r for r in rows if r.get("part") == "decode"]
    add_speedups(decode, ("model", "context", "batch"), {"cache": "dynamic"},
                 {"step_ms": False, "generate_tokens_per_s": True})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------ (c) memory


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def decode_peak(model: PreTrainedModel, cache, batch: int, steps: int) -> int | None:
    """Peak bytes allocated while decoding ``steps`` tokens (None on CPU)."""
    device = input_device(model)
    if device.type == "cuda":
        synchronize([device])
        torch.cuda.reset_peak_memory_stats(device)
    decode_steps(model, cache, batch, warmup=0, steps=steps)
    if device.type != "cuda":
        return None
    synchronize([device])
    return torch.cuda.max_memory_allocated(device)


def fill_probe(
    model: PreTrainedModel, cache_name: str, batch: int, context: int, chunk_rows: int, rotations, steps: int = 1
) -> dict:
    """Fill a fresh cache and decode ``steps`` tokens: KV bytes stored and allocated, step overhead, peak.

    ``kv_allocated_bytes`` is what the cache really holds after those steps, growth slack included
    (OscarCache's buffers grow geometrically when demoted rows join the history, every ``block``
    steps); ``step_overhead_bytes`` is the peak of the steps above that (activations, transients).
    """
    device = input_device(model)
    model.set_attn_implementation(attention_for(cache_name))
    free_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = allocated(device)
    cache = make_cache(cache_name, model, context + steps + 8, rotations)
    fill_cache(cache, model, batch, context, chunk_rows)
    synchronize([device])
    stored = kv_bytes(cache)
    fill_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    peak = decode_peak(model, cache, batch, steps)
    resident = allocated(device)
    elements = 2 * batch * context * len(cache.layers) * text_config(model).num_key_value_heads * head_dim(model)
    row = {
        "kv_bytes": stored,
        # on CPU, where allocations cannot be counted, the stored bytes stand in
        "kv_allocated_bytes": stored if before is None else resident - before,
        "step_overhead_bytes": None if peak is None else peak - resident,
        "decode_steps": steps,
        # weights + filled cache + the decode steps' transients (the synthetic fill's own peak is apart)
        "peak_bytes": peak,
        "fill_peak_bytes": fill_peak,
        "bits_per_element": 8 * stored / elements,
    }
    if isinstance(cache, OscarCache):
        row["compression_vs_bf16"] = round(cache.memory_report().compression, 3)
    return row


def predict_max_batch(per_sequence: int, fixed: int, budget: int) -> int:
    """Largest batch with ``fixed + batch * per_sequence <= budget``."""
    return max(0, (budget - fixed) // max(1, per_sequence))


def try_batch(model: PreTrainedModel, cache_name: str, batch: int, context: int, run: dict, rotations) -> dict:
    """Allocate, fill and decode at ``batch``: the verification of a predicted batch, with its step times."""
    try:
        model.set_attn_implementation(attention_for(cache_name))
        cache = make_cache(cache_name, model, context + run["warmup_steps"] + run["steps"] + 8, rotations)
        fill_cache(cache, model, batch, context, run["fill_chunk_rows"])
        times = decode_steps(model, cache, batch, run["warmup_steps"], run["steps"])
        outcome = {"batch": batch, "status": "ok", "step_ms": median(times)}
    except torch.OutOfMemoryError as error:
        outcome = {"batch": batch, "status": "oom", "error": _first_line(error)}
    cache = None
    free_memory()
    return outcome


def max_batch_case(model: PreTrainedModel, cache_name: str, config: dict, rotations) -> dict:
    """Predict the largest batch at ``context`` from batch-1 and batch-2 probes, then verify it, stepping down on OOM.

    Memory model: weights + ``fixed`` + ``batch * (kv_per_sequence + activation_per_sequence)``. The
    probes decode as many steps as the verification does, so both the cache's growth and the step
    overhead (activations, a layer's transient copies) are measured, at batch 1 and 2.
    """
    run, context = config["max_batch"], config["max_batch"]["context"]
    device = input_device(model)
    probes = {b: fill_probe(model, cache_name, b, context, run["fill_chunk_rows"], rotations,
                            steps=run["warmup_steps"] + run["steps"]) for b in (1, 2)}  # fmt: skip
    kv_per_sequence = max(probes[1]["kv_allocated_bytes"], probes[2]["kv_allocated_bytes"] // 2)
    overheads = [probes[b]["step_overhead_bytes"] or 0 for b in (1, 2)]
    activation_per_sequence = max(0, overheads[1] - overheads[0])
    fixed = max(0, overheads[0] - activation_per_sequence)
    free_memory()
    if run.get("budget_bytes"):
        budget = run["budget_bytes"]
    elif device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] - run["reserve_bytes"]  # free with only the weights resident
    else:
        return {"status": "skipped", "reason": "no device memory to size the batch by: set max_batch.budget_bytes"}
    predicted = predict_max_batch(kv_per_sequence + activation_per_sequence, fixed, budget)
    attempts, batch = [], predicted
    while batch >= 1 and len(attempts) < run["max_attempts"]:
        attempts.append(try_batch(model, cache_name, batch, context, run, rotations))
        if attempts[-1]["status"] == "ok":
            break
        batch -= max(1, math.ceil(batch * run["step_down"]))
    if run["probe_up"] and attempts and attempts[-1]["status"] == "ok" and attempts[0]["status"] == "ok":
        # the prediction held at once: does one more sequence fit too (i.e. was it conservative)?
        attempts.append(try_batch(model, cache_name, batch + 1, context, run, rotations))
    verified = max((a for a in attempts if a["status"] == "ok"), key=lambda a: a["batch"], default=None)
    row = {
        "kv_bytes_per_sequence": kv_per_sequence,
        "activation_bytes_per_sequence": activation_per_sequence,
        "fixed_step_bytes": fixed,
        "budget_bytes": budget,
        "predicted_batch": predicted,
        "attempts": attempts,
        "max_batch": verified["batch"] if verified else 0,
    }
    if verified:
        row.update(step_ms=verified["step_ms"], tokens_per_s=verified["batch"] * 1e3 / verified["step_ms"])
    return row


def memory_model(config: dict, name: str, model: PreTrainedModel) -> list[dict]:
    rotations = model_rotations(model, config)
    weights = tensor_bytes(model.parameters())
    report = config["report"]
    rows = []
    for cache_name in tqdm(config["caches"], desc=f"memory {name}"):
        rows.append(guarded({"part": "report", "model": name, "cache": cache_name, "context": report["context"],
                             "batch": report["batch"], "weight_bytes": weights},
                            lambda: fill_probe(model, cache_name, report["batch"], report["context"],
                                               report["fill_chunk_rows"], rotations)))  # fmt: skip
    for cache_name in tqdm(config["caches"], desc=f"max batch {name}"):
        rows.append(guarded({"part": "max_batch", "model": name, "cache": cache_name,
                             "context": config["max_batch"]["context"], "weight_bytes": weights},
                            lambda: max_batch_case(model, cache_name, config, rotations)))  # fmt: skip
    return rows


def bench_memory(config: dict) -> list[dict]:
    rows = model_cases(config, functools.partial(memory_model, config))
    report = [r for r in rows if r.get("part") == "report"]
    for row in report:
        base = next((r for r in report if r["model"] == row["model"] and r["cache"] == "dynamic"
                     and r.get("status") == "ok"), None)  # fmt: skip
        if base and row.get("status") == "ok":
            row["kv_ratio_vs_bf16"] = round(base["kv_bytes"] / row["kv_bytes"], 3)
    add_speedups([r for r in rows if r.get("part") == "max_batch"], ("model",), {"cache": "dynamic"},
                 {"tokens_per_s": True, "max_batch": True})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------- (d) multigpu


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
            wrong += [f"layer {layer_idx} {name} on {t.device}, attention on {want}"
                      for name, t in tensors_of(layer) if t.device != want]  # fmt: skip
        if wrong:
            raise AssertionError(f"{len(wrong)} OscarCache tensors off their layer's device, e.g. {wrong[0]}")
        return {"buffers_on_layer_device": True, "cache_devices": sorted(devices)} if devices else {}

    return check


def save_random_model(spec: dict, path: Path, device: str | torch.device, dtype: torch.dtype) -> None:
    """Build a random-weight Qwen3 on ``device`` and save it (weights move to the CPU for writing)."""
    model = build_model(spec, device, dtype)
    model.save_pretrained(path)
    del model
    free_memory()


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
        row = {"part": "device_map", "model": name, "context": part["context"], "batch": part["batch"],
               "cache": cache_name, "model_devices": devices}  # fmt: skip

        def measure() -> dict:
            if len(devices) < gpus:
                raise AssertionError(f"device_map='auto' put the model on {devices} only; expected {gpus} GPUs")
            return decode_case(model, cache_name, fill, ids, part, rotations, inspect=placement_check(model))

        rows.append(guarded(row, measure))
    return rows


def torchrun_command(gpus: int, config_path: Path, out_path: Path) -> list[str]:
    """``torchrun --standalone --nproc_per_node N eval/tp_decode.py`` through this interpreter."""
    script = Path(__file__).resolve().parent / "tp_decode.py"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", str(script),
            "--config", str(config_path), "--out", str(out_path)]  # fmt: skip


def tensor_parallel_cases(config: dict, gpus: int) -> list[dict]:
    """Run eval/tp_decode.py under torchrun and turn its JSON into rows."""
    part = config["tensor_parallel"]
    with tempfile.TemporaryDirectory(prefix="oscar_tp_") as directory:
        config_path, out_path = Path(directory) / "config.json", Path(directory) / "result.json"
        config_path.write_text(json.dumps({**part, "dtype": config["dtype"], "seed": config["seed"]}))
        process = subprocess.run(torchrun_command(gpus, config_path, out_path), capture_output=True, text=True,
                                 timeout=part["timeout_s"], cwd=REPO)  # fmt: skip
        if process.returncode != 0:
            raise RuntimeError(f"torchrun exited with {process.returncode}: {process.stderr[-2000:]}")
        result = json.loads(out_path.read_text())
    shared = {k: result[k] for k in ("world_size", "model", "context", "batch", "new_tokens")}
    return [{"part": "tensor_parallel", **shared, **row} for row in result["rows"]]


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Index of the first decoding step at which two batches of token lists differ (None: identical)."""
    def column(rows: list[list[int]], step: int) -> list[int | None]:
        return [row[step] if step < len(row) else None for row in rows]

    for step in range(max((len(row) for row in a + b), default=0)):
        if column(a, step) != column(b, step):
            return step
    return None


def part_rows(part: str, cases: Callable[[], list[dict]]) -> list[dict]:
    """The rows of one part, or a single row with its error when the part failed before producing rows."""
    holder = guarded({"part": part}, lambda: {"rows": cases()})
    return holder.pop("rows", None) or [holder]


def bench_multigpu(config: dict) -> list[dict]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < config["gpus"]:
        reason = f"needs {config['gpus']} CUDA GPUs, found {gpus}"
        return [{"part": part, "status": "skipped", "reason": reason} for part in ("device_map", "tensor_parallel")]
    rows = part_rows("device_map", lambda: device_map_cases(config, config["gpus"]))
    rows += part_rows("tensor_parallel", lambda: tensor_parallel_cases(config, config["gpus"]))
    add_speedups(rows, ("part",), {"cache": "dynamic"}, {"tokens_per_s": True})
    return rows


# ------------------------------------------------------------------------------------- reporting

Column = tuple[str, str, str]  # header, row key, format spec ("" for str())


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return ""
    if spec == "MiB":
        return f"{value / 2**20:,.1f}"
    if spec == "GiB":
        return f"{value / 2**30:,.2f}"
    return format(value, spec) if spec and isinstance(value, (int, float)) else str(value)


def table(rows: list[dict], columns: list[Column]) -> str:
    """A markdown table; rows that did not run show their status and error instead of numbers."""
    head = "| " + " | ".join(c[0] for c in columns) + " | status |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for row in rows:
        status = row.get("status", "")
        if status != "ok":
            status += f": {row.get('error') or row.get('reason') or ''}".rstrip(": ")
        if row.get("check") == "MISMATCH":
            status += " (kernel != reference)"
        lines.append("| " + " | ".join(fmt(row.get(key), spec) for _, key, spec in columns) + f" | {status} |")
    return "\n".join(lines)


KERNEL_COLUMNS: list[Column] = [
    ("context", "context", ""), ("batch", "batch", ""), ("method", "method", ""),
    ("graph µs", "graph_us", ".1f"), ("eager µs", "eager_us", ".1f"), ("MiB read", "bytes_read", "MiB"),
    ("GB/s", "gb_per_s", ".0f"), ("speedup vs SDPA (graph)", "speedup_graph_us", ".2f"),
    ("speedup vs SDPA (eager)", "speedup_eager_us", ".2f"), ("max abs err vs ref", "max_abs_err", ".2e"),
]  # fmt: skip
E2E_COLUMNS: list[Column] = [
    ("model", "model", ""), ("context", "context", ""), ("batch", "batch", ""), ("cache", "cache", ""),
    ("tokens/s (generate)", "tokens_per_s", ".1f"), ("median step ms", "step_ms", ".2f"),
    ("speedup vs Dynamic", "speedup_tokens_per_s", ".2f"), ("KV GiB", "kv_bytes", "GiB"),
    ("roofline ms", "roofline_ms", ".2f"), ("step / roofline", "step_over_roofline", ".1f"),
]  # fmt: skip
PREFILL_COLUMNS: list[Column] = [
    ("model", "model", ""), ("context", "context", ""), ("batch", "batch", ""), ("cache", "cache", ""),
    ("prefill ms", "prefill_ms", ".1f"), ("tokens/s", "prefill_tokens_per_s", ".0f"),
    ("speedup vs Dynamic", "speedup_prefill_ms", ".2f"),
]  # fmt: skip
GRAPH_COLUMNS: list[Column] = [
    ("model", "model", ""), ("context", "context", ""), ("batch", "batch", ""), ("cache", "cache", ""),
    ("median step ms", "step_ms", ".2f"), ("speedup vs Dynamic", "speedup_step_ms", ".2f"),
    ("roofline ms", "roofline_ms", ".2f"), ("step / roofline", "step_over_roofline", ".2f"),
    ("generate tokens/s", "generate_tokens_per_s", ".1f"),
    ("generate vs Dynamic", "speedup_generate_tokens_per_s", ".2f"), ("KV GiB", "kv_bytes", "GiB"),
]  # fmt: skip
PROFILE_COLUMNS: list[Column] = [
    ("kernel", "kernel", ""), ("calls per step", "calls_per_step", ".1f"), ("µs per step", "us_per_step", ".1f"),
    ("share of kernel time", "share", ".1%"),
]  # fmt: skip
MEMORY_COLUMNS: list[Column] = [
    ("model", "model", ""), ("cache", "cache", ""), ("context", "context", ""), ("batch", "batch", ""),
    ("KV GiB", "kv_bytes", "GiB"), ("KV allocated GiB", "kv_allocated_bytes", "GiB"),
    ("bits/element", "bits_per_element", ".2f"), ("BF16 / KV", "kv_ratio_vs_bf16", ".2f"),
    ("weights GiB", "weight_bytes", "GiB"), ("peak GiB (filled + decode step)", "peak_bytes", "GiB"),
]  # fmt: skip
MAX_BATCH_COLUMNS: list[Column] = [
    ("model", "model", ""), ("cache", "cache", ""), ("context", "context", ""),
    ("KV GiB / seq", "kv_bytes_per_sequence", "GiB"), ("activation GiB / seq", "activation_bytes_per_sequence", "GiB"),
    ("predicted batch", "predicted_batch", ""), ("verified max batch", "max_batch", ""),
    ("median step ms", "step_ms", ".2f"), ("tokens/s", "tokens_per_s", ".1f"),
    ("throughput vs BF16", "speedup_tokens_per_s", ".2f"),
]  # fmt: skip
MULTIGPU_COLUMNS: list[Column] = [
    ("part", "part", ""), ("model", "model", ""), ("context", "context", ""), ("batch", "batch", ""),
    ("cache", "cache", ""), ("tokens/s", "tokens_per_s", ".1f"), ("median step ms", "step_ms", ".2f"),
    ("speedup vs Dynamic", "speedup_tokens_per_s", ".2f"), ("checks", "checks", ""),
]  # fmt: skip


def kernel_markdown(result: dict) -> str:
    return table(result["cases"], KERNEL_COLUMNS)


def e2e_markdown(result: dict) -> str:
    cases = result["cases"]
    return ("Decoding\n\n" + table([r for r in cases if r.get("part") != "prefill"], E2E_COLUMNS)
            + "\n\nPrefill (real forward, quantize-on-write included)\n\n"
            + table([r for r in cases if r.get("part") == "prefill"], PREFILL_COLUMNS))  # fmt: skip


def graph_markdown(result: dict) -> str:
    cases = result["cases"]
    text = ("Decode step (synthetic context; eager rows: transformers' forward per step; `+graph`: one CUDA "
            "graph replay per step)\n\n" + table([r for r in cases if r.get("part") != "profile"], GRAPH_COLUMNS))
    profile = [r for r in cases if r.get("part") == "profile"]
    if profile:
        p = result["config"]["profile"]
        text += (f"\n\nWhere a captured OscarCache step spends its GPU time ({p['model']}, {p['cache']}, "
                 f"{short_tokens(p['context'])}, batch {p['batch']}; torch.profiler over {p['profile_steps']} "
                 "replays)\n\n" + table(profile, PROFILE_COLUMNS))  # fmt: skip
    return text


def memory_markdown(result: dict) -> str:
    cases = result["cases"]
    paper = result["config"].get("paper")
    note = f"\n\nPaper: {paper}" if paper else ""
    return ("KV memory\n\n" + table([r for r in cases if r.get("part") != "max_batch"], MEMORY_COLUMNS)
            + "\n\nLargest batch (predicted from the measured caches, then run)\n\n"
            + table([r for r in cases if r.get("part") == "max_batch"], MAX_BATCH_COLUMNS) + note)  # fmt: skip


def multigpu_markdown(result: dict) -> str:
    names = ("buffers_on_layer_device", "heads_per_rank_ok", "frozen_on_every_rank", "identical_across_ranks",
             "matches_single_gpu")  # fmt: skip
    rows = [{**row, "checks": ", ".join(f"{k}={row[k]}" for k in names if k in row)} for row in result["cases"]]
    return table(rows, MULTIGPU_COLUMNS)


def short_tokens(count: int) -> str:
    """32768 -> 32K, 100000 -> 100K, 400 -> 400."""
    for unit in (1024, 1000):
        if count >= unit and count % unit == 0:
            return f"{count // unit}K"
    return str(count)


def _figure(ncols: int = 1, width: float = 6.0, height: float = 4.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)


def _no_data(ax, text: str = "no successful cases") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True)
    ax.set_axis_off()


def _bars(ax, labels: list[str], series: dict[str, list[float | None]], ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per series (missing values leave a gap)."""
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        xs = [i + index * width for i, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width=width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend()


def kernel_plot(result: dict, path: Path) -> None:
    """Time vs context, one panel per batch, one line per method (log y)."""
    batches = result["config"]["batches"]
    fig, axes = _figure(len(batches))
    for ax, batch in zip(axes[0], batches):
        for method in result["config"]["methods"]:
            points = [(r["context"], r.get("graph_us") or r.get("eager_us")) for r in result["cases"]
                      if r["batch"] == batch and r["method"] == method and r.get("status") == "ok"]  # fmt: skip
            if points:
                ax.plot(*zip(*points), marker="o", label=method)
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("µs per layer (graph replay, else eager)")
        ax.set_title(f"decode attention, batch {batch}")
        ax.legend() if ax.lines else _no_data(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def e2e_plot(result: dict, path: Path) -> None:
    """Decode tokens/s per (model, context, batch), one bar per cache."""
    decode = [r for r in result["cases"] if r.get("part") == "decode"]
    groups = sorted({(r["model"], r["context"], r["batch"]) for r in decode}, key=lambda g: (g[0], g[1], g[2]))
    caches = result["config"]["caches"]
    value = {(r["model"], r["context"], r["batch"], r["cache"]): r.get("tokens_per_s") for r in decode}
    fig, axes = _figure(width=max(6.0, 0.9 * len(groups)))
    if not groups:
        _no_data(axes[0][0])
    else:
        _bars(axes[0][0], [f"{m} {short_tokens(c)} b{b}" for m, c, b in groups],
              {k: [value.get((*g, k)) for g in groups] for k in caches}, "decode tokens/s")  # fmt: skip
        axes[0][0].set_title("end-to-end decoding (random weights, synthetic context)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def graph_plot(result: dict, path: Path) -> None:
    """Median step ms per (model, context, batch), one bar per cache, a black tick at each bar's roofline."""
    decode = [r for r in result["cases"] if r.get("part") == "decode"]
    groups = sorted({(r["model"], r["context"], r["batch"]) for r in decode})
    caches = list(dict.fromkeys(r["cache"] for r in decode))
    rows = {(r["model"], r["context"], r["batch"], r["cache"]): r for r in decode}
    fig, axes = _figure(width=max(7.0, 1.4 * len(groups)), height=5.5)
    ax = axes[0][0]
    if not groups:
        _no_data(ax)
    else:
        series = {k: [rows.get((*g, k), {}).get("step_ms") for g in groups] for k in caches}
        _bars(ax, [f"{m} {short_tokens(c)} b{b}" for m, c, b in groups], series, "ms per decode step")
        width = 0.8 / len(caches)
        for index, cache in enumerate(caches):
            for group_index, group in enumerate(groups):
                roof = rows.get((*group, cache), {}).get("roofline_ms")
                if roof:
                    x = group_index + index * width
                    ax.hlines(roof, x - width / 2, x + width / 2, color="black", linewidth=2)
        ax.set_yscale("log")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, fontsize="small")
        ax.set_title("decode step: eager vs CUDA graph (log scale; black: memory roofline)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def memory_plot(result: dict, path: Path) -> None:
    """Largest verified batch and its decode throughput, per model and cache."""
    rows = [r for r in result["cases"] if r.get("part") == "max_batch"]
    models = sorted({r["model"] for r in rows})
    caches = result["config"]["caches"]
    fig, axes = _figure(2)
    for ax, key, label in zip(axes[0], ("max_batch", "tokens_per_s"), ("largest batch", "decode tokens/s")):
        values = {(r["model"], r["cache"]): r.get(key) for r in rows}
        if models:
            _bars(ax, models, {c: [values.get((m, c)) for m in models] for c in caches}, label)
            ax.set_title(f"{label} at {result['config']['max_batch']['context']} tokens")
        else:
            _no_data(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def multigpu_plot(result: dict, path: Path) -> None:
    rows = [r for r in result["cases"] if r.get("status") == "ok" and r.get("tokens_per_s")]
    fig, axes = _figure()
    if rows:
        parts = sorted({r["part"] for r in rows})
        caches = sorted({r["cache"] for r in rows})
        values = {(r["part"], r["cache"]): r["tokens_per_s"] for r in rows}
        _bars(axes[0][0], parts, {c: [values.get((p, c)) for p in parts] for c in caches}, "decode tokens/s")
    else:
        reasons = sorted({r.get("reason") or r.get("error") or "" for r in result["cases"]})
        _no_data(axes[0][0], "skipped: " + "; ".join(reasons))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------ benchmarks

_TIMING = {"warmup_ms": 25, "rep_ms": 100, "graph_rep_ms": 100, "cpu_warmup": 1, "cpu_repeats": 5,
           "l2_flush_bytes": 256 * 2**20, "max_copies": 16}  # fmt: skip
_DECODE = {"new_tokens": 32, "repeats": 3, "warmup_steps": 3, "steps": 16, "fill_chunk_rows": 65536}

DEFAULTS: dict[str, dict] = {
    "kernel": {
        "device": "cuda", "dtype": "bfloat16", "shape": {"q_heads": 32, "kv_heads": 8, "head_dim": 128},
        "sink": 64, "recent": 256, "new": 1, "k_bits": 2, "v_bits": 2, "codes": "random",
        "contexts": [32768, 65536, 100000, 131072], "batches": [1, 8, 32],
        "methods": ["sdpa_bf16", "torch_dequant_sdpa", "oscar_triton"],
        "timing": _TIMING, "check": {"atol": 2e-2, "rtol": 2e-2},
    },
    "e2e": {
        "device": "cuda", "dtype": "bfloat16", "seed": 0, "models": ["qwen3-4b", "qwen3-8b"],
        "contexts": [32768, 65536, 100000], "batches": [1, 8], "caches": ["dynamic", "static", "oscar-int2"],
        "decode": _DECODE,
        "prefill": {"context": 32768, "batch": 1, "warmup": 1, "repeats": 3, "caches": ["dynamic", "oscar-int2"]},
    },
    "memory": {
        "device": "cuda", "dtype": "bfloat16", "seed": 0, "models": ["qwen3-8b", "qwen3-4b"],
        "caches": ["dynamic", "oscar-int2"],
        "report": {"context": 131072, "batch": 1, "fill_chunk_rows": 65536},
        "max_batch": {"context": 100000, "reserve_bytes": 2 * 2**30, "budget_bytes": None, "step_down": 0.05,
                      "max_attempts": 6, "probe_up": True, "warmup_steps": 2, "steps": 8,
                      "fill_chunk_rows": 65536},
    },
    "graph": {
        "device": "cuda", "dtype": "bfloat16", "seed": 0, "models": ["qwen3-8b", "qwen3-4b"],
        "contexts": [32768, 65536, 100000], "batches": [1, 8],
        "caches": ["dynamic", "oscar-int2", "oscar-int2+graph"],
        "decode": {**_DECODE, "compiled_new_tokens": [8, 24], "bandwidth_bytes_per_s": None},
        "compiled_static": {"models": [], "contexts": [100000], "batches": [1, 8]},
        "profile": {"model": "qwen3-8b", "cache": "oscar-int2+graph", "context": 100000, "batch": 1,
                    "profile_steps": 5, "profile_top": 15},
    },
    "multigpu": {
        "dtype": "bfloat16", "seed": 0, "gpus": 2, "model": "qwen3-4b",
        "device_map": {"context": 32768, "batch": 1, "caches": ["dynamic", "oscar-int2"], **_DECODE},
        "tensor_parallel": {"model": "qwen3-4b", "context": 8192, "batch": 1, "new_tokens": 32,
                            "caches": ["dynamic", "oscar-int2"], "repeats": 3, "warmup_steps": 3, "steps": 16,
                            "single_gpu_reference": True, "timeout_s": 420},
    },
}  # fmt: skip


@dataclass(frozen=True)
class Benchmark:
    run: Callable[[dict], list[dict]]
    markdown: Callable[[dict], str]
    plot: Callable[[dict, Path], None]


BENCHMARKS = {
    "kernel": Benchmark(bench_kernel, kernel_markdown, kernel_plot),
    "e2e": Benchmark(bench_e2e, e2e_markdown, e2e_plot),
    "memory": Benchmark(bench_memory, memory_markdown, memory_plot),
    "graph": Benchmark(bench_graph, graph_markdown, graph_plot),
    "multigpu": Benchmark(bench_multigpu, multigpu_markdown, multigpu_plot),
}


def resolve_config(config: dict) -> dict:
    """The config over its benchmark's defaults."""
    if config.get("benchmark") not in BENCHMARKS:
        raise ValueError(f"config 'benchmark' must be one of {sorted(BENCHMARKS)}, got {config.get('benchmark')!r}")
    return deep_merge(DEFAULTS[config["benchmark"]], config)


def run_benchmark(config: dict, out_dir: Path, name: str, command: str) -> dict:
    """Run one benchmark and write ``<out_dir>/<name>.json``, ``.md`` and ``.png``; returns the result."""
    config = resolve_config(config)
    bench = BENCHMARKS[config["benchmark"]]
    started = time.perf_counter()
    torch.manual_seed(config.get("seed", 0))
    with torch.no_grad():
        cases = bench.run(config)
    result = {
        "name": name, "benchmark": config["benchmark"], "description": config.get("description", ""),
        **provenance(command),
        "seconds": round(time.perf_counter() - started, 1), "config": config, "cases": cases,
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / name
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, ensure_ascii=False, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    bench.plot(result, stem.with_suffix(".png"))
    return result


def markdown(result: dict) -> str:
    body = BENCHMARKS[result["benchmark"]].markdown(result)
    footer = f"{provenance_line(result)} ({result['seconds']} s)."
    description = f"{result['description']}\n\n" if result["description"] else ""
    return f"# {result['name']}\n\n{description}{body}\n\n{footer}\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", help="output file name (default: the config's name, else its file stem)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=JSON",
                        help="override a config field, e.g. --set batches=[1] --set decode.repeats=5")
    args = parser.parse_args(argv)
    config = apply_sets(json.loads(args.config.read_text()), args.sets)
    argv = sys.argv[1:] if argv is None else argv
    command = "python " + " ".join([Path(__file__).relative_to(REPO).as_posix(), *argv])
    result = run_benchmark(config, args.out, args.name or config.get("name") or args.config.stem, command)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
