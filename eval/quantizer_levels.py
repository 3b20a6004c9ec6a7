"""Where a 2-bit row's four levels sit: our min-max grid against Lloyd-Max placements, by held-out KL.

    python -m eval.quantizer_levels --data-dir DATA [--context 2048] [--windows 6]

The default model with the bundled ``oscar-int2`` set (clip search, centered keys, 4-bit keys and 1-bit
values in some layers), teacher-forced on held-out text exactly as ``oscar-hf eval kl`` scores it
(:func:`oscar_hf.evaluation.kl.evaluate_caches`). Each placement replaces the round trip of the 2-bit
rows only (every layer's ``history_roundtrip``, on that cache alone); rows at other widths keep the
library's quantizer. Rows are rotated (and centered) as the cache stores them, one group of 64 a row:

* ``min-max``: the library's grid, ``min + {0, 1, 2, 3} * (max - min) / 3`` (``oscar_hf.quant``).
* ``reference Lloyd-Max``: the reference's SGLang variant (``SGLANG_LLOYD_MAX=1``): thresholds at ``mu`` and
  ``mu +- 0.981 sigma`` (a Gaussian's Lloyd-Max thresholds), levels ``mu + {-1.751, -0.584, 0.584, 1.751} sigma``
  (a uniform grid, stored in the same scale / zero format).
* ``Gaussian Lloyd-Max``: the Gaussian's own levels ``mu + {-1.510, -0.453, 0.453, 1.510} sigma`` at the same
  thresholds (non-uniform: a level table in the kernels), on the clipped rows; also unclipped, and on the
  values alone (keys on the min-max grid).
* ``per-row Lloyd-Max``: four levels fitted to each row (Lloyd's iterations from its quartiles): what any
  placement of four levels a row could reach, at the cost of four stored levels a row.

Writes ``<out>.{json,md,png}``: held-out KL from the unquantized model, perplexity and top-1 agreement per
placement and text.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from oscar_hf import OscarCache
from oscar_hf.config import TensorQuantConfig
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.models import load_model
from oscar_hf.evaluation.kl import evaluate_caches
from oscar_hf.evaluation.report import write_outputs
from oscar_hf.provenance import command_line, provenance, provenance_line
from oscar_hf.quant import clip_rows
from oscar_hf.rotations.resolve import resolve_rotations

THRESHOLD = 0.9810652732849121  # the reference's outer decision threshold, in sigmas
REFERENCE_LEVELS = (-1.75109, -0.58370, 0.58370, 1.75109)
GAUSSIAN_LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)
LLOYD_STEPS = 20
# The held-out texts of eval/configs/quality.json: (file, first character)
TEXTS = {"wikitext2": ("wikitext2_raw/wiki.test.raw", 645000), "moby_dick": ("gutenberg_books/pg2701.txt", 0)}


def sigma_placed(rows: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    """Four ``levels`` (in sigmas about the row's mean), chosen by the Gaussian Lloyd-Max thresholds."""
    mu = rows.mean(-1, keepdim=True)
    sigma = (rows.var(-1, unbiased=False, keepdim=True) + 1e-8).sqrt()
    z = (rows - mu) / sigma
    code = (z >= -THRESHOLD).long() + (z >= 0).long() + (z >= THRESHOLD).long()
    return mu + torch.tensor(levels, device=rows.device)[code] * sigma


def per_row_lloyd(rows: torch.Tensor) -> torch.Tensor:
    """Four levels fitted to each row: Lloyd's iterations (nearest level, then each level the mean of its
    values) from the row's quartile midpoints."""
    quantiles = torch.tensor([0.125, 0.375, 0.625, 0.875], device=rows.device)
    levels = torch.quantile(rows, quantiles, dim=-1).movedim(0, -1)
    for _ in range(LLOYD_STEPS):
        code = (rows[..., None] - levels[..., None, :]).abs().argmin(-1)
        one_hot = torch.nn.functional.one_hot(code, 4).to(rows.dtype)
        counts = one_hot.sum(-2)
        sums = (one_hot * rows[..., None]).sum(-2)
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), levels)
    code = (rows[..., None] - levels[..., None, :]).abs().argmin(-1)
    return levels.gather(-1, code)


@dataclass(frozen=True)
class Placement:
    """How a placement quantizes a 2-bit row: ``place`` on the (``clipped``) rotated rows of ``parts``."""

    place: Callable[[torch.Tensor], torch.Tensor] | None  # None: the library's min-max grid
    clipped: bool = True
    parts: tuple[str, ...] = ("key", "value")
    stores: str = "scale, zero"


PLACEMENTS = {
    "min-max": Placement(None),
    "reference Lloyd-Max": Placement(partial(sigma_placed, levels=REFERENCE_LEVELS)),
    "Gaussian Lloyd-Max": Placement(partial(sigma_placed, levels=GAUSSIAN_LEVELS), stores="scale, zero, level table"),
    "Gaussian Lloyd-Max, unclipped": Placement(
        partial(sigma_placed, levels=GAUSSIAN_LEVELS), clipped=False, stores="scale, zero, level table"
    ),
    "Gaussian Lloyd-Max, values only": Placement(
        partial(sigma_placed, levels=GAUSSIAN_LEVELS), parts=("value",), stores="scale, zero, level table"
    ),
    "per-row Lloyd-Max": Placement(per_row_lloyd, stores="four levels a row"),
}


def placed_rows(rows: torch.Tensor, spec: TensorQuantConfig, placement: Placement) -> torch.Tensor:
    """Rotated ``rows [..., D]`` as ``placement`` puts them back (one group a row)."""
    if spec.group_of(rows.shape[-1]) != rows.shape[-1]:
        raise ValueError("the placements quantize one group a row")
    source = clip_rows(rows.float(), spec.clip_ratio) if placement.clipped else rows.float()
    return placement.place(source).to(rows.dtype)


def _placed_roundtrip(layer: OscarLayer, placement: Placement, keys: torch.Tensor, values: torch.Tensor):
    library = OscarLayer.history_roundtrip(layer, keys, values)
    rows = {"key": (keys, layer.config.key), "value": (values, layer.config.value)}
    return tuple(
        placed_rows(x, spec, placement) if part in placement.parts and spec.bits == 2 else stored
        for (part, (x, spec)), stored in zip(rows.items(), library)
    )


def with_placement(cache: OscarCache, placement: Placement) -> OscarCache:
    """``cache`` with the 2-bit rows' round trip of each of its layers replaced by ``placement``'s."""
    if placement.place is not None:
        for layer in cache.layers:
            if isinstance(layer, OscarLayer) and layer.config.quantized:
                layer.history_roundtrip = partial(_placed_roundtrip, layer, placement)
    return cache


def measure(model, tokenizer, data_dir: Path, context: int, windows: int) -> dict[str, dict[str, dict]]:
    """``{text: {placement: MethodScore dict}}``."""
    rotations = resolve_rotations(model, "default", method="oscar-int2")
    caches = {
        name: with_placement(OscarCache(model, "oscar-int2", rotations=rotations), placement)
        for name, placement in PLACEMENTS.items()
    }
    scores = {}
    for text, (file, start) in TEXTS.items():
        ids = tokenizer(
            (data_dir / file).read_text(encoding="utf-8")[start:], return_tensors="pt", add_special_tokens=False
        )["input_ids"][0]
        scores[text] = {s.method: s.to_dict() for s in evaluate_caches(model, ids, caches, context, windows)}
    return scores


def markdown(result: dict) -> str:
    texts = list(result["scores"])
    base = {text: result["scores"][text]["min-max"]["kl_from_none"] for text in texts}
    lines = [
        "# Where a 2-bit row's levels sit",
        "",
        f"The default model with the bundled oscar-int2 set (centered keys, per-layer widths), teacher-forced on "
        f"{result['windows']} windows of {result['context']} tokens of each held-out text; only the 2-bit rows' "
        "placement changes. KL in nats from the unquantized model over the positions after sink + recent.",
        "",
        "| placement | stores | " + " | ".join(f"{t} KL | {t} vs min-max" for t in texts) + " |",
        "|---|---|" + "---|---|" * len(texts),
    ]
    for name, placement in PLACEMENTS.items():
        cells = []
        for text in texts:
            kl = result["scores"][text][name]["kl_from_none"]
            cells += [f"{kl:.4f}", f"{kl / base[text]:.2f}x"]
        lines.append(f"| {name} | {placement.stores} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", provenance_line(result), ""])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    texts = list(result["scores"])
    width = 0.8 / len(texts)
    for k, text in enumerate(texts):
        kls = [result["scores"][text][name]["kl_from_none"] for name in PLACEMENTS]
        axis.barh([i + k * width for i in range(len(PLACEMENTS))], kls, height=width, label=text)
    axis.set_yticks([i + width * (len(texts) - 1) / 2 for i in range(len(PLACEMENTS))], list(PLACEMENTS))
    axis.invert_yaxis()
    axis.set(xlabel="KL from the unquantized model (nats)", title=f"2-bit level placement, {result['context']} tokens")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("eval/results/quantizer_levels"))
    args = parser.parse_args(argv)
    model, tokenizer = load_model("default", device="cpu", dtype=torch.float32)
    result = {
        **provenance(command_line()),
        "context": args.context,
        "windows": args.windows,
        "scores": measure(model, tokenizer, args.data_dir, args.context, args.windows),
    }
    write_outputs(result, args.out, markdown(result), plot)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
