"""What ``oscar_hf.calibrate`` costs on a large model: wall time and peak GPU and host memory per stage.

    python -m eval.calibration_cost [--model qwen3-8b] [--device cuda] [--tokens 20000] [--seq-len 2048]
                                    [--recipes default full] [--out DIR]

Builds a random-weight model of the preset's shape (speed and memory do not depend on the weights) and
runs the stages :func:`oscar_hf.calibrate` runs, one after another, on random calibration tokens: the
covariances (two passes over the tokens), the fit (the clip search, per head or not, centered keys or
not), the bit allocation, the key feedback factors (a pass over rows of 8,192 tokens) and the key clip
ratios chosen again under them. Recipes: ``default`` is ``Recipe()`` (what ``oscar-hf calibrate`` does
unasked), ``full`` adds per-head rotations, centered keys and the bit allocation of the bundled set
(``--allocate-bits``, 6 unless told). Writes ``<out>/calibration_cost.{json,md,png}`` after every stage, so a run cut
short keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eval.benchmarks.cases import free_memory
from eval.benchmarks.models import add_model_arguments, build_model, random_tokens
from oscar_hf.calibration.covariances import collect_covariances
from oscar_hf.calibration.recipe import Recipe, allocate, feed_back_keys, feedback_shape, fit
from oscar_hf.provenance import command_line, provenance, provenance_line

RECIPES = {
    "default": {},
    "full": {"per_head": True, "center_keys": True, "allocate_bits": 6},
}


def weights_gib(model: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30


def timed_stage(name: str, run: Callable[[], object], device: torch.device) -> tuple[object, dict]:
    """``run()``'s result and its stage row: seconds, peak GPU memory (GiB, allocated by torch) and the
    process's peak host memory so far (GiB)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    result = run()
    if cuda:
        torch.cuda.synchronize(device)
    row = {
        "stage": name,
        "seconds": time.perf_counter() - start,
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
    }
    print(row, flush=True)
    return result, row


def recipe_stages(model, batches: list[torch.Tensor], recipe: Recipe, device: torch.device, record) -> None:
    """The stages of :func:`oscar_hf.calibrate` for ``recipe``, each recorded as it finishes."""
    covariances, row = timed_stage("covariances", lambda: collect_covariances(model, batches), device)
    record(row)
    (rotations, _), row = timed_stage("fit", lambda: fit(recipe, model, batches, covariances), device)
    record(row)
    if recipe.key_feedback:
        rows = feedback_rows(model, recipe)
        (rotations, _), row = timed_stage(
            "key feedback", lambda: feed_back_keys(recipe, model, batches, rotations, rows), device
        )
        record(row)
    if recipe.allocate_bits:
        _, row = timed_stage("bit allocation", lambda: allocate(recipe, model, batches, rotations), device)
        record(row)


def feedback_rows(model, recipe: Recipe) -> list[torch.Tensor]:
    """Random rows of the key feedback's shape (:func:`oscar_hf.calibration.recipe.feedback_shape`)."""
    rows, length = feedback_shape(model, recipe)
    return [random_tokens(model, 1, length, seed=index) for index in range(rows)]


def write(out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration_cost.json").write_text(json.dumps(result, indent=1))
    weights = result["weights_gib"]
    lines = [
        f"# Calibration cost\n\n{result['model']} (random weights, {weights:.1f} GiB in {result['dtype']}), "
        f"{result['tokens']} calibration tokens in rows of {result['seq_len']}, {result['device']}. Stages of "
        "`oscar_hf.calibrate` one after another; peak GPU memory is torch's allocation during the stage, "
        "peak host memory the process's so far.\n",
        "| recipe | stage | seconds | peak GPU GiB | peak GPU / weights | peak host GiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in result["recipes"].items():
        for row in rows:
            gpu = row["peak_gpu_gib"]
            gpu_cells = "| | |" if gpu is None else f"| {gpu:.2f} | {gpu / weights:.2f}x |"
            lines.append(f"| {name} | {row['stage']} | {row['seconds']:.1f} {gpu_cells} {row['peak_host_gib']:.2f} |")
        total = sum(row["seconds"] for row in rows)
        lines.append(f"| {name} | **all stages** | **{total:.1f}** | | | |")
    recipes = ", ".join(f"`{name}`: `{result['recipe_arguments'][name]}`" for name in result["recipes"])
    lines += [f"\nRecipes: {recipes}.", f"\n{provenance_line(result)}.\n"]
    (out / "calibration_cost.md").write_text("\n".join(lines))
    figure, axis = plt.subplots(figsize=(7, 3.5))
    names = list(result["recipes"])
    for index, name in enumerate(names):
        left = 0.0
        for row in result["recipes"][name]:
            axis.barh(index, row["seconds"], left=left, label=row["stage"] if index == 0 else None)
            axis.text(left + row["seconds"] / 2, index, f"{row['seconds']:.0f} s", ha="center", va="center", fontsize=8)
            left += row["seconds"]
    axis.set(yticks=range(len(names)), yticklabels=names, xlabel="seconds", title=f"Calibrating {result['model']}")
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "calibration_cost.png", dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["default", "full"])
    parser.add_argument("--allocate-bits", type=int, default=6, help="the full recipe's layers with 4-bit keys")
    args = parser.parse_args()
    name, spec = args.model
    device = torch.device(args.device)
    model = build_model(spec, device, torch.bfloat16)
    rows = -(-args.tokens // args.seq_len)
    batches = [random_tokens(model, 1, args.seq_len, seed=index) for index in range(rows)]
    result = {
        **provenance(command_line()),
        "model": name,
        "weights_gib": weights_gib(model),
        "dtype": "bfloat16",
        "device": str(device),
        "tokens": rows * args.seq_len,
        "seq_len": args.seq_len,
        "recipes": {},
        "recipe_arguments": {},
    }
    for recipe_name in args.recipes:
        options = dict(RECIPES[recipe_name], tokens=args.tokens, seq_len=args.seq_len)
        if options.get("allocate_bits"):
            options["allocate_bits"] = args.allocate_bits
        recipe = Recipe(**options)
        result["recipe_arguments"][recipe_name] = f"Recipe({', '.join(f'{k}={v!r}' for k, v in options.items())})"
        stages = result["recipes"].setdefault(recipe_name, [])

        def record(row: dict) -> None:
            stages.append(row)
            write(args.out, result)

        recipe_stages(model, batches, recipe, device, record)
        free_memory()


if __name__ == "__main__":
    main()
