"""The ``oscar-hf`` command line: ``demo``, ``eval ...``, ``calibrate``, ``memory``, ``lm-eval-tasks``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from oscar_hf.cli import checks
from oscar_hf.cli.calibrate import add_calibrate_command
from oscar_hf.cli.common import add_model_options, command_rotations, environment, load
from oscar_hf.cli.eval_commands import add_eval_commands
from oscar_hf.config import METHODS
from oscar_hf.log import get_logger

logger = get_logger(__name__)


def cmd_demo(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.demo import format_demo, run_demo

    rotations = command_rotations(args)  # every option is checked before the model loads
    calibrated = [m for m in args.methods if METHODS[m].rotation == "calibrated"]
    if calibrated and rotations is None:
        raise ValueError(
            f"{', '.join(calibrated)} needs rotations calibrated for {args.model}: "
            "pass --rotations DIR (see oscar-hf calibrate)"
        )
    model, tokenizer = load(args)
    demo = run_demo(model, tokenizer, args.methods, rotations, args.max_new_tokens)
    print(json.dumps({**environment(argv), **demo.to_dict()}) if args.json else format_demo(demo))


def cmd_memory(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.demo import filled_context, prefill_report

    if args.text:
        checks.read_text(args.text, "--text")
    rotations = command_rotations(args)
    model, tokenizer = load(args)
    ids = filled_context(tokenizer, args.tokens, Path(args.text) if args.text else None)
    reports = [prefill_report(model, ids, method, rotations) for method in args.methods]
    if args.json:
        print(
            json.dumps(
                {
                    **environment(argv),
                    "model": args.model,
                    "dtype": str(model.dtype),
                    "reports": [r.to_dict() if args.per_layer else r.summary() for r in reports],
                }
            )
        )
        return
    for report in reports:
        print(f"## {report.method}\n\n{report.to_markdown() if args.per_layer else report}\n")


def cmd_lm_eval_tasks(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.tasks import available_tasks, write_task_configs

    folder = checks.data_folder(args.data_dir)
    if folder is None:
        raise ValueError(
            "no local data: pass --data-dir or set $OSCAR_HF_DATA_DIR "
            "(online, lm-eval's own tasks need no YAMLs: --tasks gsm8k)"
        )
    checks.check_folders(args.task_dir, "--task-dir")
    checks.check_output(args.out, "--out", folder=True)
    specs = [
        s
        for s in available_tasks(args.task_dir).values()  # the tasks whose files are here
        if all((folder / f).exists() for f in s.data_files.values())
    ]
    names = write_task_configs(specs, folder, args.out)
    print(
        f"wrote {', '.join(sorted(names.values()))} to {args.out}; run them with\n"
        f"  lm_eval --model oscar --model_args pretrained=default,method=oscar-int2 "
        f"--include_path {args.out} --tasks {','.join(sorted(names.values()))} --limit 2"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-hf", description="OSCAR 2-bit KV-cache quantization for transformers")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="answer a question about a ~1,500-token document with an uncompressed "
        "and a 2-bit KV cache; compare answers, KV memory and speed",
    )
    add_model_options(demo)
    demo.add_argument(
        "--methods",
        type=checks.methods,
        default=[m for m in METHODS if m != "none"],
        help="caches to compare with the uncompressed one (none, always run first); default: every method",
    )
    demo.add_argument("--max-new-tokens", type=checks.positive_int, default=40)
    demo.add_argument("--json", action="store_true", help="print one machine-readable JSON object")
    demo.set_defaults(handler=cmd_demo)

    add_eval_commands(commands)
    add_calibrate_command(commands)

    tasks_out = commands.add_parser(
        "lm-eval-tasks",
        help="write the offline lm-eval tasks (oscar_gsm8k, ...) for local data, "
        "for lm_eval --model oscar ... --include_path OUT",
    )
    tasks_out.add_argument("--data-dir", help="local data, read in place (default $OSCAR_HF_DATA_DIR)")
    tasks_out.add_argument("--out", required=True, help="folder for the task YAMLs")
    tasks_out.add_argument("--task-dir", action="append", default=[], help="a folder of extra task YAMLs")
    tasks_out.set_defaults(handler=cmd_lm_eval_tasks)

    memory = commands.add_parser("memory", help="prefill a long text and print each method's memory report")
    add_model_options(memory)
    memory.add_argument("--tokens", type=checks.positive_int, default=4096)
    memory.add_argument("--text", help="text to prefill (default: the demo document, repeated)")
    memory.add_argument("--methods", type=checks.methods, default=list(METHODS), help="default: every method")
    memory.add_argument("--per-layer", action="store_true", help="print the per-layer table")
    memory.add_argument("--json", action="store_true")
    memory.set_defaults(handler=cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        args.handler(args, argv)
    except (ValueError, FileNotFoundError) as error:  # bad input, in the checks' and the library's words
        command = " ".join(filter(None, [args.command, getattr(args, "evaluation", None)]))
        raise SystemExit(f"oscar-hf {command}: {' '.join(str(error).split())}") from None


if __name__ == "__main__":
    main()
