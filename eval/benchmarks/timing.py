"""Timing: CUDA events on a GPU (``triton.testing`` for single kernels), ``time.perf_counter`` on CPU."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Iterable

import torch
from transformers import PreTrainedModel

from .cases import first_line


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
        times["graph_error"] = f"{type(error).__name__}: {first_line(error)}"
    return times


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
