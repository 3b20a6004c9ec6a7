"""``oscar-hf eval ...``: KL from BF16 (at one context or as a curve over positions), needles in a
haystack, and accuracy on lm-eval tasks."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from oscar_hf.cli import checks
from oscar_hf.cli.common import (
    ONE_RECIPE_METHODS,
    add_model_options,
    add_report_options,
    command_rotations,
    environment,
    load,
    text_tokens,
)
from oscar_hf.evaluation.niah import parse_depths, parse_lengths
from oscar_hf.log import get_logger
from oscar_hf.provenance import portable_path

logger = get_logger(__name__)


def cmd_eval_kl(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.kl import evaluate_methods, scores_to_markdown

    text = checks.read_text(args.text, "--text")
    checks.check_ctx(args.ctx, args.methods)
    if args.out:
        checks.check_output(args.out, "--out")
    rotations = command_rotations(args)
    model, tokenizer = load(args)
    token_ids = text_tokens(model, tokenizer, Path(args.text), text, args.ctx)
    scores = evaluate_methods(
        model, token_ids, args.methods, rotations, context=args.ctx, windows=args.windows, progress=not args.json
    )
    result = {
        **environment(argv),
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


def cmd_eval_tasks(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.data import data_dir
    from oscar_hf.evaluation.task_eval import run_tasks

    folder = checks.data_folder(args.data_dir) if args.data_dir else data_dir()  # neither: the public datasets
    checks.check_output(args.out, "--out", folder=True)
    checks.check_tasks(args.tasks, args.task_dir, folder)
    rotations = command_rotations(args)
    model, tokenizer = load(args)
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
        environment=environment(argv),
        progress=not args.json,
    )
    print(json.dumps(summary) if args.json else summary["table"])


def cmd_eval_niah(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.haystack import Haystack, haystack_files, read_haystack
    from oscar_hf.evaluation.niah import niah_markdown, niah_result, plot_niah, run_niah
    from oscar_hf.evaluation.report import write_outputs

    started = time.perf_counter()
    files = haystack_files(checks.data_folder(args.data_dir), args.haystack)
    if args.out:
        checks.check_output(args.out, "--out")
    rotations = command_rotations(args)
    model, tokenizer = load(args)
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
        "haystack": f"{args.haystack} ({portable_path(files[0].parent)})",
        "haystack_tokens": len(haystack),
        "methods": args.methods,
        "lengths": args.lengths,
        "depths": args.depths,
        "seeds": seeds,
        "max_new_tokens": args.max_new_tokens,
        "chat": not args.no_chat and bool(getattr(tokenizer, "chat_template", None)),
    }
    result = niah_result(trials, {**environment(argv), "seconds": round(time.perf_counter() - started)}, settings)
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
    rotations = command_rotations(args)
    model, tokenizer = load(args)
    token_ids = text_tokens(model, tokenizer, text_path, text, args.ctx)
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
    meta = {**environment(argv), "seconds": round(time.perf_counter() - started)}
    result = kl_curve_result(stats, starts, first, args.bucket, meta, settings)
    if args.out:
        for path in write_outputs(result, Path(args.out), kl_curve_markdown(result), plot_kl_curve):
            logger.info("wrote %s", path)
    print(json.dumps(result) if args.json else kl_curve_markdown(result))


def add_eval_commands(commands) -> None:
    """The ``eval`` command group and its commands, on ``commands`` (the top-level subparsers)."""
    evaluate = commands.add_parser("eval", help="evaluations").add_subparsers(dest="evaluation", required=True)
    kl = evaluate.add_parser("kl", help="teacher-forced perplexity and KL from BF16 per method")
    add_model_options(kl)
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
    add_model_options(niah)
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
    add_report_options(niah, cmd_eval_niah, "eval/results/niah_default")

    curve = evaluate.add_parser(
        "kl-curve", help="teacher-forced KL from BF16 per method as a function of context length"
    )
    add_model_options(curve)
    curve.add_argument("--text", help="a UTF-8 text file, read in place (default: WikiText-2 test in the data dir)")
    curve.add_argument("--data-dir", help="default $OSCAR_HF_DATA_DIR")
    curve.add_argument("--ctx", type=checks.positive_int, default=8192, help="window length: the curve runs up to it")
    curve.add_argument("--windows", type=checks.positive_int, default=2)
    curve.add_argument("--bucket", type=checks.positive_int, default=256, help="positions averaged per point")
    curve.add_argument("--methods", type=checks.methods, default=ONE_RECIPE_METHODS)
    add_report_options(curve, cmd_eval_kl_curve, "eval/results/kl_curve_default")

    tasks = evaluate.add_parser("tasks", help="accuracy on reasoning/code tasks through lm-eval (the paper's Table 2)")
    add_model_options(tasks)
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
