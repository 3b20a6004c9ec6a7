"""Needle in a haystack (RULER-style single needle) for every cache method: the runner, its tables and
plot. The prompts (:mod:`oscar_hf.evaluation.haystack`) ask for a number hidden at a chosen depth;
each method answers with a few greedily generated tokens, each with a fresh
:class:`~oscar_hf.OscarCache`, scored by an exact match of the number. The same seed gives the same
needle and haystack offset at every length and depth, so methods, lengths and depths are compared
on paired trials.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from oscar_hf.core.models import model_context
from oscar_hf.evaluation.haystack import Haystack, NeedleError, build_prompt, extract_number, is_correct
from oscar_hf.evaluation.report import tokens_label
from oscar_hf.log import get_logger
from oscar_hf.provenance import provenance_line, provenance_title
from oscar_hf.rotations.rotation_set import MethodRotations

logger = get_logger(__name__)


@dataclass
class Trial:
    method: str
    length: int
    depth: float
    seed: int
    key: str
    expected: str
    answer: str
    extracted: str | None
    correct: bool
    needle_position: int  # first needle token
    actual_depth: float
    prefill_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def parse_lengths(text: str) -> list[int]:
    """``"2K,4096,8k"`` -> ``[2048, 4096, 8192]`` (K = 1024)."""
    lengths = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)([kK]?)", part)
        if not match:
            raise NeedleError(f"bad length {part!r}: use token counts like 2048 or 2K")
        lengths.append(int(match.group(1)) * (1024 if match.group(2) else 1))
        if lengths[-1] < 1:
            raise NeedleError(f"bad length {part!r}: a prompt holds at least 1 token")
    if not lengths:
        raise NeedleError("no lengths given")
    return lengths


def parse_depths(text: str) -> list[float]:
    """``"0,25,50"`` -> ``[0.0, 25.0, 50.0]``, each checked to lie in [0, 100]."""
    try:
        depths = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise NeedleError(f"bad depths {text!r}: use percentages like 0,25,50,75,100") from None
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad or not depths:
        raise NeedleError(f"depths must be percentages in [0, 100], got {text!r}")
    return depths


def check_lengths(lengths: Sequence[int], context: int | None, max_new_tokens: int) -> None:
    """Raise :class:`NeedleError` if a prompt plus its answer would not fit the model's context."""
    if context is None:
        return
    too_long = [n for n in lengths if n + max_new_tokens > context]
    if too_long:
        raise NeedleError(
            f"length(s) {too_long} plus {max_new_tokens} new tokens exceed the model's context of "
            f"{context} tokens; the longest prompt that fits is {context - max_new_tokens}"
        )


@torch.no_grad()
def run_niah(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    haystack: Haystack,
    methods: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    seeds: Sequence[int],
    rotations: MethodRotations = None,
    max_new_tokens: int = 12,
    chat: bool = True,
    progress: bool = True,
) -> list[Trial]:
    """Every (length, seed, depth, method) trial, each generated with a fresh cache of its method."""
    from oscar_hf.evaluation.demo import run_method

    check_lengths(lengths, model_context(model), max_new_tokens)
    trials = []
    bar = tqdm(total=len(lengths) * len(seeds) * len(depths) * len(methods), desc="needle trials", disable=not progress)
    for length in lengths:
        for seed in seeds:
            for depth in depths:
                prompt = build_prompt(tokenizer, haystack, length, depth, seed, chat)
                ids = torch.tensor([prompt.input_ids])
                for method in methods:
                    bar.set_postfix_str(f"{length} tokens, depth {depth:g}%, {method}")
                    run = run_method(model, tokenizer, ids, method, rotations, max_new_tokens)
                    extracted = extract_number(run.answer)
                    trial = Trial(
                        method=method,
                        length=length,
                        depth=depth,
                        seed=seed,
                        key=prompt.needle.key,
                        expected=prompt.needle.value,
                        answer=run.answer,
                        extracted=extracted,
                        correct=is_correct(run.answer, prompt.needle),
                        needle_position=prompt.needle_start,
                        actual_depth=round(prompt.actual_depth, 2),
                        prefill_seconds=run.prefill_seconds,
                    )
                    logger.info(
                        "%s length %d depth %g seed %d: %r (%s)",
                        method,
                        length,
                        depth,
                        seed,
                        run.answer,
                        "correct" if trial.correct else f"expected {prompt.needle.value}",
                    )
                    trials.append(trial)
                    bar.update()
    bar.close()
    return trials


# ----------------------------------------------------------------------------- reports


def accuracy_table(trials: Sequence[Trial]) -> dict[str, dict[str, dict[str, float]]]:
    """``{method: {length: {depth: accuracy}}}`` (keys as strings, for JSON)."""
    cells: dict[tuple[str, int, float], list[bool]] = {}
    for t in trials:
        cells.setdefault((t.method, t.length, t.depth), []).append(t.correct)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for (method, length, depth), hits in cells.items():
        table.setdefault(method, {}).setdefault(str(length), {})[f"{depth:g}"] = round(sum(hits) / len(hits), 4)
    return table


def summary(trials: Sequence[Trial]) -> dict[str, dict[str, float]]:
    """``{method: {length or "all": accuracy}}``."""
    groups: dict[tuple[str, str], list[bool]] = {}
    for t in trials:
        groups.setdefault((t.method, str(t.length)), []).append(t.correct)
        groups.setdefault((t.method, "all"), []).append(t.correct)
    out: dict[str, dict[str, float]] = {}
    for (method, length), hits in groups.items():
        out.setdefault(method, {})[length] = round(sum(hits) / len(hits), 4)
    return out


def niah_result(trials: Sequence[Trial], meta: dict, settings: dict) -> dict:
    return {
        **meta,
        **settings,
        "summary": summary(trials),
        "accuracy": accuracy_table(trials),
        "trials": [t.to_dict() for t in trials],
    }


def niah_markdown(result: dict) -> str:
    methods, lengths, depths = result["methods"], result["lengths"], result["depths"]
    head = "| method | " + " | ".join(f"{tokens_label(n)} ({n} tokens)" for n in lengths) + " | all |"
    rows = [
        "Accuracy (exact match of the 7-digit number), all depths and needles:",
        "",
        head,
        "|---|" + "---|" * (len(lengths) + 1),
    ]
    for m in methods:
        s = result["summary"][m]
        rows.append(f"| {m} | " + " | ".join(f"{s[str(n)]:.2f}" for n in lengths) + f" | {s['all']:.2f} |")
    rows += [
        "",
        "Per depth (rows: method and length; columns: needle depth in % of the haystack):",
        "",
        "| method | length | " + " | ".join(f"{d:g}%" for d in depths) + " |",
        "|---|---|" + "---|" * len(depths),
    ]
    for m in methods:
        for n in lengths:
            cell = result["accuracy"][m][str(n)]
            rows.append(f"| {m} | {tokens_label(n)} | " + " | ".join(f"{cell[f'{d:g}']:.2f}" for d in depths) + " |")
    meta = (
        f"\n\n{provenance_line(result)}, "
        f"{result['seconds']} s; model {result['model']}, haystack: {result['haystack']}, "
        f"{len(result['seeds'])} needle(s) per cell (seeds {result['seeds']}), greedy, "
        f"{result['max_new_tokens']} new tokens, chat template: {result['chat']}."
    )
    return "\n".join(rows) + meta + "\n"


def plot_niah(result: dict, path: Path) -> None:
    """One panel per method: accuracy over needle depth (rows) and prompt length (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods, lengths, depths = result["methods"], result["lengths"], result["depths"]
    cols = min(3, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.4 * cols + 1, 0.4 * len(depths) * rows + 1.4 * rows + 1),
        squeeze=False,
        layout="constrained",
    )
    image = None
    for ax, method in zip(axes.flat, methods):
        grid = np.array([[result["accuracy"][method][str(n)][f"{d:g}"] for n in lengths] for d in depths])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [tokens_label(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set_title(f"{method} ({result['summary'][method]['all']:.2f})")
        ax.set_xlabel("prompt length (tokens)")
        if ax in axes[:, 0]:
            ax.set_ylabel("needle depth (% of haystack)")
    for ax in list(axes.flat)[len(methods) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    headline = f"Needle in a haystack, {result['model']}: {len(result['seeds'])} needle(s) per cell"
    fig.suptitle(provenance_title(result, headline), fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
