"""``oscar-hf calibrate``: rotations (and optionally per-layer clip ratios and bit widths) for any model, in one command."""

from __future__ import annotations

import argparse
import hashlib
import resource
import sys
import time
from pathlib import Path

import torch

from oscar_hf.rotations.bit_allocation import BitAllocation, allocate_bits
from oscar_hf.rotations.calibration import LayerCovariances, collect_covariances, rotations_from_covariances
from oscar_hf.rotations.calibration_data import calibration_batches, read_calibration_files
from oscar_hf.rotations.clip_search import LayerChoice, search_layers
from oscar_hf.core.config import K_CLIP, METHODS, V_CLIP
from oscar_hf.rotations.refine import refine_rotations
from oscar_hf.core.rotation_set import COMPOSITION_NAMES, RotationSet
from oscar_hf.provenance import provenance

# Calibration rows the clip search measures errors on (~20 s each on the default model, CPU); the bit
# allocation scores its teacher-forced KL on them too (2 rows of 2048 tokens: 2 x 64 passes of ~20 s on CPU).
SEARCH_ROWS = 2


def run_calibration(args: argparse.Namespace, model, tokenizer, argv: list[str]) -> tuple[Path, dict]:
    """Calibrate, save to ``args.out`` and return the directory and a JSON-ready summary."""
    from oscar_hf.core.models import DEFAULT_MODEL, DEFAULT_MODEL_ID
    from oscar_hf.rotations.files import save_rotations
    from oscar_hf.rotations.resolve import model_signature

    started = time.perf_counter()
    files = [Path(p) for p in args.data]
    texts = read_calibration_files(files, tokenizer, chat=args.chat)
    batches = calibration_batches(tokenizer, texts, args.tokens, args.seq_len, args.seed)
    covariances = collect_covariances(model, batches, progress=not args.json)
    choices: dict[int, LayerChoice] = {}
    if args.clip_search:
        rotations, choices = search_layers(model, _search_rows(batches), covariances, progress=not args.json,
                                           per_head=args.per_head)  # fmt: skip
        if args.refine:
            rotations, _ = refine_rotations(model, _refine_rows(batches), rotations, progress=not args.json)
    else:
        rotations = rotations_from_covariances(covariances, args.objective, args.factors, args.per_head)
    allocation: BitAllocation | None = None
    if args.allocate_bits:
        rotations, allocation = allocate_bits(model, _search_rows(batches), rotations, args.allocate_bits,
                                              METHODS[args.allocate_for], progress=not args.json)  # fmt: skip
    tokens = sum(b.numel() for b in batches)
    metadata = {
        "model_id": DEFAULT_MODEL_ID if args.model == DEFAULT_MODEL else args.model,
        "model_signature": model_signature(model),
        "objective": args.objective,
        "composition": _composition(args),
        "source_grouping": "per_kv_head" if args.per_head else "layer",
        "group_size": rotations.head_dim,
        "clip": "per-layer (clip search)" if args.clip_search else {"key": K_CLIP, "value": V_CLIP},
        "sink": METHODS["oscar-int2"].sink,
        "recent": METHODS["oscar-int2"].recent,
        "calibration_data": {
            "files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
            "documents": len(texts.documents),
            "prompts": len(texts.prompts),
            "chat_template": args.chat,
            "seq_len": args.seq_len,
            "rows": len(batches),
            "seed": args.seed,
        },
        "tokens": tokens,
        **provenance("oscar-hf " + " ".join(argv)),
    }
    if allocation is not None:
        metadata["bit_allocation"] = allocation.to_dict()
    if choices:
        metadata["layer_choices"] = {
            str(i): {"key": f"{c.key_factors}@{rotations.key_clip[i]}",
                     "value": f"{c.value_factors}@{rotations.value_clip[i]}"}
            for i, c in choices.items()
        }
    out = save_rotations(rotations, args.out, metadata)
    summary = {
        "out": str(out),
        "layers": len(rotations.key),
        "tokens": tokens,
        "seconds": round(time.perf_counter() - started, 1),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "per_layer": _per_layer(covariances, rotations, choices),
    }
    if allocation is not None:
        summary["bit_allocation"] = {"method": args.allocate_for,
                                     "key_4bit_layers": allocation.key_layers, "value_1bit_layers": allocation.value_layers,
                                     "baseline_kl": round(allocation.baseline_kl, 6),
                                     "allocated_kl": round(allocation.allocated_kl, 6)}  # fmt: skip
    return out, summary


def _composition(args: argparse.Namespace) -> str:
    if not args.clip_search:
        return COMPOSITION_NAMES[args.factors]
    chosen = "per-layer r_h_pbr or h_pbr (clip search)"
    return chosen + " refined on the orthogonal group" if args.refine else chosen


def _refine_rows(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The search rows of the longest length: refinement stacks its rows, so they must be equally long."""
    rows = _search_rows(batches)
    return [r for r in rows if r.shape[1] == rows[0].shape[1]]


def _search_rows(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The longest rows: the search needs keys old enough to have left the BF16 window."""
    needed = METHODS["oscar-int2"].sink + METHODS["oscar-int2"].recent + METHODS["oscar-int2"].block
    rows = sorted(batches, key=lambda b: b.shape[1], reverse=True)[:SEARCH_ROWS]
    if rows[0].shape[1] <= needed:
        raise ValueError(
            f"--clip-search needs calibration rows longer than {needed} tokens (sink + recent window); the longest "
            f"has {rows[0].shape[1]}. Add document (.txt) data or raise --seq-len."
        )
    return [r for r in rows if r.shape[1] > needed]


def _peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _spread(eigenvalues: torch.Tensor) -> tuple[float, float]:
    """(largest / smallest eigenvalue, largest eigenvalue's share of the trace)."""
    values = eigenvalues.double().clamp_min(1e-30)
    return float(values.max() / values.min()), float(values.max() / values.sum())


def _per_layer(covariances: dict[int, LayerCovariances], rotations: RotationSet, choices: dict) -> list[dict]:
    rows = []
    for layer_id, layer in covariances.items():
        q_ratio, q_share = _spread(torch.linalg.eigvalsh(layer.query))
        s_ratio, _ = _spread(torch.linalg.eigvalsh(layer.value))
        row = {"layer": layer_id, "c_q_condition": round(q_ratio, 1), "c_q_top_share": round(q_share, 3),
               "c_s_condition": round(s_ratio, 1)}
        if layer_id in choices:
            c = choices[layer_id]
            # The stored ratios: the search's, or those searched again after --refine.
            row |= {"key": f"{c.key_factors} clip {rotations.key_clip[layer_id]}",
                    "value": f"{c.value_factors} clip {rotations.value_clip[layer_id]}"}
        if rotations.key_bits or rotations.value_bits:
            base_key, base_value = rotations.base_bits
            row |= {"key_bits": rotations.key_bits.get(layer_id, base_key),
                    "value_bits": rotations.value_bits.get(layer_id, base_value)}
        rows.append(row)
    return rows


def format_summary(summary: dict) -> str:
    lines = [
        f"Wrote {summary['out']}: {summary['layers']} layers from {summary['tokens']} tokens in "
        f"{summary['seconds']} s (peak memory {summary['peak_rss_mib']:.0f} MiB)",
        "",
        "layer | C_Q eigenvalue max/min | C_Q top share | C_S max/min" + (" | K choice | V choice"
                                                                           if "key" in summary["per_layer"][0] else ""),
    ]
    for row in summary["per_layer"]:
        line = f"{row['layer']:>5} | {row['c_q_condition']:>22} | {row['c_q_top_share']:>13} | {row['c_s_condition']:>11}"
        if "key" in row:
            line += f" | {row['key']} | {row['value']}"
        if "key_bits" in row:
            line += f" | K{row['key_bits']} V{row['value_bits']}"
        lines.append(line)
    if "bit_allocation" in summary:
        a = summary["bit_allocation"]
        lines += ["", f"4-bit keys in layers {a['key_4bit_layers']}, 1-bit values in layers {a['value_1bit_layers']}: "
                      f"calibration KL of {a['method']} {a['baseline_kl']} -> {a['allocated_kl']} at the same history bits"]
    return "\n".join(lines)
