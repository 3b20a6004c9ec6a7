"""The tables and the plot of an :mod:`eval.ablate` run: memory, KL and perplexity per recipe, needles per length and depth."""

from __future__ import annotations

from pathlib import Path

from oscar_hf.evaluation.report import tokens_label
from oscar_hf.provenance import provenance_line, provenance_title


def to_markdown(result: dict) -> str:
    labels, memory = result["variants"], result["bits_per_element"]
    bpe_keys = list(memory[labels[0]])
    texts = list(result["scores"])
    contexts = [str(c) for c, _ in result["kl_windows"]] if texts else []
    head = ["recipe"] + [f"BPE {_length_label(k)}" for k in bpe_keys]
    head += [f"{t} {tokens_label(int(c))} {m}" for t in texts for c in contexts for m in ("KL", "PPL")]
    rows = []
    for label in labels:
        cells = [label] + [f"{memory[label][k]:.3f}" for k in bpe_keys]
        for t in texts:
            for c in contexts:
                score = result["scores"][t][c][label]
                cells += [f"{score['kl_from_none']:.4f}", f"{score['perplexity']:.3f}"]
        rows.append(cells)
    parts = [result["description"], _table(head, rows)]
    if texts:
        parts.append(
            "KL in nats from BF16 and perplexity, teacher-forced with token-by-token decoding, over positions "
            f"after sink + recent; windows per context: {dict((str(c), w) for c, w in result['kl_windows'])}."
        )
    if result.get("needles"):
        parts += _needle_markdown(result)
    meta = f"{provenance_line(result)}, {result['seconds']} s; model {result['model']} in {result['dtype']} on {result['device']}."
    return "\n\n".join(parts + [meta]) + "\n"


def _length_label(key: str) -> str:
    return "128K hd128" if "@" in key else tokens_label(int(key))


def _table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, its rule and one line a row of cells."""
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [head, ["---"] * len(head), *rows])


def _needle_markdown(result: dict) -> list[str]:
    settings, needles = result["needle_settings"], result["needles"]
    lengths = [str(n) for n in settings["lengths"]]
    head = (
        ["recipe"]
        + [f"EM {tokens_label(int(n))}" for n in lengths]
        + ["EM all"]
        + [f"log p {tokens_label(int(n))}" for n in lengths]
        + ["passes / trial", "s / trial"]
    )
    rows = []
    passes = {label: 0.0 for label in result["variants"]}
    for trial in needles["trials"]:
        passes[trial["recipe"]] += trial["passes"] / needles["summary"][trial["recipe"]]["all"]["trials"]
    for label in result["variants"]:
        summary, seconds = needles["summary"][label], needles["seconds"][label]
        per_trial = sum(seconds.values()) / summary["all"]["trials"]
        rows.append(
            [label]
            + [f"{summary['by_length'][n]['exact_match']:.2f}" for n in lengths]
            + [f"{summary['all']['exact_match']:.2f}"]
            + [f"{summary['by_length'][n]['answer_logprob']:.2f}" for n in lengths]
            + [f"{passes[label]:.2f}", f"{per_trial:.2f}"]
        )
    depths = [f"{d:g}" for d in settings["depths"]]
    depth_rows = []
    for label in result["variants"]:
        for n in lengths:
            cells = needles["summary"][label]["by_depth"][n]
            depth_rows.append([label, tokens_label(int(n))] + [f"{cells[d]:.2f}" for d in depths])
    note = (
        f"Needle in a haystack ({settings['haystack']}), {settings['needles']} needle(s) x {len(depths)} depths per "
        "length, teacher-forced under the real schedule (prompt prefilled in one chunk, answer decoded against "
        "the quantized cache): EM is the exact match of the greedy answer "
        f"(max {settings['max_new_tokens']} new tokens), log p the summed log-probability of the number's "
        "tokens (nats); a trial takes one pass with the prompt, and one "
        "pass of the answer's rows per greedy detour (passes / trial counts both)."
    )
    depth_table = _table(["recipe", "length"] + [f"{d}%" for d in depths], depth_rows)
    return [note, _table(head, rows), "Exact match per needle depth (% of the haystack):", depth_table]


def plot(result: dict, path: Path) -> None:
    """KL from BF16 per recipe and context; needle exact match and answer log-probability per length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = result["variants"]
    panels = (1 if result["scores"] else 0) + (2 if result.get("needles") else 0)
    width = 6 * panels + 0.07 * max(len(label) for label in labels)  # room for the recipes' names
    fig, axes = plt.subplots(1, panels, figsize=(width, 0.45 * len(labels) + 2.5), squeeze=False)
    axes = list(axes[0])
    if result["scores"]:
        ax = axes.pop(0)
        series = [(t, c) for t in result["scores"] for c in result["scores"][t]]
        quantized = [
            label for label in labels if any(result["scores"][t][c][label]["kl_from_none"] > 0 for t, c in series)
        ]
        height = 0.8 / len(series)
        every = []
        for i, (t, c) in enumerate(series):
            values = [result["scores"][t][c][label]["kl_from_none"] for label in quantized]
            every += values
            bars = ax.barh(
                [y + i * height for y in range(len(quantized))],
                values,
                height=height,
                label=f"{t} {tokens_label(int(c))}",
            )
            ax.bar_label(bars, fmt="%.4f", fontsize=7, padding=2)
        ax.set_yticks([y + height * (len(series) - 1) / 2 for y in range(len(quantized))], quantized)
        ax.invert_yaxis()
        # a log axis where the recipes differ by orders of magnitude; else bars from zero, whose lengths compare
        spread = max(every) / min(every) if every and min(every) > 0 else 1.0
        ax.set_xscale("log" if spread > 10 else "linear")
        ax.margins(x=0.15)
        ax.set_xlabel(f"KL from BF16 (nats{', log' if spread > 10 else ''}; lower is better)")
        ax.legend(fontsize=7)
    if result.get("needles"):
        lengths = [str(n) for n in result["needle_settings"]["lengths"]]
        summary = result["needles"]["summary"]
        for ax, key, name in zip(
            axes, ("exact_match", "answer_logprob"), ("needle exact match", "answer log p (nats)")
        ):
            for label in labels:
                ax.plot(
                    range(len(lengths)), [summary[label]["by_length"][n][key] for n in lengths], marker="o", label=label
                )
            ax.set_xticks(range(len(lengths)), [tokens_label(int(n)) for n in lengths])
            ax.set_xlabel("prompt length (tokens)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[0].set_ylim(-0.05, 1.05)
        axes[0].legend(fontsize=7)
    headline = f"{Path(result['config']).stem}: {result['model']} ({result['dtype']}, {result['device']})"
    fig.suptitle(provenance_title(result, headline, width=140), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
