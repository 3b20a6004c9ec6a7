"""Where a 2-bit row's four levels sit: our min-max grid against Lloyd-Max placements, on real rotated K/V.

    python -m eval.quantizer_levels --data-dir DATA [--file wikitext2_raw/wiki.test.raw] [--tokens 2048]

One held-out window through the default model; in every layer its post-RoPE keys and values, rotated by
the bundled ``oscar-int2`` set and clipped at that layer's ratios, are quantized per row (64 channels, one
group) four ways, and the attention output over the quantized keys and values (causal, every query) is
compared with the exact one (the first 64 rows, the BF16 sink, stay exact):

* ``min-max``: the library's grid, ``min + {0, 1, 2, 3} * (max - min) / 3`` (``oscar_hf.quant``).
* ``reference Lloyd-Max``: the reference's SGLang variant (``SGLANG_LLOYD_MAX=1``): thresholds at ``mu`` and
  ``mu +- 0.981 sigma`` (a Gaussian's Lloyd-Max thresholds), levels ``mu + {-1.751, -0.584, 0.584, 1.751} sigma``
  (a uniform grid, stored in the same scale / zero format).
* ``Gaussian Lloyd-Max``: the Gaussian's own levels ``mu + {-1.510, -0.453, 0.453, 1.510} sigma`` at the same
  thresholds (non-uniform: a level table in the kernels).
* ``Gaussian Lloyd-Max, unclipped``: the same on the rows before clipping.
* ``per-row Lloyd-Max``: four levels fitted to each row (Lloyd's iterations from its quartiles): what any
  placement of four levels a row could reach, at the cost of four stored levels a row.

Writes ``<out>.{json,md,png}``: per layer and on average, K and V's relative squared error and the attention
output's relative error.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from oscar_hf.calibration.covariances import observe_attention
from oscar_hf.core.models import load_model
from oscar_hf.evaluation.report import write_outputs
from oscar_hf.provenance import command_line, provenance, provenance_line
from oscar_hf.quant import clip_rows, dequantize, quantize
from oscar_hf.rotations.resolve import resolve_rotations

THRESHOLD = 0.9810652732849121  # the reference's outer decision threshold, in sigmas
REFERENCE_LEVELS = (-1.75109, -0.58370, 0.58370, 1.75109)
GAUSSIAN_LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)
LLOYD_STEPS = 20
SINK = 64  # the cache's BF16 sink: these rows stay exact


def min_max(rows: torch.Tensor) -> torch.Tensor:
    """The library's 2-bit grid (one group a row), dequantized in float32."""
    return dequantize(quantize(rows, 2, rows.shape[-1], metadata_dtype=torch.float32), 2, rows.shape[-1], torch.float32)


def sigma_placed(rows: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    """Four ``levels`` (in sigmas about the row's mean), chosen by the Gaussian Lloyd-Max thresholds."""
    mu = rows.mean(-1, keepdim=True)
    sigma = (rows.var(-1, unbiased=False, keepdim=True) + 1e-8).sqrt()
    z = (rows - mu) / sigma
    code = (z >= -THRESHOLD).long() + (z >= 0).long() + (z >= THRESHOLD).long()
    return mu + torch.tensor(levels)[code] * sigma


def per_row_lloyd(rows: torch.Tensor) -> torch.Tensor:
    """Four levels fitted to each row: Lloyd's iterations (nearest level, then each level the mean of its
    values) from the row's quartile midpoints."""
    levels = torch.quantile(rows, torch.tensor([0.125, 0.375, 0.625, 0.875]), dim=-1).movedim(0, -1)
    for _ in range(LLOYD_STEPS):
        code = (rows[..., None] - levels[..., None, :]).abs().argmin(-1)
        one_hot = torch.nn.functional.one_hot(code, 4).float()
        counts = one_hot.sum(-2)
        sums = (one_hot * rows[..., None]).sum(-2)
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), levels)
    code = (rows[..., None] - levels[..., None, :]).abs().argmin(-1)
    return levels.gather(-1, code)


# name: (quantizer, whether it quantizes the clipped rows)
PLACEMENTS = {
    "min-max": (min_max, True),
    "reference Lloyd-Max": (lambda rows: sigma_placed(rows, REFERENCE_LEVELS), True),
    "Gaussian Lloyd-Max": (lambda rows: sigma_placed(rows, GAUSSIAN_LEVELS), True),
    "Gaussian Lloyd-Max, unclipped": (lambda rows: sigma_placed(rows, GAUSSIAN_LEVELS), False),
    "per-row Lloyd-Max": (per_row_lloyd, True),
}


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``query [B, Hq, T, D]`` over ``key`` / ``value [B, Hkv, T, D]`` (GQA), float32."""
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)


def relative(error: torch.Tensor, exact: torch.Tensor) -> float:
    return float(error.pow(2).sum() / exact.pow(2).sum())


def layer_errors(query, key, value, key_rotation, value_rotation, key_clip, value_clip) -> dict[str, dict[str, float]]:
    """Per placement: K's and V's relative squared error (rotated rows past the sink) and the output's; the
    sink's rows stay exact, as the cache keeps them in BF16. Clipped placements clip at the layer's ratios."""
    query, key, value = query.float(), key.float(), value.float()
    rotated_k, rotated_v = key @ key_rotation, value @ value_rotation
    exact = attention(query, key, value)
    errors = {}
    if key.shape[2] <= SINK:  # every row in the sink
        return {name: {"key": 0.0, "value": 0.0, "output": 0.0} for name in PLACEMENTS}
    for name, (place, clipped) in PLACEMENTS.items():
        k_hat, v_hat = rotated_k.clone(), rotated_v.clone()
        k_rows, v_rows = rotated_k[:, :, SINK:], rotated_v[:, :, SINK:]
        k_hat[:, :, SINK:] = place(clip_rows(k_rows, key_clip) if clipped else k_rows)
        v_hat[:, :, SINK:] = place(clip_rows(v_rows, value_clip) if clipped else v_rows)
        out = attention(query, k_hat @ key_rotation.mT, v_hat @ value_rotation.mT)
        errors[name] = {
            "key": relative(k_hat - rotated_k, rotated_k[:, :, SINK:]),
            "value": relative(v_hat - rotated_v, rotated_v[:, :, SINK:]),
            "output": relative(out - exact, exact),
        }
    return errors


def measure(model, ids: torch.Tensor, rotations) -> dict[int, dict]:
    per_layer = {}

    def observe(layer_id, query, key, value):
        per_layer[layer_id] = layer_errors(
            query,
            key,
            value,
            rotations.key[layer_id].float(),
            rotations.value[layer_id].float(),
            rotations.key_clip.get(layer_id, 0.0),
            rotations.value_clip.get(layer_id, 0.0),
        )

    observe_attention(model, [ids[None]], observe, description="quantizer levels")
    return per_layer


def summarise(per_layer: dict[int, dict]) -> dict[str, dict[str, float]]:
    return {
        name: {
            part: sum(e[name][part] for e in per_layer.values()) / len(per_layer) for part in ("key", "value", "output")
        }
        for name in PLACEMENTS
    }


def markdown(result: dict) -> str:
    base = result["mean"]["min-max"]
    lines = [
        "# Where a 2-bit row's levels sit",
        "",
        f"{result['tokens']} tokens of `{result['file']}` through the default model, every layer's keys and values "
        "rotated by the bundled oscar-int2 set (clipped at its ratios unless said), one group of 64 a row, the "
        "first 64 tokens kept exact as the BF16 sink (every later one quantized: no recent window); relative "
        "squared errors averaged over the layers.",
        "",
        "| placement | K error | V error | attention output error | output error vs min-max |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["mean"].items():
        lines.append(
            f"| {name} | {row['key']:.4f} | {row['value']:.4f} | {row['output']:.4f} | "
            f"{row['output'] / base['output']:.3f}x |"
        )
    return "\n".join([*lines, "", provenance_line(result), ""])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    layers = sorted(result["layers"], key=int)
    for name in PLACEMENTS:
        axis.plot(
            [int(i) for i in layers], [result["layers"][i][name]["output"] for i in layers], marker=".", label=name
        )
    axis.set(xlabel="layer", ylabel="attention output, relative squared error", yscale="log", title="2-bit levels")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--file", default="wikitext2_raw/wiki.test.raw")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("eval/results/quantizer_levels"))
    args = parser.parse_args(argv)
    model, tokenizer = load_model("default", device="cpu", dtype=torch.float32)
    text = (args.data_dir / args.file).read_text(encoding="utf-8")
    ids = tokenizer(text[-400_000:], return_tensors="pt", add_special_tokens=False)["input_ids"][0][: args.tokens]
    per_layer = measure(model, ids, resolve_rotations(model, "default", method="oscar-int2"))
    result = {
        **provenance(command_line()),
        "file": args.file,
        "tokens": int(ids.numel()),
        "mean": summarise(per_layer),
        "layers": {str(i): e for i, e in sorted(per_layer.items())},
    }
    write_outputs(result, args.out, markdown(result), plot)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
