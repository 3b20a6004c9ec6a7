"""Tensor-parallel decoding with OscarCache, one process per GPU:

    torchrun --standalone --nproc_per_node 2 -m eval.tp_decode --config eval/configs/bench_multigpu.json \
        [--out eval/results/tp_decode.json]

``python -m eval.bench_gpu --config eval/configs/bench_multigpu.json`` launches it this way. The
config's ``tensor_parallel`` section (or the whole file, if it has none) gives the model (a preset
name or Qwen3Config fields), ``context`` (prompt tokens), ``batch``, ``new_tokens``, ``caches``, the
timing repeats, ``per_head_rotations`` (one random R per KV head instead of one per layer) and
``widths_and_means`` (with per-head rotations: 4-bit keys in the first full-attention layer, 1-bit
values in the first and last, at the method's history bits, and a random key mean per KV head, as
calibrated sets carry them).

Rank 0 saves a random-weight Qwen3 to a temporary directory; every rank loads it with the model's
tensor-parallel plan (``tp_plan="auto"``). Per cache, each rank decodes greedily from the same random
prompt and the script checks that

* every OscarCache layer of a rank holds ``num_key_value_heads / world_size`` heads,
* every rank's OscarCache froze for decoding (plain ``generate`` on CUDA, or ``+frozen``), so each
  rank replays its own layers' graphs over its own heads,
* the greedy tokens are identical on all ranks,
* (``single_gpu_reference``) they equal those of the same model and cache on one GPU. With random
  weights the logits have near-ties, so a late divergence can come from bf16 reduction order in
  the all-reduce rather than from a bug: the first differing step is recorded, not asserted.

Then it times decoding after a real prefill (excluded from the timing), as bench_gpu's e2e does.
Rank 0 writes the JSON (command, machine, date, rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from eval.benchmarks import RESULTS
from eval.benchmarks.caches import attention_for, make_cache
from eval.benchmarks.cases import free_memory
from eval.benchmarks.config import deep_merge
from eval.benchmarks.decoding import decode_case, generate
from eval.benchmarks.models import (
    DTYPES,
    model_spec,
    random_rotations,
    random_tokens,
    save_random_model,
)
from eval.benchmarks.multigpu import DEFAULTS
from oscar_hf.core.compat import cache_keyword
from oscar_hf.model_info import full_attention_layer_ids, head_dim_of, text_config_of
from oscar_hf.provenance import command_line, provenance
from oscar_hf.rotations.rotation_set import RotationSet


def load_tensor_parallel(path: str, dtype: torch.dtype):
    """The saved model, sharded over the process group with the model's own TP plan."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers import DistributedConfig

        options = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except ImportError:  # older transformers 5.x take the plan directly
        options = {"tp_plan": "auto"}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **options).eval()


def local_device() -> torch.device:
    """This rank's GPU; the CPU (gloo) when there is none, which only a smoke test of the script uses."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shared_model_dir(spec: dict, dtype: torch.dtype, rank: int) -> str:
    """Rank 0 saves the random model; every rank gets the path (all ranks share one host)."""
    path = [None]
    if rank == 0:
        path[0] = tempfile.mkdtemp(prefix="oscar_tp_model_")
        save_random_model(spec, Path(path[0]), local_device(), dtype)
    dist.broadcast_object_list(path, src=0)
    return path[0]


def greedy(model, cache_name: str, prompt: torch.Tensor, new_tokens: int, rotations) -> tuple[list[list[int]], object]:
    """Greedy tokens after ``prompt`` (generate prefills it), and the cache it filled."""
    model.set_attn_implementation(attention_for(cache_name))
    cache = make_cache(cache_name, model, prompt.shape[1] + new_tokens + 8, rotations)
    tokens = generate(model, cache, prompt, new_tokens)[:, prompt.shape[1] :]
    return tokens.tolist(), cache


def cache_heads(cache, batch: int, head_dim: int) -> list[int]:
    """KV heads held by each OscarCache layer, from its public memory report."""
    if not hasattr(cache, "memory_report"):
        return []
    return [m.elements_per_token // (2 * batch * head_dim) for m in cache.memory_report().layers if m.kind == "oscar"]


def own_head_rotations(cache, rotations, rank: int, world: int) -> bool:
    """Whether every OscarCache layer of this rank holds the R_K, R_V (and key mean) of exactly its own
    KV heads, and the set's bit widths."""
    local = rotations.kv_heads // world
    own = rotations.select_kv_heads(rank * local, (rank + 1) * local)
    layers = [(i, layer) for i, layer in enumerate(cache.layers) if hasattr(layer, "key_rotation")]
    return bool(layers) and all(
        torch.equal(layer.key_rotation, own.key[i])
        and torch.equal(layer.value_rotation, own.value[i])
        and (i not in own.key_mean or torch.equal(layer.key_mean.cpu(), own.key_mean[i]))
        and layer.config.key.bits == own.key_bits.get(i, 2)
        and layer.config.value.bits == own.value_bits.get(i, 2)
        for i, layer in layers
    )


def with_widths_and_means(rotations: RotationSet, seed: int) -> RotationSet:
    """``rotations`` (per KV head) with 4-bit keys in the first layer and 1-bit values in the first and
    last (the same history bits) and a random key mean per KV head, so that tensor parallelism slices
    all a calibrated set carries."""
    generator = torch.Generator().manual_seed(seed)
    first, last = min(rotations.key), max(rotations.key)
    means = {i: torch.randn(r.shape[0], r.shape[-1], generator=generator) for i, r in rotations.key.items()}
    return dataclasses.replace(rotations, key_bits={first: 4}, value_bits={first: 1, last: 1}, key_mean=means)


def gather(value, world: int) -> list:
    """``value`` from every rank."""
    gathered = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Index of the first decoding step at which two batches of token lists differ (None: identical)."""

    def column(rows: list[list[int]], step: int) -> list[int | None]:
        return [row[step] if step < len(row) else None for row in rows]

    for step in range(max((len(row) for row in a + b), default=0)):
        if column(a, step) != column(b, step):
            return step
    return None


def prefill_fill(model, prompt: torch.Tensor):
    """A ``fill`` for ``decode_case``: a real prefill of all but the last prompt token."""

    def fill(cache) -> None:
        with torch.no_grad():
            model(prompt[:, :-1], **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)

    return fill


def single_gpu_tokens(path: str, dtype: torch.dtype, caches: list[str], prompt, new_tokens: int, rotations) -> dict:
    """Greedy tokens of the unsharded model on this rank's GPU, per cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": local_device()})
    tokens = {name: greedy(model.eval(), name, prompt, new_tokens, rotations)[0] for name in caches}
    del model
    free_memory()
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=RESULTS / "tp_decode.json")
    args = parser.parse_args()
    config = json.loads(args.config.read_text())
    config = deep_merge(DEFAULTS["tensor_parallel"], config.get("tensor_parallel", config))
    dtype = DTYPES[config.get("dtype", "bfloat16")]

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    name, spec = model_spec(config["model"])
    path = shared_model_dir(spec, dtype, rank)
    model = load_tensor_parallel(path, dtype)
    text = text_config_of(model)
    # per_head_rotations: one random R per KV head; each rank's cache then takes its own heads' R
    kv_heads = text.num_key_value_heads if config.get("per_head_rotations") else None
    rotations = random_rotations(head_dim_of(model), full_attention_layer_ids(model), config.get("seed", 0), kv_heads)
    if config.get("widths_and_means"):
        rotations = with_widths_and_means(rotations, config.get("seed", 0))
    batch, context, new_tokens = config["batch"], config["context"], config["new_tokens"]
    prompt = random_tokens(model, batch, context + 1)

    rows = []
    for cache_name in config["caches"]:
        tokens, cache = greedy(model, cache_name, prompt, new_tokens, rotations)
        frozen = all(gather(getattr(cache, "static", None) is not None, world))  # before the report thaws it
        heads = cache_heads(cache, batch, head_dim_of(model))
        identical = all(t == tokens for t in gather(tokens, world))
        row = {"cache": cache_name, "tokens": tokens, "identical_across_ranks": identical}
        if heads:
            row.update(
                heads_per_rank=sorted(set(heads)),
                frozen_on_every_rank=frozen,
                heads_per_rank_ok=set(heads) == {text.num_key_value_heads // world},
            )
        if heads and rotations.per_head:
            row["own_head_rotations_on_every_rank"] = all(
                gather(own_head_rotations(cache, rotations, rank, world), world)
            )
        del cache
        free_memory()
        row.update(decode_case(model, cache_name, prefill_fill(model, prompt), prompt, config, rotations))
        rows.append(row)

    if config["single_gpu_reference"]:
        del model
        free_memory()
        reference = single_gpu_tokens(path, dtype, config["caches"], prompt, new_tokens, rotations) if rank == 0 else {}
        for row in rows:
            if rank == 0:
                mismatch = first_mismatch(row["tokens"], reference[row["cache"]])
                row.update(matches_single_gpu=mismatch is None, first_mismatch_step=mismatch)
        dist.barrier()

    if rank == 0:
        result = {
            **provenance(command_line(f"torchrun --standalone --nproc_per_node {world} -m eval.tp_decode")),
            "seconds": round(time.perf_counter() - started, 1),
            "world_size": world,
            "model": name,
            "model_spec": spec,
            "context": context,
            "batch": batch,
            "new_tokens": new_tokens,
            "config": config,
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        for row in rows:
            print({k: v for k, v in row.items() if k not in ("tokens", "generate_ms_all")})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
