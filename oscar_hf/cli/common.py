"""What the ``oscar-hf`` commands share: the methods a command runs by default, the rotations and the
model they load, and their common options."""

from __future__ import annotations

import argparse
from pathlib import Path

from oscar_hf.cli import checks
from oscar_hf.config import METHODS
from oscar_hf.core.models import DTYPES
from oscar_hf.provenance import command_line, provenance
from oscar_hf.rotations.rotation_set import MethodRotations

# One command's default methods: every recipe but the paper's (asked for by name, oscar-int2-paper).
ONE_RECIPE_METHODS = [m for m, config in METHODS.items() if not config.shared_rotations]


def rotations_for(
    model_name: str, rotations_dir: str | None, shared: bool = False, methods: list[str] = ()
) -> MethodRotations:
    """Rotations from ``--rotations`` (its per-KV-head ones where it has them, unless ``shared``), else for
    the default model each calibrated method's bundled set (:func:`oscar_hf.rotations.resolve.bundled_set_name`),
    else none."""
    from oscar_hf.core.models import DEFAULT_MODEL, DEFAULT_MODEL_ID
    from oscar_hf.rotations.hub import load_rotations
    from oscar_hf.rotations.resolve import bundled_rotations_dir, bundled_set_name

    if rotations_dir:
        return load_rotations(rotations_dir, per_head=False if shared else None)
    if model_name != DEFAULT_MODEL:
        return None
    calibrated = [m for m in methods if METHODS[m].rotation == "calibrated"]
    names = {m: bundled_set_name(DEFAULT_MODEL_ID, m) for m in calibrated}
    sets = {name: load_rotations(bundled_rotations_dir(name)) for name in set(names.values())}
    return {m: sets[name] for m, name in names.items()}


def environment(argv: list[str]) -> dict:
    """The command line, machine and versions a result records."""
    return provenance(command_line("oscar-hf", argv))


def command_rotations(args: argparse.Namespace) -> MethodRotations:
    """The rotations the command's methods use (checked before the model loads)."""
    try:
        return rotations_for(args.model, args.rotations, args.shared_rotations, args.methods)
    except (FileNotFoundError, ValueError) as error:  # (the zoo's RotationsNotFoundError included)
        raise ValueError(f"rotations: {error}") from None


def load(args: argparse.Namespace):
    """The model and tokenizer of ``--model`` at ``--dtype`` (a ValueError in the option's words)."""
    from oscar_hf.core.models import ModelNotInstalledError, load_model

    checks.check_model(args.model)
    try:
        return load_model(args.model, dtype=DTYPES[args.dtype])
    except (OSError, ValueError, ModelNotInstalledError) as error:  # "not a local folder nor a hub id"
        raise ValueError(f"--model {args.model}: {error}") from None


def text_tokens(model, tokenizer, path: Path, text: str, ctx: int):
    """The text's token ids, at least ``ctx`` of them, ``ctx`` within the model's context."""
    from oscar_hf.core.models import model_context

    limit = model_context(model)
    if limit is not None and ctx > limit:
        raise ValueError(f"--ctx {ctx} exceeds the model's context of {limit} tokens")
    token_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if token_ids.numel() < ctx:
        raise ValueError(f"{path} has {token_ids.numel()} tokens, fewer than --ctx {ctx}")
    return token_ids


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--rotations``, ``--shared-rotations`` and ``--dtype``."""
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a hub id or a local dir")
    parser.add_argument("--rotations", help="rotation directory (default: the bundled ones for the default model)")
    parser.add_argument(
        "--shared-rotations",
        action="store_true",
        help="from a folder that also holds per-KV-head rotations, take the shared (one per layer) ones",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="auto",
        help="model dtype; auto = float32 on CPU, bfloat16 on GPU (windows are stored in it)",
    )


def add_report_options(parser: argparse.ArgumentParser, handler, example_stem: str) -> None:
    """``--json`` and ``--out STEM`` (JSON, markdown and PNG) of an evaluation that draws a plot."""
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help=f"write STEM.json, STEM.md and STEM.png (e.g. {example_stem})")
    parser.set_defaults(handler=handler)
