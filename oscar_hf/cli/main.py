"""The ``oscar-hf`` command line: ``demo``, ``eval ...``, ``calibrate``, ``memory``, ``lm-eval-tasks``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from oscar_hf.cli import checks
from oscar_hf.config import METHODS
from oscar_hf.core.models import DTYPES
from oscar_hf.evaluation.niah import parse_depths, parse_lengths
from oscar_hf.log import get_logger
from oscar_hf.provenance import provenance
from oscar_hf.rotations.rotation_set import MethodRotations

logger = get_logger(__name__)


# One command's default methods: every recipe but the paper's (asked for by name, oscar-int2-paper).
ONE_RECIPE_METHODS = [m for m, config in METHODS.items() if not config.shared_rotations]


def _rotations_for(
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


def _environment(argv: list[str]) -> dict:
    return provenance("oscar-hf " + " ".join(argv))


def _rotations(args: argparse.Namespace) -> MethodRotations:
    """The rotations the command's methods use (checked before the model loads)."""
    try:
        return _rotations_for(args.model, args.rotations, args.shared_rotations, args.methods)
    except (FileNotFoundError, ValueError) as error:  # (the zoo's RotationsNotFoundError included)
        raise ValueError(f"rotations: {error}") from None


def _load(args: argparse.Namespace):
    from oscar_hf.core.models import ModelNotInstalledError, load_model

    checks.check_model(args.model)
    try:
        return load_model(args.model, dtype=DTYPES[args.dtype])
    except (OSError, ValueError, ModelNotInstalledError) as error:  # "not a local folder nor a hub id"
        raise ValueError(f"--model {args.model}: {error}") from None


def _text_tokens(model, tokenizer, path: Path, text: str, ctx: int):
    """The text's token ids, at least ``ctx`` of them, ``ctx`` within the model's context."""
    from oscar_hf.core.models import model_context

    limit = model_context(model)
    if limit is not None and ctx > limit:
        raise ValueError(f"--ctx {ctx} exceeds the model's context of {limit} tokens")
    token_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if token_ids.numel() < ctx:
        raise ValueError(f"{path} has {token_ids.numel()} tokens, fewer than --ctx {ctx}")
    return token_ids


def cmd_demo(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.demo import format_demo, run_demo

    rotations = _rotations(args)  # every option is checked before the model loads
    calibrated = [m for m in args.methods if METHODS[m].rotation == "calibrated"]
    if calibrated and rotations is None:
        raise ValueError(
            f"{', '.join(calibrated)} needs rotations calibrated for {args.model}: "
            "pass --rotations DIR (see oscar-hf calibrate)"
        )
    model, tokenizer = _load(args)
    demo = run_demo(model, tokenizer, args.methods, rotations, args.max_new_tokens)
    print(json.dumps({**_environment(argv), **demo.to_dict()}) if args.json else format_demo(demo))


def cmd_eval_kl(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.kl import evaluate_methods, scores_to_markdown

    text = checks.read_text(args.text, "--text")
    checks.check_ctx(args.ctx, args.methods)
    if args.out:
        checks.check_output(args.out, "--out")
    rotations = _rotations(args)
    model, tokenizer = _load(args)
    token_ids = _text_tokens(model, tokenizer, Path(args.text), text, args.ctx)
    scores = evaluate_methods(
        model, token_ids, args.methods, rotations, context=args.ctx, windows=args.windows, progress=not args.json
    )
    result = {
        **_environment(argv),
        "model": args.model,
        "text": str(args.text),
        "text_tokens": int(token_ids.numel()),
        "ctx": args.ctx,
        "windows": args.windows,
        "scores": [s.to_dict() for s in scores],
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else scores_to_markdown(scores))


def cmd_memory(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.demo import filled_context, prefill_report

    if args.text:
        checks.read_text(args.text, "--text")
    rotations = _rotations(args)
    model, tokenizer = _load(args)
    ids = filled_context(tokenizer, args.tokens, Path(args.text) if args.text else None)
    reports = [prefill_report(model, ids, method, rotations) for method in args.methods]
    if args.json:
        print(
            json.dumps(
                {
                    **_environment(argv),
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


def cmd_eval_tasks(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.data import data_dir
    from oscar_hf.evaluation.task_eval import run_tasks

    folder = checks.data_folder(args.data_dir) if args.data_dir else data_dir()  # neither: the public datasets
    checks.check_output(args.out, "--out", folder=True)
    checks.check_tasks(args.tasks, args.task_dir, folder)
    rotations = _rotations(args)
    model, tokenizer = _load(args)
    summary = run_tasks(
        model,
        tokenizer,
        methods=args.methods,
        tasks=args.tasks,
        seeds=args.seeds,
        out_dir=args.out,
        limit=args.limit,
        data_dir=folder,
        max_gen_toks=args.max_gen_toks,
        temperature=args.temperature,
        rotations=rotations,
        sink=args.sink,
        recent=args.recent,
        batch_size=args.batch_size,
        think_end_token=args.think_end_token,
        task_dirs=args.task_dir,
        environment=_environment(argv),
        progress=not args.json,
    )
    print(json.dumps(summary) if args.json else summary["table"])


def cmd_eval_niah(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.niah import (
        Haystack,
        haystack_files,
        niah_markdown,
        niah_result,
        plot_niah,
        read_haystack,
        run_niah,
    )
    from oscar_hf.evaluation.report import write_outputs

    started = time.perf_counter()
    files = haystack_files(checks.data_folder(args.data_dir), args.haystack)
    if args.out:
        checks.check_output(args.out, "--out")
    rotations = _rotations(args)
    model, tokenizer = _load(args)
    haystack = Haystack(tokenizer, read_haystack(files))
    seeds = list(range(args.seed, args.seed + args.needles))
    trials = run_niah(
        model,
        tokenizer,
        haystack,
        args.methods,
        args.lengths,
        args.depths,
        seeds,
        rotations,
        args.max_new_tokens,
        chat=not args.no_chat,
        progress=not args.json,
    )
    settings = {
        "model": args.model,
        "dtype": str(model.dtype),
        "haystack": f"{args.haystack} ({files[0].parent})",
        "haystack_tokens": len(haystack),
        "methods": args.methods,
        "lengths": args.lengths,
        "depths": args.depths,
        "seeds": seeds,
        "max_new_tokens": args.max_new_tokens,
        "chat": not args.no_chat and bool(getattr(tokenizer, "chat_template", None)),
    }
    result = niah_result(trials, {**_environment(argv), "seconds": round(time.perf_counter() - started)}, settings)
    if args.out:
        for path in write_outputs(result, Path(args.out), niah_markdown(result), plot_niah):
            logger.info("wrote %s", path)
    print(json.dumps(result) if args.json else niah_markdown(result))


def cmd_eval_kl_curve(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.data import WIKITEXT2_TEST
    from oscar_hf.evaluation.kl_curve import kl_curve_markdown, kl_curve_result, plot_kl_curve, position_stats
    from oscar_hf.evaluation.report import write_outputs

    started = time.perf_counter()
    text_path = Path(args.text) if args.text else None
    if text_path is None:
        folder = checks.data_folder(args.data_dir)
        if folder is None:
            raise ValueError("no --text and no data directory (pass --text FILE, --data-dir or set $OSCAR_HF_DATA_DIR)")
        text_path = folder / WIKITEXT2_TEST
    text = checks.read_text(text_path, "--text")
    checks.check_ctx(args.ctx, args.methods)
    if args.out:
        checks.check_output(args.out, "--out")
    rotations = _rotations(args)
    model, tokenizer = _load(args)
    token_ids = _text_tokens(model, tokenizer, text_path, text, args.ctx)
    stats, starts, first = position_stats(
        model, token_ids, args.methods, rotations, args.ctx, args.windows, progress=not args.json
    )
    settings = {
        "model": args.model,
        "dtype": str(model.dtype),
        "text": str(text_path),
        "text_tokens": int(token_ids.numel()),
        "ctx": args.ctx,
        "windows": args.windows,
        "methods": args.methods,
    }
    meta = {**_environment(argv), "seconds": round(time.perf_counter() - started)}
    result = kl_curve_result(stats, starts, first, args.bucket, meta, settings)
    if args.out:
        for path in write_outputs(result, Path(args.out), kl_curve_markdown(result), plot_kl_curve):
            logger.info("wrote %s", path)
    print(json.dumps(result) if args.json else kl_curve_markdown(result))


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
    model, tokenizer = _load(args)
    _, summary = run_calibration(args, model, tokenizer, argv)
    print(json.dumps({**_environment(argv), **summary}) if args.json else format_summary(summary))


def _add_model_options(parser: argparse.ArgumentParser) -> None:
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


def _add_report_options(parser: argparse.ArgumentParser, handler, example_stem: str) -> None:
    """``--json`` and ``--out STEM`` (JSON, markdown and PNG) of an evaluation that draws a plot."""
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help=f"write STEM.json, STEM.md and STEM.png (e.g. {example_stem})")
    parser.set_defaults(handler=handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-hf", description="OSCAR 2-bit KV-cache quantization for transformers")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="answer a question about a ~1,500-token document with an uncompressed "
        "and a 2-bit KV cache; compare answers, KV memory and speed",
    )
    _add_model_options(demo)
    demo.add_argument(
        "--methods",
        type=checks.methods,
        default=[m for m in METHODS if m != "none"],
        help="caches to compare with the uncompressed one (none, always run first); default: every method",
    )
    demo.add_argument("--max-new-tokens", type=checks.positive_int, default=40)
    demo.add_argument("--json", action="store_true", help="print one machine-readable JSON object")
    demo.set_defaults(handler=cmd_demo)

    evaluate = commands.add_parser("eval", help="evaluations").add_subparsers(dest="evaluation", required=True)
    kl = evaluate.add_parser("kl", help="teacher-forced perplexity and KL from BF16 per method")
    _add_model_options(kl)
    kl.add_argument("--text", required=True, help="a UTF-8 text file, read in place (required)")
    kl.add_argument(
        "--ctx",
        type=checks.positive_int,
        default=2048,
        help="tokens per window: each window is decoded teacher-forced from an empty cache",
    )
    kl.add_argument(
        "--windows",
        type=checks.positive_int,
        default=6,
        help="windows of --ctx tokens spread evenly over the text (they overlap when it is short)",
    )
    kl.add_argument(
        "--methods",
        type=checks.methods,
        default=["none", "naive-int2", "quarot-int2", "oscar-int2"],
        help="comma-separated methods (none is the reference the KL is taken from)",
    )
    kl.add_argument(
        "--json", action="store_true", help="print one JSON object (with the command and machine) instead of a table"
    )
    kl.add_argument("--out", help="also write the JSON result to this file")
    kl.set_defaults(handler=cmd_eval_kl)

    niah = evaluate.add_parser(
        "niah", help="needle in a haystack: retrieve a 7-digit number at several depths and lengths"
    )
    _add_model_options(niah)
    niah.add_argument("--methods", type=checks.methods, default=ONE_RECIPE_METHODS)
    niah.add_argument(
        "--lengths",
        type=checks.parsed(parse_lengths),
        default=[2048, 4096],
        help="prompt lengths in tokens, e.g. 2K,4K,8176 (prompt + new tokens must fit the context)",
    )
    niah.add_argument(
        "--depths",
        type=checks.parsed(parse_depths),
        default=[0.0, 25.0, 50.0, 75.0, 100.0],
        help="needle depths in %% of the haystack",
    )
    niah.add_argument("--needles", type=checks.positive_int, default=2, help="needles (seeds) per length and depth")
    niah.add_argument("--seed", type=int, default=0, help="first seed; needle i uses seed + i")
    niah.add_argument(
        "--haystack",
        choices=["essays", "gutenberg"],
        default="essays",
        help="Paul Graham essays (niah_paul_graham_essays/) or Gutenberg books (gutenberg_books/)",
    )
    niah.add_argument(
        "--data-dir", help="folder holding the haystack folders, read in place (default $OSCAR_HF_DATA_DIR)"
    )
    niah.add_argument("--max-new-tokens", type=checks.positive_int, default=12)
    niah.add_argument("--no-chat", action="store_true", help="plain prompt instead of the chat template")
    _add_report_options(niah, cmd_eval_niah, "eval/results/niah_default")

    curve = evaluate.add_parser(
        "kl-curve", help="teacher-forced KL from BF16 per method as a function of context length"
    )
    _add_model_options(curve)
    curve.add_argument("--text", help="a UTF-8 text file, read in place (default: WikiText-2 test in the data dir)")
    curve.add_argument("--data-dir", help="default $OSCAR_HF_DATA_DIR")
    curve.add_argument("--ctx", type=checks.positive_int, default=8192, help="window length: the curve runs up to it")
    curve.add_argument("--windows", type=checks.positive_int, default=2)
    curve.add_argument("--bucket", type=checks.positive_int, default=256, help="positions averaged per point")
    curve.add_argument("--methods", type=checks.methods, default=ONE_RECIPE_METHODS)
    _add_report_options(curve, cmd_eval_kl_curve, "eval/results/kl_curve_default")

    tasks = evaluate.add_parser("tasks", help="accuracy on reasoning/code tasks through lm-eval (the paper's Table 2)")
    _add_model_options(tasks)
    tasks.add_argument("--methods", type=checks.methods, default=ONE_RECIPE_METHODS)
    tasks.add_argument(
        "--tasks",
        type=checks.names,
        default=["aime25", "gpqa_diamond", "math500", "gsm8k", "humaneval"],
        help="short task names: the YAMLs in oscar_hf/tasks (and --task-dir)",
    )
    tasks.add_argument("--limit", type=checks.positive_int, help="first N examples of each task")
    tasks.add_argument(
        "--seeds", type=checks.positive_int, default=1, help="runs per (method, task); seeds only matter with sampling"
    )
    tasks.add_argument("--out", required=True, help="output folder: runs/*.json, table.md, summary.json, accuracy.png")
    tasks.add_argument(
        "--data-dir",
        help="local data (read in place; default $OSCAR_HF_DATA_DIR; neither: lm-eval's public datasets, downloaded)",
    )
    tasks.add_argument(
        "--max-gen-toks", type=checks.positive_int, help="cap on generated tokens per answer (tasks ask up to 32,768)"
    )
    tasks.add_argument(
        "--temperature",
        type=checks.non_negative_float,
        default=0.0,
        help="0 = greedy; > 0 samples with top_p 0.95, top_k 40 (the paper: 1.0)",
    )
    tasks.add_argument("--sink", type=checks.non_negative_int, default=64)
    tasks.add_argument("--recent", type=checks.non_negative_int, default=256)
    tasks.add_argument("--batch-size", type=checks.positive_int, default=1)
    tasks.add_argument("--think-end-token", help="e.g. </think>: stop strings only apply after it")
    tasks.add_argument("--task-dir", action="append", default=[], help="a folder of extra task YAMLs")
    tasks.add_argument("--json", action="store_true")
    tasks.set_defaults(handler=cmd_eval_tasks)

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
    _add_model_options(memory)
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
