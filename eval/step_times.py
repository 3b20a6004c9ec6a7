"""Wall time of every step of one ``model.generate`` call, per cache: what the first steps cost.

    python -m eval.step_times [--model qwen3-8b] [--context 100000] [--batch 1 8] [--new-tokens 64]
                              [--caches dynamic oscar-int2 oscar-int2+eager-layout]

On CUDA plain ``generate`` with an OscarCache freezes the cache at its first decode step and replays
whole steps from a CUDA graph (:mod:`oscar_hf.core.step_replay`): the first call of a shape in a process
compiles and captures, a later one on a fresh cache replays the graph the last call's cache left
(:mod:`oscar_hf.core.step_reuse`); a short benchmark's tokens/s mixes that one-time cost with the per-token
rate. A logits processor records a synchronised timestamp after every step. Each cache runs a first call,
then ``--rounds`` later calls in a row, each on a fresh fill, as a user's repeated calls do; the round of
median steady step is reported: its first steps, the median of the rest, and the one-time cost (the
first steps' excess over that median; of it, generate's preparation before its first forward, which every
cache pays, and the rest, the cache's set-up), with every round's steady step, and the first call's. Writes ``<out>/step_times.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from eval.benchmarks.caches import attention_for, fill_cache, make_cache, model_for
from eval.benchmarks.cases import free_memory, guarded, median_round
from eval.benchmarks.decoding import generate
from eval.benchmarks.models import (
    add_model_arguments,
    build_model,
    input_device,
    random_rotations,
    random_tokens,
)
from oscar_hf import release_captured_steps
from oscar_hf.model_info import full_attention_layer_ids, head_dim_of
from oscar_hf.provenance import command_line, provenance, provenance_line

FIRST_STEPS = 3


class StepClock(LogitsProcessor):
    """Records a synchronised timestamp each time generate has the next token's logits, and one when the
    first forward begins (as a forward pre-hook): what generate prepares before it, at 100K tokens, every
    cache pays alike."""

    def __init__(self, device: torch.device):
        self.device, self.stamps, self.first_forward = device, [], None

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def forward_begins(self, module, args) -> None:
        if self.first_forward is None:
            self.first_forward = self.now()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(self.now())
        return scores


def step_ms(model, cache_name: str, batch: int, context: int, new_tokens: int, rotations) -> tuple[list[float], float]:
    """Milliseconds of each decode step up to its logits (the first: over the filled context), and of
    generate's preparation before its first forward (included in the first step)."""
    model.set_attn_implementation(attention_for(cache_name))
    with model_for(model, cache_name, rotations) as method:
        cache = make_cache(method, model, context + new_tokens + 8, rotations)
        fill_cache(cache, model, batch, context, 65536)
        ids = random_tokens(model, batch, context + 1)
        clock = StepClock(input_device(model))
        hook = model.register_forward_pre_hook(clock.forward_begins)
        start = clock.now()
        try:
            generate(model, cache, ids, new_tokens, logits_processor=LogitsProcessorList([clock]))
        finally:
            hook.remove()
    stamps = [start, *clock.stamps]
    del cache
    free_memory()
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])], (clock.first_forward - start) * 1e3


def summary(times: list[float], preparation_ms: float) -> dict:
    """The first steps, the steady step (median of the rest) and the first steps' excess over it: all of
    it (``one_time_ms``) and the part after generate's preparation (``forwards_one_time_ms``)."""
    steady = statistics.median(times[FIRST_STEPS:])
    one_time = sum(times[:FIRST_STEPS]) - FIRST_STEPS * steady
    return {
        "first_steps_ms": times[:FIRST_STEPS],
        "steady_step_ms": steady,
        "one_time_ms": one_time,
        "preparation_ms": preparation_ms,
        "forwards_one_time_ms": one_time - preparation_ms,
        "steps_ms": times,
    }


def write(out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "step_times.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Steps of one generate call\n\n{result['model']}, context {result['context']}, "
        f"{result['new_tokens']} new tokens, every step synchronised. The first call of each cache in the "
        f"process (compiling, capturing), then {result['rounds']} later calls in a row, each on a fresh "
        "cache; the round of median steady step shown. One-time cost: the first steps' excess over the "
        "steady step; of which generate's preparation: from the call to its first forward (every cache "
        "pays it), the rest: the cache's set-up in the forwards (freezing, and capturing or taking the "
        "step the last call left, for OscarCache).\n",
        "| batch | cache | first call: one-time cost ms | later call: first steps ms | later call: one-time cost ms "
        "| of which generate's preparation ms | of which in the forwards ms | steady step ms "
        "| steady step ms, each round |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, caches in result["batches"].items():
        for name, row in caches.items():
            if row.get("status", "ok") != "ok":
                failure = "out of memory" if row["status"] == "oom" else row.get("error", row["status"])
                lines.append(f"| {batch} | {name} | {failure} |" + " |" * 6)
                continue
            first = " / ".join(f"{t:.1f}" for t in row["first_steps_ms"])
            each = " / ".join(f"{t:.1f}" for t in row["steady_step_ms_rounds"])
            lines.append(
                f"| {batch} | {name} | {row['first_call']['one_time_ms']:.1f} | {first} | {row['one_time_ms']:.1f} "
                f"| {row['preparation_ms']:.1f} | {row['forwards_one_time_ms']:.1f} | {row['steady_step_ms']:.2f} "
                f"| {each} |"
            )
    lines.append(f"\n{provenance_line(result)}.\n")
    (out / "step_times.md").write_text("\n".join(lines))
    batches = result["batches"]
    figure, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for axis, (batch, caches) in zip(axes[0], batches.items()):
        for name, row in caches.items():
            if "steps_ms" in row:
                axis.plot(range(1, len(row["steps_ms"]) + 1), row["steps_ms"], label=name)
        axis.set(xlabel="decode step", ylabel="ms", yscale="log", title=f"batch {batch}")
        axis.legend()
    figure.suptitle(f"{result['model']}, {result['context']} tokens")
    figure.tight_layout()
    figure.savefig(out / "step_times.png", dpi=120)


def measure_batch(model, batch: int, args, rotations) -> dict:
    """Each cache's first call, then its later calls in a row: the round of median steady step."""

    def measure(cache_name: str) -> dict:
        return summary(*step_ms(model, cache_name, batch, args.context, args.new_tokens, rotations))

    def calls(cache_name: str) -> dict:
        release_captured_steps()  # the later calls find the step their own cache's last call left
        first = measure(cache_name)  # compiles, captures
        rounds = [measure(cache_name) for _ in range(args.rounds)]
        return {**median_round(rounds, "steady_step_ms", higher_is_faster=False), "first_call": first}

    caches = {}
    for cache_name in tqdm(args.caches, desc=f"batch {batch}"):
        caches[cache_name] = guarded({}, functools.partial(calls, cache_name))  # out of memory: noted, the run goes on
        print(batch, cache_name, {k: v for k, v in caches[cache_name].items() if k != "steps_ms"}, flush=True)
    return caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, several_batches=True)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--caches", nargs="+", default=["dynamic", "oscar-int2", "oscar-int2+eager-layout"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    name, spec = args.model
    model = build_model(spec, args.device, torch.bfloat16)
    rotations = random_rotations(head_dim_of(model), full_attention_layer_ids(model))
    batches = {str(batch): measure_batch(model, batch, args, rotations) for batch in args.batch}
    write(
        args.out,
        {
            **provenance(command_line()),
            "model": name,
            "context": args.context,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "batches": batches,
        },
    )


if __name__ == "__main__":
    main()
