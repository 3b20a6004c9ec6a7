"""Host time of one layer's decode attention, piece by piece, OscarCache against DynamicCache.

    python -m eval.host_time [--model qwen3-8b] [--context 100000] [--batch 1] [--iterations 300]

Eager batch-1 decoding is bound by host time (``kernels/measurements/profile_decode.json``), and cProfile
inflates Python-heavy code, so this times each piece without a profiler: ``--iterations`` calls in a
row after a warm-up, one synchronisation at the end, wall time a call. Where a piece's GPU time is
longer than its host time the number is the GPU time (``gpu_bound`` lists the pieces whose kernels
alone take that long). Layer 0 of a random-weight model's cache is filled with ``--context`` tokens
(OscarCache through its real write path). Writes ``<out>/host_time.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eval.benchmarks.caches import attention_for, fill_cache, make_cache
from eval.benchmarks.models import (
    add_model_arguments,
    build_model,
    input_device,
    random_rotations,
)
from eval.benchmarks.timing import synchronize
from oscar_hf.core.attention import oscar_attention_forward
from oscar_hf.kernels.decode_attention import decode_attention
from oscar_hf.kernels.rotate import rotate_rows
from oscar_hf.model_info import head_dim_of, text_config_of
from oscar_hf.provenance import command_line, machine_line, provenance


def per_call_us(fn, iterations: int, device: torch.device) -> float:
    for _ in range(100):  # past a demotion (every 64 tokens) and whatever it compiles
        fn()
    synchronize([device])
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    synchronize([device])
    return (time.perf_counter() - start) / iterations * 1e6


def step_inputs(model, batch: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q ``[B, Hq, 1, D]`` and K/V ``[B, Hkv, 1, D]`` laid out as a Qwen3 layer hands them to attention."""
    config = text_config_of(model)
    dim = head_dim_of(model)
    q = torch.randn(batch, 1, config.num_attention_heads, dim, device=device, dtype=dtype).transpose(1, 2)
    k, v = (
        torch.randn(batch, 1, config.num_key_value_heads, dim, device=device, dtype=dtype).transpose(1, 2) for _ in "kv"
    )
    return q, k, v


def oscar_pieces(model, batch: int, context: int, rotations, device: torch.device, iterations: int) -> dict:
    cache = make_cache("oscar-int2", model, context + 4096, rotations)
    fill_cache(cache, model, batch, context, 65536)
    layer, module = cache.layers[0], model.model.layers[0].self_attn
    q, k, v = step_inputs(model, batch, device, torch.bfloat16)
    scaling = module.scaling

    def whole_layer() -> None:  # cache.update + the attention function, as a decode step runs them
        keys, values = cache.update(k.clone(), v.clone(), 0)
        oscar_attention_forward(module, q, keys, values, None, scaling=scaling)

    key_rotation, value_rotation = layer.rotation_for("key", q), layer.rotation_for("value", q)
    outputs = [torch.empty(batch, t.shape[1], t.shape[-1], device=device, dtype=t.dtype) for t in (q, k, v)]
    out = torch.empty_like(outputs[0])

    def attention() -> None:  # over the layer's tiers as they stand (the new row already in the window)
        decode_attention(outputs[0], layer.decode_tiers(k[:, :, :0], v[:, :, :0]), sm_scale=scaling)

    pieces = {
        "oscar: update + attention (one layer)": whole_layer,
        "oscar: clone K and V (part of the line above)": lambda: (k.clone(), v.clone()),
        "oscar: decode_attention (span, dense tiers, merge)": attention,
        "oscar: rotate q, K, V (one launch)": lambda: rotate_rows(
            [(q, key_rotation, outputs[0]), (k, key_rotation, outputs[1]), (v, value_rotation, outputs[2])]
        ),
        "oscar: rotate the output back (one launch)": lambda: rotate_rows([(out, value_rotation.T, outputs[0])]),
        "torch: four rotation matmuls": lambda: (
            q @ key_rotation,
            k @ key_rotation,
            v @ value_rotation,
            out @ value_rotation.T,
        ),
    }
    return {name: per_call_us(fn, iterations, device) for name, fn in pieces.items()}


def dynamic_pieces(model, batch: int, context: int, device: torch.device, iterations: int) -> dict:
    """What a DynamicCache layer does per step: concatenate the new K/V to the cached ones, SDPA over them
    (the cache itself keeps its length here, so that every call costs what one at ``context`` does)."""
    config = text_config_of(model)
    shape = (batch, config.num_key_value_heads, context, head_dim_of(model))
    cached_k, cached_v = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in "kv")
    module = model.model.layers[0].self_attn
    q, k, v = step_inputs(model, batch, device, torch.bfloat16)

    def whole_layer() -> None:
        keys, values = torch.cat([cached_k, k], dim=-2), torch.cat([cached_v, v], dim=-2)
        sdpa_attention_forward(module, q, keys, values, None, scaling=module.scaling)

    return {"dynamic: cat K and V + SDPA (one layer)": per_call_us(whole_layer, iterations, device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--iterations", type=int, default=300)
    options = parser.parse_args()
    name, spec = options.model
    model = build_model({**spec, "num_hidden_layers": 1}, options.device, torch.bfloat16, attention_for("oscar-int2"))
    device = input_device(model)
    rotations = random_rotations(head_dim_of(model), [0])
    with torch.no_grad():
        times = {
            **oscar_pieces(model, options.batch, options.context, rotations, device, options.iterations),
            **dynamic_pieces(model, options.batch, options.context, device, options.iterations),
        }
    for piece, us in times.items():
        print(f"{us:9.1f} us  {piece}")
    info = {
        **provenance(command_line()),
        "model": name,
        "context": options.context,
        "batch": options.batch,
        "iterations": options.iterations,
        "us_per_call": times,
    }
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "host_time.json").write_text(json.dumps(info, indent=1))
    rows = "\n".join(f"| {piece} | {us:.1f} |" for piece, us in times.items())
    (options.out / "host_time.md").write_text(
        f"# Host time of one layer's decode attention\n\n{name}, context {options.context}, batch {options.batch}: "
        f"wall time a call over {options.iterations} calls in a row (host-bound pieces show host time).\n\n"
        f"| piece | us a call |\n|---|---|\n{rows}\n\n`{info['command']}` on {machine_line(info['machine'])}, "
        f"{info['date']}.\n"
    )
    plot(times, options.out / "host_time.png", f"{name}, {options.context} tokens, batch {options.batch}")


def plot(times: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 0.5 * len(times) + 1.2))
    axis.barh(list(times)[::-1], list(times.values())[::-1], color="tab:blue")
    axis.set_xlabel("us a call (wall, calls in a row)")
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
