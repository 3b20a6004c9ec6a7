"""Smoke tests of the GPU benchmark suite (eval/bench_gpu.py, eval/benchmarks/) at tiny shapes on CPU.

They exercise every benchmark's code path and output files, not its numbers: on CPU the timings are
``time.perf_counter`` medians of a toy model. The multi-GPU benchmark takes its skip path; its
device_map part runs on one device, and eval/tp_decode.py runs under torchrun on 2 CPU processes (gloo).
With two CUDA GPUs, two more tests check device_map="auto" and tensor parallelism on them
(``bash eval/gpu_session.sh OUT multigpu-tests`` on the two-GPU machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval import bench_gpu, tp_decode
from eval.bench_gpu import resolve_config, run_benchmark
from eval.benchmarks import REPO, multigpu
from eval.benchmarks.caches import attention_for, fill_cache, make_cache, model_for, with_bundled_widths
from eval.benchmarks.cases import guarded, median_round
from eval.benchmarks.config import apply_sets, deep_merge
from eval.benchmarks.decoding import MEASURED, dense_kv_bytes, generate, roofline, with_bandwidth
from eval.benchmarks.graph import graph_variant
from eval.benchmarks.memory import predict_max_batch
from eval.benchmarks.models import (
    build_model,
    model_spec,
    random_rotations,
    random_tokens,
    save_random_model,
)
from eval.benchmarks.multigpu import device_map_cases, placement_check, tensors_of, torchrun_command
from oscar_hf.model_info import full_attention_layer_ids, head_dim_of
from oscar_hf.provenance import machine_info

TINY_MODEL = {
    "name": "tiny-qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
# Eight layers, so that device_map="auto" (balanced over the GPUs) spreads them over two.
SMALL_MODEL = {
    **TINY_MODEL,
    "name": "small-qwen3",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
}
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
TINY_DECODE = {"new_tokens": 3, "repeats": 1, "warmup_steps": 1, "steps": 2, "fill_chunk_rows": 256}
TINY_KERNEL = {
    "benchmark": "kernel",
    "device": "cpu",
    "shape": {"q_heads": 4, "kv_heads": 2, "head_dim": 64},
    "contexts": [400],
    "batches": [1],
    "timing": {"cpu_warmup": 0, "cpu_repeats": 1},
}


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matrices on a shared 2-core machine: thread hand-offs cost more than the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(config: dict, out: Path, name: str) -> dict:
    result = run_benchmark(config, out, name, f"pytest {name}")
    for suffix in (".json", ".md", ".png"):
        assert (out / f"{name}{suffix}").stat().st_size > 0
    saved = json.loads((out / f"{name}.json").read_text())
    assert saved["command"] == f"pytest {name}" and saved["date"].endswith("UTC")
    assert saved["machine"]["cpu_count"] and saved["machine"]["torch"] == torch.__version__
    return result


def _ok(rows: list[dict]) -> list[dict]:
    failed = [r for r in rows if r.get("status") not in ("ok", "skipped")]
    assert not failed, failed
    return [r for r in rows if r["status"] == "ok"]


def test_kernel_benchmark(tmp_path):
    rows = _run(TINY_KERNEL, tmp_path, "kernel")["cases"]
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == {"sdpa_bf16", "torch_dequant_sdpa", "oscar_triton"}
    for method in ("sdpa_bf16", "torch_dequant_sdpa"):
        row = by_method[method]
        assert row["status"] == "ok" and row["eager_us"] > 0 and row["graph_us"] is None
        assert row["speedup_eager_us"] > 0
    # BF16 reads the dense K/V; the INT2 path reads 2-bit codes, 4 bytes of metadata a row and the windows
    assert by_method["sdpa_bf16"]["bytes_read"] == (1 * 4 * 64 + 2 * 1 * 2 * 400 * 64) * 2
    history = 400 - 64 - 256 - 1
    windows = 2 * 2 * (64 + 256 + 1) * 64 * 2
    assert by_method["torch_dequant_sdpa"]["bytes_read"] == 4 * 64 * 2 + windows + 2 * 2 * history * (16 + 4)
    assert by_method["oscar_triton"]["status"] in ("ok", "skipped")  # ok when the interpreter is on


def test_kernel_benchmark_cli_runs_the_triton_kernel_in_the_interpreter(tmp_path):
    """The command line, with the Triton kernel interpreted on CPU and checked against its reference."""
    config = tmp_path / "configs" / "kernel_tiny.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_KERNEL))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable,
        "-m",
        "eval.bench_gpu",
        "--config",
        str(config),
        "--out",
        str(tmp_path),
        "--set",
        'methods=["sdpa_bf16", "oscar_triton"]',
    ]
    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "| 400 | 1 | oscar_triton |" in process.stdout  # the summary table
    result = json.loads((tmp_path / "kernel_tiny.json").read_text())
    assert result["command"].startswith("python -m eval.bench_gpu --config ") and "--set" in result["command"]
    kernel = next(r for r in result["cases"] if r["method"] == "oscar_triton")
    assert kernel["status"] == "ok" and kernel["check"] == "match" and kernel["max_abs_err"] < 2e-2, kernel
    assert kernel["speedup_eager_us"] > 0


def test_runs_of_one_benchmark_merge_into_one_result(tmp_path):
    """``--merge``: runs of one batch and width each become one result holding every case, marked with the
    width its run took, and each run's provenance."""
    methods = {"methods": ["sdpa_bf16"]}
    for batch in (1, 2):
        _run({**TINY_KERNEL, **methods, "batches": [batch], "k_bits": 2 * batch}, tmp_path, f"part_b{batch}")
    parts = [str(tmp_path / f"part_b{batch}.json") for batch in (1, 2)]
    result = bench_gpu.main(["--merge", *parts, "--name", "merged", "--out", str(tmp_path)])
    assert [(row["batch"], row["k_bits"]) for row in result["cases"]] == [(1, 2), (2, 4)]
    assert all("v_bits" not in row for row in result["cases"])  # the same in both runs
    assert result["config"]["batches"] == [1, 2] and [run["command"] for run in result["runs"]] == [
        "pytest part_b1",
        "pytest part_b2",
    ]
    page = (tmp_path / "merged.md").read_text()
    assert "| K bits |" in page and "| 400 | 2 | sdpa_bf16 | 4 |" in page
    assert "`pytest part_b1`" in page and "`pytest part_b2`" in page and (tmp_path / "merged.png").stat().st_size
    with pytest.raises(ValueError, match="one benchmark"):
        bench_gpu.merge_runs([result, {**result, "benchmark": "e2e"}], "mixed")
    first = json.loads(Path(parts[0]).read_text())  # a rerun of the same cases replaces them
    rerun = {**first, "cases": [{**case, "eager_us": -1.0} for case in first["cases"]]}
    merged = bench_gpu.merge_runs([first, rerun], "rerun")
    assert [case["eager_us"] for case in merged["cases"]] == [-1.0] * len(first["cases"]) and len(merged["runs"]) == 2
    again = bench_gpu.merge_runs([merged, first], "again")  # a merge is a part too: its runs come along
    assert [run["command"] for run in again["runs"]] == ["pytest part_b1"] * 3
    older = {**first, "config": {k: v for k, v in first["config"].items() if k != "k_bits"}}  # before a setting existed
    merged = bench_gpu.merge_runs([older, json.loads(Path(parts[1]).read_text())], "older")
    assert [row["k_bits"] for row in merged["cases"]] == [None, 4]
    narrow = {**first, "config": {**first["config"], "shape": {**first["config"]["shape"], "head_dim": 32}}}
    merged = bench_gpu.merge_runs([first, narrow], "shapes")  # runs of two head_dims keep both, marked
    head_dim = first["config"]["shape"]["head_dim"]
    assert [row["head_dim"] for row in merged["cases"]] == [head_dim] * len(first["cases"]) + [32] * len(first["cases"])
    assert "| head_dim |" in bench_gpu.markdown(merged)


def test_e2e_benchmark(tmp_path):
    config = {
        "benchmark": "e2e",
        "device": "cpu",
        "models": [TINY_MODEL],
        "contexts": [400],
        "batches": [1, 2],
        "decode": {**TINY_DECODE, "bandwidth_bytes_per_s": 1e11, "rounds": 2, "call_new_tokens": [2, 3]},
        "prefill": {"context": 384, "warmup": 0, "repeats": 1},
        "short_generations": {
            "prompts": 2,
            "prompt_tokens": [20, 40],
            "new_tokens": 3,
            "caches": ["dynamic", "oscar-int2"],
            "second_round": ["oscar-int2"],
        },
    }
    config["caches"] = ["dynamic", "static", "oscar-int2", "oscar-int2+absorbed"]
    rows = _ok(_run(config, tmp_path, "e2e")["cases"])
    short = {r["cache"]: r for r in rows if r["part"] == "short"}
    assert short["dynamic"]["short_wall_s"] == short["dynamic"]["short_first_round_s"] > 0
    assert short["oscar-int2"]["short_tokens_per_s"] == pytest.approx(2 * 3 / short["oscar-int2"]["short_wall_s"])
    assert "tokens/s 3 new, second call" in (tmp_path / "e2e.md").read_text()
    decode = [r for r in rows if r["part"] == "decode"]
    caches = ("dynamic", "static", "oscar-int2", "oscar-int2+absorbed")
    assert "Short generations" in (tmp_path / "e2e.md").read_text()
    assert "Rooflines at 100 GB/s" in (tmp_path / "e2e.md").read_text()
    assert {(r["batch"], r["cache"]) for r in decode} == {(b, c) for b in (1, 2) for c in caches}
    for row in decode:
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["speedup_tokens_per_s"] > 0
        assert row["roofline_ms"] > 0 and row["step_over_roofline"] == pytest.approx(
            row["step_ms"] / row["roofline_ms"]
        )
        bf16_over_own = row["bf16_roofline_ms"] / row["roofline_ms"]
        if row["cache"] == "dynamic":
            assert bf16_over_own == pytest.approx(1.0)
        else:  # StaticCache holds its capacity; OscarCache less than BF16
            assert bf16_over_own < 1 if row["cache"] == "static" else bf16_over_own > 1
        assert len(row["tokens_per_s_rounds"]) == 2 and row["tokens_per_s"] in row["tokens_per_s_rounds"]
        assert all(row[f"call{n}_{which}_tokens_per_s"] > 0 for n in (2, 3) for which in ("first", "second"))
    oscar = next(r for r in decode if r["cache"] == "oscar-int2" and r["batch"] == 1)
    dynamic = next(r for r in decode if r["cache"] == "dynamic" and r["batch"] == 1)
    assert oscar["kv_bytes"] < dynamic["kv_bytes"]
    assert {r["cache"] for r in rows if r["part"] == "prefill"} == {"dynamic", "oscar-int2"}


def test_graph_benchmark(tmp_path):
    """The CUDA-graph benchmark's path on CPU: static steps run uncaptured, the profile has no kernels."""
    config = {
        "benchmark": "graph",
        "device": "cpu",
        "models": [TINY_MODEL],
        "contexts": [400],
        "batches": [1, 2],
        "caches": [
            "dynamic",
            "oscar-int2",
            "oscar-int2+graph",
            "oscar-int2+absorbed+graph+fused",
            "oscar-int2+key-feedback+absorbed+graph+fused",
        ],
        "decode": {**TINY_DECODE, "compiled_new_tokens": [1, 2], "bandwidth_bytes_per_s": 1e11},
        "profile": {"model": "tiny-qwen3", "context": 400, "batch": 1, "profile_steps": 2, "profile_top": 3},
    }
    rows = _ok(_run(config, tmp_path, "graph")["cases"])
    decode = [r for r in rows if r["part"] == "decode"]
    assert {(r["batch"], r["cache"]) for r in decode} == {(b, c) for b in (1, 2) for c in config["caches"]}
    for row in decode:
        assert row["step_ms"] > 0 and row["roofline_ms"] > 0 and row["speedup_step_ms"] > 0
    graph = [r for r in decode if "+graph" in r["cache"]]
    assert all(r["generate_tokens_per_s"] > 0 and r["captured"] is False for r in graph)  # no CUDA here
    assert [r["kernel"] for r in rows if r["part"] == "profile"] == ["(all kernels)"]


def test_a_measured_roofline_rate_draws_no_roofline_on_cpu():
    model = build_model(TINY_MODEL, "cpu", torch.float32)
    assert roofline(model, 1000, 1.0, with_bandwidth(model, {"bandwidth_bytes_per_s": MEASURED}), 100, 1) == {}
    row = roofline(model, 1000, 1.0, {"bandwidth_bytes_per_s": 1e9}, 100, 1)
    assert row["bandwidth_bytes_per_s"] == 1e9 and row["bf16_roofline_ms"] > 0


def test_bf16_cache_bytes_count_a_sliding_layer_at_its_window():
    model = build_model(TINY_MODEL, "cpu", torch.bfloat16)
    per_token = 2 * 2 * 64 * 2  # K and V, 2 KV heads, head_dim 64, bf16
    assert dense_kv_bytes(model, 1000, 3) == 2 * 1000 * 3 * per_token
    config = model.config
    config.sliding_window, config.layer_types = 256, ["sliding_attention", "full_attention"]
    assert dense_kv_bytes(model, 1000, 3) == (256 + 1000) * 3 * per_token


def test_absorbed_case_folds_r_v_for_its_duration_only():
    model = build_model({k: v for k, v in TINY_MODEL.items() if k != "name"}, "cpu", torch.bfloat16)
    rotations = random_rotations(64, full_attention_layer_ids(model))
    before = {n: p.clone() for n, p in model.named_parameters()}
    with model_for(model, "oscar-int2+absorbed", rotations) as method:
        assert method == "oscar-int2"
        assert not torch.equal(
            model.model.layers[0].self_attn.v_proj.weight, before["model.layers.0.self_attn.v_proj.weight"]
        )
        assert make_cache(method, model, 64, rotations).values_prerotated
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not make_cache("oscar-int2", model, 64, rotations).values_prerotated
    assert make_cache("oscar-int2", model, 64, rotations).decode_graphs is None  # the library's default
    eager = make_cache("oscar-int2+eager-layout", model, 64, rotations)
    assert eager.decode_graphs is False and eager.oscar_config.method == "oscar-int2"
    frozen = make_cache("oscar-int2+frozen", model, 64, rotations)
    assert frozen.decode_graphs is True and frozen.oscar_config.method == "oscar-int2"
    mixed = make_cache("oscar-int2+mixed-widths+frozen", model, 64, rotations)
    assert mixed.decode_graphs is True and mixed.oscar_config.method == "oscar-int2"


def test_key_feedback_suffix_gives_the_keys_factors():
    model = build_model({k: v for k, v in TINY_MODEL.items() if k != "name"}, "cpu", torch.bfloat16)
    rotations = random_rotations(64, full_attention_layer_ids(model), kv_heads=2)
    plain, fed_back = (make_cache(name, model, 64, rotations) for name in ("oscar-int2", "oscar-int2+key-feedback"))
    assert all(layer.key_feedback is None for layer in plain.layers)
    factors = [layer.key_feedback for layer in fed_back.layers]
    assert all(f.shape == (2, 64, 64) and torch.equal(f, f.triu()) for f in factors)
    assert all(torch.all(f.diagonal(dim1=-2, dim2=-1) == 1) and not torch.equal(f, torch.eye(64)) for f in factors)
    mixed = make_cache("oscar-int2+key-feedback+mixed-widths", model, 64, rotations)
    widths = [(layer.config.key.bits, layer.config.value.bits) for layer in mixed.layers]
    assert widths == [
        (layer.config.key.bits, layer.config.value.bits)
        for layer in make_cache("oscar-int2+mixed-widths", model, 64, rotations).layers
    ]
    assert all(layer.key_feedback is not None for layer in mixed.layers if layer.config.key.bits > 1)


def test_mixed_widths_map_the_bundled_pattern_by_depth():
    from oscar_hf.rotations.files import load_ours
    from oscar_hf.rotations.resolve import DEFAULT_ROTATIONS, bundled_rotations_dir

    bundled = load_ours(bundled_rotations_dir(DEFAULT_ROTATIONS))
    same = with_bundled_widths(random_rotations(64, list(range(30))))
    assert same.key_bits == bundled.key_bits and same.value_bits == bundled.value_bits and bundled.key_bits
    twice = with_bundled_widths(random_rotations(64, list(range(60))))
    assert twice.key_bits == {layer: bits for i, bits in bundled.key_bits.items() for layer in (2 * i, 2 * i + 1)}
    assert len(twice.value_bits) == 2 * len(bundled.value_bits)
    for depth in (2, 13, 36):  # 13 leaves too many 1-bit values, 2 and 36 (the 8B shape) too many wide keys
        mixed = with_bundled_widths(random_rotations(64, list(range(depth))))
        key_bits_over_base = sum(bits - 2 for bits in mixed.key_bits.values())
        assert key_bits_over_base == sum(2 - bits for bits in mixed.value_bits.values())  # oscar-int2's bits
        assert set(mixed.key_bits) | set(mixed.value_bits) <= set(range(depth))
    assert len(mixed.key_bits) >= len(bundled.key_bits) and len(mixed.value_bits) >= len(bundled.value_bits)
    model = build_model({k: v for k, v in TINY_MODEL.items() if k != "name"}, "cpu", torch.bfloat16)
    rotations = dataclasses.replace(
        random_rotations(64, full_attention_layer_ids(model)), key_bits={1: 4}, value_bits={0: 1, 1: 1}
    )
    widths = [
        (layer.config.key.bits, layer.config.value.bits)
        for layer in make_cache("oscar-int2", model, 64, rotations).layers
    ]
    assert widths == [(2, 1), (4, 1)]  # a benchmark's oscar-int2 takes a set's per-layer widths


@pytest.mark.parametrize("cache_name", ["dynamic", "static", "oscar-int2"])
def test_generate_over_a_filled_cache_runs_only_the_new_tokens(cache_name):
    """The e2e timing relies on generate continuing from the synthetic context, not prefilling it again."""
    model = build_model({k: v for k, v in TINY_MODEL.items() if k != "name"}, "cpu", torch.bfloat16)
    model.set_attn_implementation(attention_for(cache_name))
    rotations = random_rotations(64, full_attention_layer_ids(model))
    cache = make_cache(cache_name, model, 400, rotations)
    with torch.no_grad():
        fill_cache(cache, model, batch=2, context=350, chunk_rows=256)
        assert int(cache.get_seq_length()) == 350
        out = generate(model, cache, random_tokens(model, 2, 351), new_tokens=4)
    assert out.shape == (2, 355)
    assert int(cache.get_seq_length()) == 350 + 4  # the last prompt token and 3 of the 4 generated ones
    if cache_name == "oscar-int2":
        report = cache.memory_report()
        assert report.layers[0].sink_tokens == 64 and report.layers[0].history_tokens > 0


def test_memory_benchmark(tmp_path):
    config = {
        "benchmark": "memory",
        "device": "cpu",
        "models": [TINY_MODEL],
        "report": {"context": 512, "fill_chunk_rows": 256},
        "max_batch": {"context": 400, "budget_bytes": 2_000_000, "warmup_steps": 0, "steps": 1, "fill_chunk_rows": 512},
    }
    rows = _ok(_run(config, tmp_path, "memory")["cases"])
    report = {r["cache"]: r for r in rows if r["part"] == "report"}
    assert report["dynamic"]["bits_per_element"] == 16 and report["oscar-int2"]["kv_ratio_vs_bf16"] > 1
    for row in (r for r in rows if r["part"] == "max_batch"):
        # no activation overhead is measurable on CPU, and nothing runs out: the prediction holds
        assert row["predicted_batch"] == 2_000_000 // row["kv_bytes_per_sequence"] >= 4
        assert row["max_batch"] >= row["predicted_batch"]
        assert row["tokens_per_s"] > 0
    by_cache = {r["cache"]: r for r in rows if r["part"] == "max_batch"}
    assert by_cache["oscar-int2"]["max_batch"] > by_cache["dynamic"]["max_batch"]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="with 2 GPUs the benchmark runs instead of skipping")
def test_multigpu_benchmark_skips_without_two_gpus(tmp_path):
    rows = _run({"benchmark": "multigpu"}, tmp_path, "multigpu")["cases"]
    assert [r["part"] for r in rows] == ["device_map", "tensor_parallel"]
    assert all(r["status"] == "skipped" and "needs 2 CUDA GPUs" in r["reason"] for r in rows)


def test_committed_configs_resolve():
    configs = sorted((REPO / "eval" / "configs").glob("bench_*.json"))
    assert [c.stem for c in configs] == ["bench_e2e", "bench_graph", "bench_kernel", "bench_memory", "bench_multigpu"]
    for path in configs:
        config = resolve_config(json.loads(path.read_text()))
        assert config["description"]
        for entry in config.get("models", []) + [config.get("model")] * ("model" in config):
            name, spec = model_spec(entry)
            assert spec["num_key_value_heads"] == 8 and spec["head_dim"] == 128, name


def test_sass_count_compiles_the_decode_kernel_for_sm90_without_a_gpu():
    """kernels/tools/sass_count.py: the history loop of the compiled kernel, counted from its SASS, at
    2-bit K and V and with the PTX unpacking of 1-bit values and 3-bit keys (which ptxas must accept)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = REPO / "kernels" / "tools" / "sass_count.py"
    command = [sys.executable, str(tool), "--warps", "1", "--bits", "2/2", "2/1", "3/2"]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("stage 1")] == [
        "stage 1, K2 V2, head_dim 128",
        "stage 1, K2 V1, head_dim 128",
        "stage 1, K3 V2, head_dim 128",
    ]
    for tile in out.split("history loop: ")[1:]:
        per_key = float(tile.split("= ")[1].split(" warp-instructions")[0])
        assert 10 < per_key < 100 and "HMMA" in tile


def test_helpers():
    overridden = apply_sets({"a": {"b": 1}}, ["a.b=2", "c=[1, 2]", "d=text"])
    assert overridden == {"a": {"b": 2}, "c": [1, 2], "d": "text"}
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}
    assert tp_decode.first_mismatch([[1, 2, 3]], [[1, 2, 3]]) is None
    assert tp_decode.first_mismatch([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]]) == 1
    assert predict_max_batch(per_sequence=10, fixed=5, budget=100) == 9
    command = torchrun_command(2, Path("c.json"), Path("o.json"))
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert command[5:7] == ["-m", "eval.tp_decode"]
    _, spec = model_spec({"preset": "qwen3-8b", "num_hidden_layers": 2})
    assert spec["hidden_size"] == 4096 and spec["num_hidden_layers"] == 2
    plain = {"compile": False, "fuse_projections": False}
    assert graph_variant("oscar-int2") == ("oscar-int2", False, plain)
    assert graph_variant("oscar-int2+absorbed+graph+compile") == (
        "oscar-int2+absorbed",
        True,
        {**plain, "compile": True},
    )
    assert graph_variant("oscar-int2+graph+autotune+fused") == (
        "oscar-int2",
        True,
        {"compile": "max-autotune-no-cudagraphs", "fuse_projections": True},
    )
    assert graph_variant("oscar-int2+graph+fused") == ("oscar-int2", True, {**plain, "fuse_projections": True})
    with pytest.raises(ValueError, match="after '\\+graph'"):
        graph_variant("oscar-int2+graph+compiled")


def test_guarded_records_errors_and_out_of_memory():
    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    row = guarded({"a": 1}, out_of_memory)
    assert row == {"a": 1, "status": "oom", "error": "CUDA out of memory. Tried to allocate 2.00 GiB"}
    row = guarded({}, lambda: 1 / 0)
    assert row["status"] == "error" and row["error"].startswith("ZeroDivisionError")
    assert guarded({}, lambda: {"x": 2}) == {"x": 2, "status": "ok"}


def test_placement_check_finds_every_cache_tensor():
    model = build_model({k: v for k, v in TINY_MODEL.items() if k != "name"}, "cpu", torch.bfloat16)
    cache = make_cache("oscar-int2", model, 400, random_rotations(64, [0, 1]))
    fill_cache(cache, model, batch=1, context=400, chunk_rows=256)
    assert placement_check(model)(cache) == {"buffers_on_layer_device": True, "cache_devices": ["cpu"]}
    names = [name for name, _ in tensors_of(cache.layers[0])]
    assert any("history" in name for name in names) and any("sink" in name for name in names)
    # a tensor on the wrong device is reported (meta stands in for another GPU)
    cache.layers[1].stray = torch.empty(1, device="meta")
    with pytest.raises(AssertionError, match="off their layer's device"):
        placement_check(model)(cache)


def test_device_map_part_on_one_cpu(tmp_path, monkeypatch):
    """The device_map flow (save, from_pretrained(device_map="auto"), fill per layer device, placement check)."""
    monkeypatch.setattr(
        multigpu, "save_random_model", lambda spec, path, device, dtype: save_random_model(spec, path, "cpu", dtype)
    )
    config = resolve_config(
        {
            "benchmark": "multigpu",
            "model": TINY_MODEL,
            "device_map": {"context": 400, "batch": 1, **TINY_DECODE},
        }
    )
    rows = _ok(device_map_cases(config, gpus=1))
    assert [r["cache"] for r in rows] == ["dynamic", "oscar-int2"]
    # on a GPU machine device_map="auto" puts the tiny model on cuda:0 instead, which works the same
    assert rows[1]["buffers_on_layer_device"] and rows[1]["cache_devices"] == rows[1]["model_devices"]


@pytest.mark.parametrize(
    "per_head, widths_and_means", [(False, False), (True, False), (True, True)], ids=["shared", "per-head", "mixed"]
)
def test_tp_decode_script_on_cpu_with_gloo(tmp_path, per_head, widths_and_means):
    """eval/tp_decode.py under torchrun with 2 CPU processes: sharded heads, identical tokens, JSON.
    With per-head rotations each rank's cache takes its own KV head's R (and key mean, and the set's
    per-layer bit widths: ``mixed``), and the float32 tokens equal the unsharded model's."""
    model = {**TINY_MODEL, "hidden_size": 128, "intermediate_size": 256}
    config = tmp_path / "tp.json"
    config.write_text(
        json.dumps(
            {
                "tensor_parallel": {
                    "model": model,
                    "context": 400,
                    "batch": 2,
                    "new_tokens": 4,
                    "repeats": 1,
                    "warmup_steps": 1,
                    "steps": 2,
                    "dtype": "float32",
                    "caches": ["dynamic", "oscar-int2", "oscar-int2+frozen"],
                    "per_head_rotations": per_head,
                    "widths_and_means": widths_and_means,
                }
            }
        )
    )
    out = tmp_path / "tp_result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU even beside a GPU
    process = subprocess.run(
        torchrun_command(2, config, out), env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["command"].startswith("torchrun --standalone --nproc_per_node 2")
    rows = {r["cache"]: r for r in result["rows"]}
    for name in ("oscar-int2", "oscar-int2+frozen"):
        assert rows[name]["heads_per_rank"] == [1] and rows[name]["heads_per_rank_ok"]
        assert rows[name].get("own_head_rotations_on_every_rank") is (True if per_head else None)
    # each rank freezes its own cache (on CPU only when asked; on CUDA plain generate does it)
    assert rows["oscar-int2+frozen"]["frozen_on_every_rank"] and not rows["oscar-int2"]["frozen_on_every_rank"]
    for row in rows.values():
        assert row["identical_across_ranks"] and row["tokens_per_s"] > 0
        assert row["matches_single_gpu"], row
        assert row["matches_single_gpu"], row  # float32 on CPU: sharding must not change greedy tokens


@TWO_GPUS
def test_device_map_auto_over_two_gpus(tmp_path):
    """Each OscarCache layer lives on its layer's GPU, and plain generate (eager there, replayed steps on
    one GPU) gives the tokens of the same model on one GPU. The prompt outgrows the sink and the window, so the history is INT2."""
    from transformers import AutoModelForCausalLM

    _, spec = model_spec(SMALL_MODEL)
    save_random_model(spec, tmp_path, "cuda:0", torch.bfloat16)
    spread = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto", dtype=torch.bfloat16).eval()
    single = AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": 0}, dtype=torch.bfloat16).eval()
    rotations = random_rotations(head_dim_of(single), full_attention_layer_ids(single))
    prompt = random_tokens(single, 2, 700)
    tokens, devices = {}, {}
    for name, model in (("spread", spread), ("single", single)):
        tokens[name], cache = tp_decode.greedy(model, "oscar-int2", prompt, 8, rotations)
        devices[name] = placement_check(model)(cache)["cache_devices"]
    assert devices == {"spread": ["cuda:0", "cuda:1"], "single": ["cuda:0"]}
    assert tokens["spread"] == tokens["single"]


@TWO_GPUS
def test_tp_decode_on_two_gpus(tmp_path):
    """tp_plan="auto" under torchrun, 2 ranks over NCCL: each rank caches half the KV heads, freezes its own
    cache (plain generate's per-layer graphs) and decodes the same tokens as the other rank."""
    config = tmp_path / "tp.json"
    config.write_text(
        json.dumps(
            {
                "tensor_parallel": {
                    "model": SMALL_MODEL,
                    "context": 700,
                    "batch": 2,
                    "new_tokens": 8,
                    "repeats": 1,
                    "warmup_steps": 1,
                    "steps": 2,
                    "dtype": "bfloat16",
                    "caches": ["dynamic", "oscar-int2"],
                }
            }
        )
    )
    out = tmp_path / "tp_result.json"
    process = subprocess.run(torchrun_command(2, config, out), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert process.returncode == 0, process.stderr[-3000:]
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    oscar = rows["oscar-int2"]
    assert oscar["heads_per_rank"] == [1] and oscar["heads_per_rank_ok"] and oscar["frozen_on_every_rank"]
    for row in rows.values():
        assert row["identical_across_ranks"] and row["tokens_per_s"] > 0
        assert row["matches_single_gpu"], row


def test_step_times_reports_each_steps_wall_time(tmp_path):
    """eval/step_times.py on CPU: one time per decode step, and its files."""
    from eval import step_times

    spec = {k: v for k, v in TINY_MODEL.items() if k != "name"}
    model = build_model(spec, "cpu", torch.bfloat16)
    rotations = random_rotations(64, full_attention_layer_ids(model))
    times, preparation = step_times.step_ms(
        model, "oscar-int2", batch=1, context=300, new_tokens=6, rotations=rotations
    )
    assert len(times) == 6 and all(t > 0 for t in times)
    assert 0 < preparation < times[0]  # generate's preparation is part of the first step
    row = step_times.summary(times, preparation)
    assert row["first_steps_ms"] == times[:3] and row["steady_step_ms"] > 0
    assert row["forwards_one_time_ms"] == pytest.approx(row["one_time_ms"] - preparation)
    slower, faster = ({**row, "steady_step_ms": row["steady_step_ms"] * factor} for factor in (3.0, 0.5))
    reported = median_round([slower, row, faster], "steady_step_ms", higher_is_faster=False)
    assert reported["steady_step_ms"] == row["steady_step_ms"]
    assert reported["steady_step_ms_rounds"] == [
        slower["steady_step_ms"],
        row["steady_step_ms"],
        faster["steady_step_ms"],
    ]
    options = argparse.Namespace(caches=["oscar-int2"], rounds=2, context=300, new_tokens=6)
    measured = step_times.measure_batch(model, 2, options, rotations)
    assert len(measured["oscar-int2"]["steady_step_ms_rounds"]) == 2 and "first_call" in measured["oscar-int2"]
    step_times.write(
        tmp_path,
        {
            "command": "x",
            "machine": machine_info(),
            "date": "d",
            "model": "tiny",
            "context": 300,
            "new_tokens": 6,
            "rounds": 3,
            "batches": {"1": {"oscar-int2": {**reported, "first_call": faster}}, "2": measured},
        },
    )
    table = (tmp_path / "step_times.md").read_text()
    assert f"| 1 | oscar-int2 | {faster['one_time_ms']:.1f} |" in table and "| 2 | oscar-int2 |" in table
    assert (tmp_path / "step_times.png").stat().st_size > 0


def test_calibration_cost_times_each_stage_of_a_recipe(tmp_path):
    """eval/calibration_cost.py on CPU: the full recipe's four stages, each recorded, and its files."""
    from eval import calibration_cost

    spec = {k: v for k, v in TINY_MODEL.items() if k != "name"}
    model = build_model(spec, "cpu", torch.bfloat16)
    batches = [random_tokens(model, 1, 700, seed=index) for index in range(2)]
    recipe = calibration_cost.Recipe(
        per_head=True, center_keys=True, allocate_bits=1, tokens=1400, seq_len=700, feedback_seq_len=600
    )
    assert [r.shape for r in calibration_cost.feedback_rows(model, recipe)] == [(1, 600)] * 3  # 1,400 rounded up
    rows = []
    calibration_cost.recipe_stages(model, batches, recipe, torch.device("cpu"), rows.append)
    assert [row["stage"] for row in rows] == ["covariances", "fit", "key feedback", "bit allocation"]
    assert all(row["seconds"] > 0 and row["peak_gpu_gib"] is None and row["peak_host_gib"] > 0 for row in rows)
    result = {
        "command": "x",
        "machine": machine_info(),
        "date": "d",
        "model": "tiny",
        "weights_gib": calibration_cost.weights_gib(model),
        "dtype": "bfloat16",
        "device": "cpu",
        "tokens": 1400,
        "seq_len": 700,
        "recipes": {"full": rows},
        "recipe_arguments": {"full": "Recipe(per_head=True)"},
    }
    calibration_cost.write(tmp_path, result)
    total = sum(row["seconds"] for row in rows)
    assert f"| full | **all stages** | **{total:.1f}** |" in (tmp_path / "calibration_cost.md").read_text()
    assert (tmp_path / "calibration_cost.png").stat().st_size > 0
