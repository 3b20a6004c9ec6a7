"""``oscar-hf calibrate``: rotations (and optionally per-layer clip ratios and bit widths) for any model, in one command."""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from oscar_hf.calibration.bit_allocation import BitAllocation, allocate_bits
from oscar_hf.calibration.clip_search import LayerChoice, search_layers
from oscar_hf.calibration.covariances import LayerCovariances, collect_covariances, rotations_from_covariances
from oscar_hf.calibration.data import calibration_batches, read_calibration_files
from oscar_hf.calibration.refine import refine_rotations
from oscar_hf.cli import checks
from oscar_hf.cli.common import environment, load
from oscar_hf.config import K_CLIP, METHODS, V_CLIP
from oscar_hf.core.models import DTYPES
from oscar_hf.provenance import provenance
from oscar_hf.rotations.rotation_set import COMPOSITION_NAMES, RotationSet

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
    covariances: dict[int, LayerCovariances] = {}
    choices: dict[int, LayerChoice] = {}
    if args.from_rotations:
        rotations, recipe = existing_set(args.from_rotations)
    else:
        covariances = collect_covariances(model, batches, progress=not args.json)
        rotations, choices = _fit(args, model, batches, covariances)
        recipe = _recipe(args, rotations, choices)
    allocation: BitAllocation | None = None
    if args.allocate_bits:
        rotations, allocation = allocate_bits(
            model,
            _search_rows(batches),
            rotations,
            args.allocate_bits,
            METHODS[args.allocate_for],
            progress=not args.json,
        )
    tokens = sum(b.numel() for b in batches)
    metadata = {
        "model_id": DEFAULT_MODEL_ID if args.model == DEFAULT_MODEL else args.model,
        "model_signature": model_signature(model),
        **recipe,
        "group_size": rotations.head_dim,
        "sink": METHODS["oscar-int2"].sink,
        "recent": METHODS["oscar-int2"].recent,
        "calibration_data": {
            "files": _file_hashes(files),
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
        summary["bit_allocation"] = {
            "method": args.allocate_for,
            "key_4bit_layers": allocation.key_layers,
            "value_1bit_layers": allocation.value_layers,
            "baseline_kl": round(allocation.baseline_kl, 6),
            "allocated_kl": round(allocation.allocated_kl, 6),
        }
    return out, summary


def _fit(
    args: argparse.Namespace, model, batches: list[torch.Tensor], covariances: dict[int, LayerCovariances]
) -> tuple[RotationSet, dict[int, LayerChoice]]:
    """The rotations (and clip ratios) of the recipe ``args`` ask for, and the clip search's choices."""
    if not args.clip_search:
        return rotations_from_covariances(covariances, args.objective, args.factors, args.per_head), {}
    rotations, choices = search_layers(
        model, _search_rows(batches), covariances, progress=not args.json, per_head=args.per_head
    )
    if args.refine:
        rotations, _ = refine_rotations(model, _refine_rows(batches), rotations, progress=not args.json)
    return rotations, choices


def _recipe(args: argparse.Namespace, rotations: RotationSet, choices: dict[int, LayerChoice]) -> dict:
    """The metadata that says how the rotations and clip ratios were made."""
    recipe = {
        "objective": args.objective,
        "composition": _composition(args),
        "source_grouping": "per_kv_head" if args.per_head else "layer",
        "clip": "per-layer (clip search)" if args.clip_search else {"key": K_CLIP, "value": V_CLIP},
    }
    if choices:
        recipe["layer_choices"] = {
            str(i): {
                "key": f"{c.key_factors}@{rotations.key_clip[i]}",
                "value": f"{c.value_factors}@{rotations.value_clip[i]}",
            }
            for i, c in choices.items()
        }
    return recipe


# What --from-rotations carries over from the set it starts from: how its rotations and clips were made.
_RECIPE_KEYS = ("objective", "composition", "source_grouping", "clip", "layer_choices")


def existing_set(path: str) -> tuple[RotationSet, dict]:
    """A saved set's rotations and clip ratios (its bit widths are replaced by the allocation) and the metadata
    of how they were made."""
    from oscar_hf.rotations.files import load_rotation_config
    from oscar_hf.rotations.hub import load_rotations

    config = load_rotation_config(path)
    rotations = load_rotations(path)
    recipe = {key: config[key] for key in _RECIPE_KEYS if key in config}
    made = {key: config.get(key) for key in ("command", "calibration_data", "tokens")}
    recipe["rotations_from"] = {**made, "files": _file_hashes(f for f in sorted(Path(path).iterdir()) if f.is_file())}
    return rotations, recipe


def _file_hashes(files: Iterable[Path]) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


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
    for layer_id in sorted(rotations.key):
        row: dict = {"layer": layer_id}
        if layer_id in covariances:
            q_ratio, q_share = _spread(torch.linalg.eigvalsh(covariances[layer_id].query))
            s_ratio, _ = _spread(torch.linalg.eigvalsh(covariances[layer_id].value))
            row |= {
                "c_q_condition": round(q_ratio, 1),
                "c_q_top_share": round(q_share, 3),
                "c_s_condition": round(s_ratio, 1),
            }
        if layer_id in choices:
            c = choices[layer_id]
            # The stored ratios: the search's, or those searched again after --refine.
            row |= {
                "key": f"{c.key_factors} clip {rotations.key_clip[layer_id]}",
                "value": f"{c.value_factors} clip {rotations.value_clip[layer_id]}",
            }
        if rotations.key_bits or rotations.value_bits:
            base_key, base_value = rotations.base_bits
            row |= {
                "key_bits": rotations.key_bits.get(layer_id, base_key),
                "value_bits": rotations.value_bits.get(layer_id, base_value),
            }
        rows.append(row)
    return rows


_COLUMNS = {
    "layer": "layer",
    "c_q_condition": "C_Q eigenvalue max/min",
    "c_q_top_share": "C_Q top share",
    "c_s_condition": "C_S max/min",
    "key": "K choice",
    "value": "V choice",
}


def format_summary(summary: dict) -> str:
    rows = summary["per_layer"]
    columns = {key: title for key, title in _COLUMNS.items() if key in rows[0]}
    widths = "key_bits" in rows[0]
    lines = [
        f"Wrote {summary['out']}: {summary['layers']} layers from {summary['tokens']} tokens in "
        f"{summary['seconds']} s (peak memory {summary['peak_rss_mib']:.0f} MiB)",
        "",
        " | ".join(columns.values()) + (" | widths" if widths else ""),
    ]
    for row in rows:
        line = " | ".join(str(row[key]).rjust(len(title)) for key, title in columns.items())
        lines.append(line + (f" | K{row['key_bits']} V{row['value_bits']}" if widths else ""))
    if "bit_allocation" in summary:
        a = summary["bit_allocation"]
        lines += [
            "",
            f"4-bit keys in layers {a['key_4bit_layers']}, 1-bit values in layers {a['value_1bit_layers']}: "
            f"calibration KL of {a['method']} {a['baseline_kl']} -> {a['allocated_kl']} at the same history bits",
        ]
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.cli.calibrate import existing_set, format_summary, run_calibration

    if args.clip_search and (args.objective != "qqt_sst" or args.factors != "UHP"):
        raise ValueError(
            "the clip search chooses between U·H·P and H·P itself: add --no-clip-search to pick "
            "--objective and --factors"
        )
    if args.refine and not args.clip_search:
        raise ValueError("--refine starts from the clip search's rotations and ratios; drop --no-clip-search")
    if args.allocate_bits and not args.clip_search:
        raise ValueError(
            "--allocate-bits ranks layers against the clip search's rotations and ratios; drop --no-clip-search"
        )
    if args.from_rotations and not args.allocate_bits:
        raise ValueError(
            "--from-rotations takes a saved set's rotations and clip ratios to allocate bit widths "
            "anew: add --allocate-bits N"
        )
    if args.from_rotations and (args.refine or args.per_head or not args.clip_search):
        raise ValueError(
            "--from-rotations keeps the saved set's rotations: drop --refine, --per-head and --no-clip-search"
        )
    if args.allocate_for != "oscar-int2":
        from oscar_hf.calibration.bit_allocation import value_layers_per_key_layer

        if not args.allocate_bits:
            raise ValueError(
                "--allocate-for names the method an --allocate-bits allocation is for; add --allocate-bits N"
            )
        value_layers_per_key_layer(METHODS[args.allocate_for])
    checks.check_files(args.data, "--data")
    checks.check_output(args.out, "--out", folder=True)
    if args.from_rotations:
        try:  # a readable oscar-hf set, before the model loads
            existing_set(args.from_rotations)
        except (FileNotFoundError, ValueError) as error:
            raise ValueError(f"--from-rotations: {error}") from None
    model, tokenizer = load(args)
    _, summary = run_calibration(args, model, tokenizer, argv)
    print(json.dumps({**environment(argv), **summary}) if args.json else format_summary(summary))


def add_calibrate_command(commands) -> None:
    """``oscar-hf calibrate``, on ``commands`` (the top-level subparsers)."""
    calibrate = commands.add_parser("calibrate", help="fit OSCAR rotations (and clip ratios) to a model")
    calibrate.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct), a hub id or a local dir"
    )
    calibrate.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    calibrate.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="text files (documents) and/or .jsonl files (one prompt or chat per line), read in place",
    )
    calibrate.add_argument("--tokens", type=checks.positive_int, default=20000, help="calibration token budget")
    calibrate.add_argument("--out", required=True, help="directory to write the rotations to")
    calibrate.add_argument(
        "--clip-search",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="choose each layer's clip ratios and rotation variant (U·H·P or H·P) by attention-output "
        "error, the recipe oscar-int2 is best with (default); --no-clip-search: plain "
        "--factors rotations and the fixed clips, the paper's recipe (oscar-int2-paper)",
    )
    calibrate.add_argument(
        "--refine",
        action="store_true",
        help="after the clip search, fit each R_K/R_V on the orthogonal group to the quantized "
        "attention-output error and search its clip ratio again (slower)",
    )
    calibrate.add_argument(
        "--allocate-bits",
        type=checks.non_negative_int,
        default=0,
        metavar="N",
        help="after --clip-search, store 4-bit keys in the N layers where they cut the calibration "
        "KL most and 1-bit values in the layers where they cost least, as many as keep the "
        "history bits of the --allocate-for method (2N for oscar-int2, N for oscar-k3v2)",
    )
    calibrate.add_argument(
        "--allocate-for",
        choices=sorted(METHODS),
        default="oscar-int2",
        metavar="METHOD",
        help="the method whose widths --allocate-bits trades against (oscar-int2 or oscar-k3v2; "
        "default oscar-int2); only that method takes the stored widths",
    )
    calibrate.add_argument(
        "--from-rotations",
        metavar="DIR",
        help="with --allocate-bits: start from a saved set's rotations and clip ratios instead of "
        "calibrating them (e.g. to allocate widths for another method from the same set)",
    )
    calibrate.add_argument("--chat", action="store_true", help="render .jsonl prompts with the chat template")
    calibrate.add_argument("--seq-len", type=checks.positive_int, default=2048)
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--objective", choices=["qqt_sst", "ktk_vtv"], default="qqt_sst")
    calibrate.add_argument("--factors", choices=["UHP", "UH", "UP", "HP", "H", "U", ""], default="UHP")
    calibrate.add_argument(
        "--per-head",
        action="store_true",
        help="one rotation per KV head, from that head's own C_Q and C_S (default: one per layer)",
    )
    calibrate.add_argument("--json", action="store_true")
    calibrate.set_defaults(handler=cmd_calibrate)
