"""Soak: 10,000+ decode steps of a tiny model with small windows, per method, eager and frozen.

    python -m eval.soak [--steps 10000] [--methods none oscar-int2 ...] [--modes eager frozen]
                        [--check-every 500] [--out eval/results]

A tiny random Llama (2 layers, 2 KV heads of 16 dims) decodes a batch of 2 by sampling, one token a
step, through an ``OscarCache`` with a 4-token sink, an 8-token recent window and blocks of 2, so
that a block is demoted every other step. ``eager`` is ``decode_graphs=False``; ``frozen`` is
``decode_graphs=True``, the static layout (on CPU without CUDA graphs), which grows its history
by ``MAX_SLACK_ROWS`` rows when full. Calibrated methods get random orthogonal rotations.

At the first demotion after every ``--check-every`` steps it checks:

* lengths: the cache's length is the tokens fed, every layer's sink + history + window adds up to it
  and the layers agree;
* tiers: the sink holds its 4 tokens, the window between ``recent`` and ``recent + block - 1``;
* bounded buffers: the window's storage never grows after the first check; the history's storage
  holds its rows and grew only when they filled it, by at most half of itself or ``MAX_SLACK_ROWS``
  rows (``none`` keeps everything in its window: that storage follows the same rule);
* flat memory: the bytes of the cache's tensors other than the growing tier stay constant, and
  neither the number of Python objects nor the Python heap (tracemalloc) grows with the steps;
* recall: the rows the step demotes, read back from the history, equal the quantizer's round trip
  (``oscar_hf.quant``) of their rotated rows as the window held them.

Writes ``<out>/soak.{json,md,png}`` (memory and step time over the steps per method and mode) with the
command, machine and date, and exits with status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eval.benchmarks.models import random_rotations
from oscar_hf import METHODS, OscarCache, cache_keyword
from oscar_hf.core.storage import MAX_SLACK_ROWS, aligned_rows
from oscar_hf.provenance import command_line, provenance, provenance_line
from oscar_hf.quant import QuantizedRows, dequantize, quantize

REPO = Path(__file__).resolve().parent.parent

WINDOWS = dict(sink=4, recent=8, block=2)
MODEL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=65536,
)
BATCH, PROMPT = 2, 24
MODES = {"eager": False, "frozen": True}  # OscarCache(decode_graphs=...)
MIN_ROWS = 64  # a buffer's first allocation (oscar_hf.core.storage)
# What a run may gain after its first check, whatever its length: Python objects the garbage collector
# tracks (a step leaking one is caught within this many steps; the count is flat from the first
# hundred steps on), and bytes of Python heap, where the interpreter's free lists (of tuples...)
# fill up over the first ~1,000 steps (~200 KiB).
PYTHON_OBJECT_SLACK = 64
PYTHON_HEAP_SLACK = 512 * 1024


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).eval()
    model.set_attn_implementation("oscar")
    return model


# ---------------------------------------------------------------------------------- reading a layer


def tiers(layer) -> tuple[int, int, int]:
    """(sink, history, window) rows of an OscarLayer, eager or frozen."""
    if layer.static is not None:
        return layer.static.sink_rows, layer.static.history_rows, layer.static.ring_rows
    return layer.sink_keys.length, layer.history_length, layer.recent_keys.length


def rows_allocated(layer) -> tuple[int, int]:
    """Rows the (history, window) storage has room for."""
    history = 0 if layer.history_keys is None else layer.history_keys.codes.data.shape[2]
    return history, layer.recent_keys.data.shape[2]


def tensor_bytes(layer) -> tuple[int, int]:
    """Allocated bytes of the (history, sink and window) tensors of a layer."""
    history = [b for h in (layer.history_keys, layer.history_values) if h is not None for b in h.buffers()]
    windows = [layer.sink_keys, layer.sink_values, layer.recent_keys, layer.recent_values]
    return tuple(sum(b.data.numel() * b.data.element_size() for b in buffers) for buffers in (history, windows))


def oldest_window_rows(layer, count: int) -> list[torch.Tensor]:
    """Copies of the window's oldest ``count`` rotated K and V rows (the frozen ring's from its start)."""
    if layer.static is not None:
        start = layer.static.ring_start
        return [b.data[:, :, start : start + count].clone() for b in (layer.recent_keys, layer.recent_values)]
    return [b.view()[:, :, :count].clone() for b in (layer.recent_keys, layer.recent_values)]


def newest_history_rows(layer, count: int) -> list[torch.Tensor]:
    """The history's newest ``count`` K and V rows, dequantized."""
    rows = tiers(layer)[1]
    dense = []
    for history in (layer.history_keys, layer.history_values):
        packed = history.whole() if layer.static is not None else history.packed()
        tail = QuantizedRows(*(t[:, :, rows - count : rows] for t in (packed.codes, packed.scale, packed.zero)))
        dense.append(dequantize(tail, history.bits, history.group_size, layer.dtype))
    return dense


def roundtrip(rows: torch.Tensor, spec, metadata_dtype: torch.dtype) -> torch.Tensor:
    """What rotated ``rows`` become in a history of format ``spec``, by the quantizer itself."""
    group = spec.group_of(rows.shape[-1])
    packed = quantize(
        rows, spec.bits, group, symmetric=spec.symmetric, clip_ratio=spec.clip_ratio, metadata_dtype=metadata_dtype
    )
    return dequantize(packed, spec.bits, group, rows.dtype)


def growth_bound(rows: int, frozen: bool) -> int:
    """The most rows storage holding ``rows`` may have: from a first ``MIN_ROWS`` it grows by half of
    itself, by at most ``MAX_SLACK_ROWS``; a frozen cache's history regrows by ``MAX_SLACK_ROWS`` rows."""
    slack = MAX_SLACK_ROWS if frozen else min(rows // 2, MAX_SLACK_ROWS)
    return aligned_rows(max(MIN_ROWS, rows + slack + WINDOWS["block"]))


# ---------------------------------------------------------------------------------------- a run


@dataclass
class Sample:
    """The state at one check."""

    step: int
    length: int
    sink: int
    history: int
    window: int
    history_rows_allocated: int
    window_rows_allocated: int
    history_bytes: int
    other_bytes: int
    python_heap_bytes: int
    python_objects: int  # tracked by the garbage collector, not counting the run's own samples
    frozen: bool
    step_ms: float  # mean over the steps since the previous check


@dataclass
class Run:
    method: str
    mode: str
    steps: int = 0
    seconds: float = 0.0
    probes: int = 0
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def fail(self, step: int, message: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(f"step {step}: {message}")


class Soak:
    """One method in one mode: decodes ``steps`` tokens and checks the cache as it goes."""

    def __init__(self, model, method: str, mode: str, rotations, check_every: int):
        self.model, self.check_every = model, check_every
        self.cache = OscarCache(model, method, rotations=rotations, decode_graphs=MODES[mode], **WINDOWS)
        self.quantized = self.cache.oscar_config.quantized
        self.run = Run(method, mode)
        self.generator = torch.Generator().manual_seed(0)
        self.keyword = cache_keyword(model)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(tokens, **{self.keyword: self.cache}, use_cache=True).logits[:, -1]
        return torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=self.generator)

    def soak(self, steps: int) -> Run:
        run, cache = self.run, self.cache
        times = torch.zeros(steps, dtype=torch.float64)  # allocated before tracing: the heap must stay flat
        tracemalloc.start()
        started = time.perf_counter()
        token = self.step(torch.randint(3, MODEL["vocab_size"], (BATCH, PROMPT), generator=self.generator))
        next_check, last_check = self.check_every, 0
        for step in range(1, steps + 1):
            first = cache.layers[0]
            probing = (
                step >= next_check and self.quantized and tiers(first)[2] + 1 >= WINDOWS["recent"] + WINDOWS["block"]
            )
            before = (
                (tiers(first)[1], [oldest_window_rows(layer, WINDOWS["block"]) for layer in cache.layers])
                if probing
                else None
            )
            clock = time.perf_counter()
            token = self.step(token)
            times[step - 1] = time.perf_counter() - clock
            if probing or (step >= next_check and not self.quantized) or step == steps:
                if before is not None:
                    self.probe(step, before)
                self.check(step, float(times[last_check:step].mean()) * 1e3)
                next_check, last_check = (step // self.check_every + 1) * self.check_every, step
        tracemalloc.stop()
        run.steps, run.seconds = steps, time.perf_counter() - started
        return run

    # ------------------------------------------------------------------------------------- checks
    def probe(self, step: int, before: tuple[int, list[list[torch.Tensor]]]) -> None:
        """The rows this step demoted, read back from each layer's history, against the quantizer."""
        self.run.probes += 1
        history, window = before
        demoted = tiers(self.cache.layers[0])[1] - history
        if demoted != WINDOWS["block"]:
            self.run.fail(step, f"a full window demoted {demoted} rows, not a block of {WINDOWS['block']}")
            return
        for index, (layer, window_rows) in enumerate(zip(self.cache.layers, window)):
            read = newest_history_rows(layer, WINDOWS["block"])
            for name, rows, got, spec in zip("KV", window_rows, read, (layer.config.key, layer.config.value)):
                want = roundtrip(rows, spec, layer.config.metadata_dtype)
                if not torch.equal(got, want):
                    error = (got - want).abs().max().item()
                    self.run.fail(
                        step, f"layer {index} {name}: demoted rows read back {error:.3g} off their round trip"
                    )

    def check(self, step: int, step_ms: float) -> None:
        run, cache, fail = self.run, self.cache, self.run.fail
        length = PROMPT + step
        if cache.get_seq_length() != length:
            fail(step, f"cache length {cache.get_seq_length()} != {length} tokens fed")
        layers = cache.layers
        states = [tiers(layer) for layer in layers]
        if len(set(states)) > 1:
            fail(step, f"layers disagree on (sink, history, window): {states}")
        sink, history, window = states[0]
        if sink + history + window != length:
            fail(step, f"sink {sink} + history {history} + window {window} != {length}")
        if sink != WINDOWS["sink"]:
            fail(step, f"the sink holds {sink} tokens, not {WINDOWS['sink']}")
        if self.quantized and (cache.static is not None) != MODES[run.mode]:
            fail(step, f"the cache is {'not ' * (cache.static is None)}frozen in mode {run.mode}")
        if self.quantized and not WINDOWS["recent"] <= window < WINDOWS["recent"] + WINDOWS["block"]:
            fail(step, f"the window holds {window} tokens, outside [recent, recent + block - 1]")
        history_rows, window_rows = zip(*(rows_allocated(layer) for layer in layers))
        history_bytes, other_bytes = (sum(column) for column in zip(*(tensor_bytes(layer) for layer in layers)))
        gc.collect()
        objects = len(gc.get_objects()) - len(run.samples)
        sample = Sample(
            step,
            length,
            sink,
            history,
            window,
            max(history_rows),
            max(window_rows),
            history_bytes,
            other_bytes,
            tracemalloc.get_traced_memory()[0],
            objects,
            cache.static is not None,
            step_ms,
        )
        self.check_storage(sample, history_rows, window_rows)
        run.samples.append(sample)

    def check_storage(self, sample: Sample, history_rows: tuple[int, ...], window_rows: tuple[int, ...]) -> None:
        """Bounded buffers and flat memory, against the first check (and the previous one)."""
        fail, step = self.run.fail, sample.step
        growing, fixed = (history_rows, window_rows) if self.quantized else (window_rows, None)
        need = sample.history if self.quantized else sample.window
        bound = growth_bound(need, self.cache.static is not None)
        if min(growing) < need or max(growing) > bound:
            fail(step, f"storage of {growing} rows for {need}: more than growth allows ({bound})")
        if not self.run.samples:
            return
        first, previous = self.run.samples[0], self.run.samples[-1]
        grown_rows = (
            sample.history_rows_allocated if self.quantized else sample.window_rows_allocated,
            previous.history_rows_allocated if self.quantized else previous.window_rows_allocated,
        )
        if grown_rows[0] > grown_rows[1] and need + WINDOWS["block"] <= grown_rows[1]:
            fail(step, f"storage grew from {grown_rows[1]} to {grown_rows[0]} rows though {need} fitted")
        if self.quantized and (sample.window_rows_allocated, sample.other_bytes) != (
            first.window_rows_allocated,
            first.other_bytes,
        ):
            fail(step, f"sink and window storage changed: {first.other_bytes} -> {sample.other_bytes} bytes")
        objects = sample.python_objects - first.python_objects
        if objects > PYTHON_OBJECT_SLACK:
            fail(step, f"{objects} more Python objects than at step {first.step}")
        heap = sample.python_heap_bytes - first.python_heap_bytes
        if heap > PYTHON_HEAP_SLACK:
            fail(step, f"the Python heap grew by {heap} bytes since step {first.step}")


def soak_all(methods: list[str], modes: list[str], steps: int, check_every: int) -> list[Run]:
    model = tiny_model()
    rotations = random_rotations(MODEL["head_dim"], list(range(MODEL["num_hidden_layers"])))
    runs = []
    for method in methods:
        for mode in modes:
            run = Soak(model, method, mode, rotations, check_every).soak(steps)
            status = "ok" if not run.failures else f"{len(run.failures)} FAILURES: {run.failures[:3]}"
            print(f"{method:18s} {mode:6s} {run.seconds:7.1f} s, {run.probes} probes: {status}", flush=True)
            runs.append(run)
    return runs


# ------------------------------------------------------------------------------------------ output


def write(out: Path, record: dict, runs: list[Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    result = {
        **record,
        "windows": WINDOWS,
        "model": MODEL,
        "batch": BATCH,
        "prompt": PROMPT,
        "runs": [asdict(run) for run in runs],
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Soak: {record['steps']} decode steps per method and mode\n",
        f"Tiny random Llama ({MODEL['num_hidden_layers']} layers, {MODEL['num_key_value_heads']} KV heads of "
        f"{MODEL['head_dim']} dims), batch {BATCH}, a {PROMPT}-token prompt, sink {WINDOWS['sink']}, recent "
        f"{WINDOWS['recent']}, block {WINDOWS['block']}; checks (lengths, tiers, bounded buffers, flat memory, "
        "recall of demoted rows) at the first demotion after every "
        f"{record['check_every']} steps. Bytes are the cache's allocated tensors, all layers; growth is "
        "from the first check to the last. `none` keeps every token in BF16, so it never freezes.\n",
        "| method | mode | frozen | checks | probes | final length | history rows (allocated) | window rows "
        "(allocated) | history MiB | sink+window KiB | Python objects / heap KiB growth | step ms first / last "
        "| s | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        first, last = run.samples[0], run.samples[-1]
        heap = (last.python_heap_bytes - first.python_heap_bytes) / 1024
        result_text = "pass" if not run.failures else f"**{len(run.failures)} failed**: {run.failures[0]}"
        objects = last.python_objects - first.python_objects
        lines.append(
            f"| {run.method} | {run.mode} | {'yes' if last.frozen else 'no'} | {len(run.samples)} | "
            f"{run.probes} | {last.length} | {last.history} ({last.history_rows_allocated}) | {last.window} "
            f"({last.window_rows_allocated}) | {last.history_bytes / 2**20:.2f} | {last.other_bytes / 1024:.1f} | "
            f"{objects:+d} / {heap:+.1f} | "
            f"{first.step_ms:.2f} / {last.step_ms:.2f} | {run.seconds:.0f} | {result_text} |"
        )
    lines.append(f"\n{provenance_line(record)}.\n")
    (out / "soak.md").write_text("\n".join(lines))
    figure, (memory, timing) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        steps = [s.step for s in run.samples]
        style = "-" if run.mode == "eager" else "--"
        label = f"{run.method} {run.mode}"
        memory.plot(steps, [(s.history_bytes + s.other_bytes) / 2**20 for s in run.samples], style, label=label)
        timing.plot(steps, [s.step_ms for s in run.samples], style, label=label)
    memory.set(xlabel="decode step", ylabel="cache tensors, MiB (allocated)", title="cache memory")
    timing.set(xlabel="decode step", ylabel="ms per step (mean since previous check)", title="step time")
    timing.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(out / "soak.png", dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--check-every", type=int, default=500)
    parser.add_argument("--out", type=Path, default=REPO / "eval" / "results")
    args = parser.parse_args(argv)
    if args.steps < args.check_every or args.check_every < 1:
        parser.error("--steps must be at least --check-every, which must be positive")
    runs = soak_all(args.methods, args.modes, args.steps, args.check_every)
    record = {**provenance(command_line(argv=argv)), "steps": args.steps, "check_every": args.check_every}
    write(args.out, record, runs)
    failed = [f"{run.method} {run.mode}" for run in runs if run.failures]
    print(f"{len(runs) - len(failed)}/{len(runs)} runs passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
