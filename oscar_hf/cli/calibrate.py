"""``oscar-hf calibrate``: a thin command line over :func:`oscar_hf.calibration.recipe.calibrate`."""

from __future__ import annotations

import argparse
import dataclasses
import json

from oscar_hf.calibration.recipe import Recipe, calibrate
from oscar_hf.calibration.record import existing_set
from oscar_hf.cli import checks
from oscar_hf.cli.common import environment, load
from oscar_hf.config import METHODS
from oscar_hf.core.models import DTYPES
from oscar_hf.provenance import command_line


def recipe_of(args: argparse.Namespace) -> Recipe:
    """The recipe the command's flags ask for (each field is the flag of its name; a ValueError for a
    combination that cannot be made)."""
    return Recipe(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Recipe)})


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
            f"keys widened in layers {a['key_bits']} (layer: bits), 1-bit values in layers {a['value_1bit_layers']}: "
            f"calibration KL of {a['method']} {a['baseline_kl']} -> {a['allocated_kl']} at the same history bits",
        ]
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.core.models import DEFAULT_MODEL, DEFAULT_MODEL_ID

    recipe = recipe_of(args)
    checks.check_files(args.data, "--data")
    checks.check_output(args.out, "--out", folder=True)
    if args.from_rotations:
        try:  # a readable oscar-hf set, before the model loads
            existing_set(args.from_rotations)
        except (FileNotFoundError, ValueError) as error:
            raise ValueError(f"--from-rotations: {error}") from None
    model, tokenizer = load(args)
    model_id = DEFAULT_MODEL_ID if args.model == DEFAULT_MODEL else args.model
    command = command_line("oscar-hf", argv)  # a saved set is shared: it names no path of this machine
    result = calibrate(model, tokenizer, args.data, recipe, model_id, command, progress=not args.json)
    summary = {"out": str(result.save(args.out)), **result.summary}
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
        help="after --clip-search, spend the bits of 4-bit keys in N layers on keys of the --allocate-key-bits "
        "widths where they cut the calibration KL most, paid for by 1-bit values in the layers where they cost "
        "least, as many as keep the history bits of the --allocate-for method (2N for oscar-int2, N for oscar-k3v2)",
    )
    calibrate.add_argument(
        "--allocate-key-bits",
        type=int,
        nargs="+",
        choices=(3, 4),
        default=(3, 4),
        metavar="BITS",
        help="the key widths --allocate-bits may give, of those above the --allocate-for method's (default 3 4: "
        "two 3-bit key layers may take the bits of one 4-bit layer; 4 gives 4-bit keys only)",
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
        "--search-for",
        choices=sorted(name for name, config in METHODS.items() if config.rotation == "calibrated"),
        default="oscar-int2",
        metavar="METHOD",
        help="the method whose quantization the clip search measures errors under (default oscar-int2; "
        "e.g. oscar-k3v2 for a set made for 3-bit keys)",
    )
    calibrate.add_argument(
        "--from-rotations",
        metavar="DIR",
        help="with --allocate-bits or --key-feedback: start from a saved set's rotations and clip ratios "
        "instead of calibrating them (e.g. to allocate widths for another method from the same set)",
    )
    calibrate.add_argument(
        "--key-feedback",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store each layer's key feedback factors (keys then feed their quantization errors forward so that "
        "they cancel in the scores), from the queries of rows of --feedback-seq-len tokens; default: on with "
        "the clip search, off with --no-clip-search",
    )
    calibrate.add_argument(
        "--feedback-seq-len",
        type=checks.positive_int,
        default=8192,
        help="row length of the key feedback's queries: the contexts the cache will hold (at most the model's)",
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
    calibrate.add_argument(
        "--center-keys",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store keys centered on their calibration mean per layer and KV head (softmax ignores the shift); "
        "default: on with the clip search, off with --no-clip-search, --refine and --from-rotations",
    )
    calibrate.add_argument("--json", action="store_true")
    calibrate.set_defaults(handler=cmd_calibrate)
