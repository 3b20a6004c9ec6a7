"""The ``oscar-hf`` command line: ``demo``, ``eval ...``, ``calibrate``, ``memory``, ``lm-eval-tasks``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path


from oscar_hf.core.config import METHODS
from oscar_hf.evaluation.niah import parse_depths, parse_lengths
from oscar_hf.log import get_logger
from oscar_hf.core.models import DTYPES
from oscar_hf.provenance import provenance
from oscar_hf.core.rotation_set import RotationSet

logger = get_logger(__name__)


# Every method but the paper's recipe, whose bundled rotations differ: one command's default methods.
ONE_RECIPE_METHODS = [m for m, config in METHODS.items() if not config.shared_rotations]


def _rotations_for(model_name: str, rotations_dir: str | None, shared: bool = False,
                   methods: list[str] = ()) -> RotationSet | None:  # fmt: skip
    """Rotations from ``--rotations`` (its per-KV-head ones where it has them, unless ``shared``), else the
    set bundled for the default model that ``methods`` use (clip-searched, or the paper's), else none."""
    from oscar_hf.core.models import DEFAULT_MODEL
    from oscar_hf.rotations.hub import load_rotations
    from oscar_hf.rotations.resolve import DEFAULT_PAPER_ROTATIONS, DEFAULT_ROTATIONS, bundled_rotations_dir

    if rotations_dir:
        return load_rotations(rotations_dir, per_head=False if shared else None)
    if model_name != DEFAULT_MODEL:
        return None
    recipes = {METHODS[m].shared_rotations for m in methods if METHODS[m].rotation == "calibrated"}
    if len(recipes) > 1:
        raise SystemExit("oscar-int2-paper uses the default model's bundled rotations made without the clip search, "
                         "the other calibrated methods the clip-searched ones: run them in separate commands, or "
                         "pass --rotations DIR")
    return load_rotations(bundled_rotations_dir(DEFAULT_PAPER_ROTATIONS if True in recipes else DEFAULT_ROTATIONS))


def _methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    return methods


def _environment(argv: list[str]) -> dict:
    return provenance("oscar-hf " + " ".join(argv))


def _load(args: argparse.Namespace):
    from oscar_hf.core.models import load_model

    return load_model(args.model, dtype=DTYPES[args.dtype])


def cmd_demo(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.demo import format_demo, run_demo

    # every option is checked before the model loads
    if args.max_new_tokens < 1:
        raise SystemExit(f"oscar-hf demo: --max-new-tokens must be at least 1, got {args.max_new_tokens}")
    try:
        rotations = _rotations_for(args.model, args.rotations, args.shared_rotations, args.methods)
    except (FileNotFoundError, ValueError) as error:  # (the zoo's RotationsNotFoundError included)
        raise SystemExit(f"oscar-hf demo: rotations: {error}") from None
    calibrated = [m for m in args.methods if METHODS[m].rotation == "calibrated"]
    if calibrated and rotations is None:
        raise SystemExit(f"oscar-hf demo: {', '.join(calibrated)} needs rotations calibrated for {args.model}: "
                         "pass --rotations DIR (see oscar-hf calibrate)")
    try:
        model, tokenizer = _load(args)
    except OSError as error:  # transformers' "not a local folder nor a hub id"
        raise SystemExit(f"oscar-hf demo: --model {args.model}: {error}") from None
    demo = run_demo(model, tokenizer, args.methods, rotations, args.max_new_tokens)
    print(json.dumps({**_environment(argv), **demo.to_dict()}) if args.json else format_demo(demo))


def cmd_eval_kl(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.kl import evaluate_methods, scores_to_markdown

    model, tokenizer = _load(args)
    rotations = _rotations_for(args.model, args.rotations, args.shared_rotations, args.methods)
    text = Path(args.text).read_text(encoding="utf-8")
    token_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
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
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else scores_to_markdown(scores))


def cmd_memory(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.demo import filled_context, prefill_report

    model, tokenizer = _load(args)
    rotations = _rotations_for(args.model, args.rotations, args.shared_rotations, args.methods)
    ids = filled_context(tokenizer, args.tokens, Path(args.text) if args.text else None)
    reports = [prefill_report(model, ids, method, rotations) for method in args.methods]
    if args.json:
        print(json.dumps({**_environment(argv), "model": args.model, "dtype": str(model.dtype),
                          "reports": [r.to_dict() if args.per_layer else r.summary() for r in reports]}))
        return
    for report in reports:
        print(f"## {report.method}\n\n{report.to_markdown() if args.per_layer else report}\n")


def cmd_lm_eval_tasks(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.tasks import available_tasks, write_task_configs

    folder = _data_folder(args.data_dir)
    if folder is None:
        raise SystemExit("no local data: pass --data-dir or set $OSCAR_HF_DATA_DIR "
                         "(online, lm-eval's own tasks need no YAMLs: --tasks gsm8k)")
    specs = [s for s in available_tasks(args.task_dir).values()  # the tasks whose files are here
             if all((folder / f).exists() for f in s.data_files.values())]
    names = write_task_configs(specs, folder, args.out)
    print(f"wrote {', '.join(sorted(names.values()))} to {args.out}; run them with\n"
          f"  lm_eval --model oscar --model_args pretrained=default,method=oscar-int2 "
          f"--include_path {args.out} --tasks {','.join(sorted(names.values()))} --limit 2")


def _tasks(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def cmd_eval_tasks(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.data import data_dir
    from oscar_hf.evaluation.task_eval import run_tasks

    folder = _data_folder(args.data_dir) if args.data_dir else data_dir()  # neither: the public datasets
    model, tokenizer = _load(args)
    rotations = _rotations_for(args.model, args.rotations, args.shared_rotations, args.methods)
    summary = run_tasks(
        model, tokenizer, methods=args.methods, tasks=args.tasks, seeds=args.seeds, out_dir=args.out,
        limit=args.limit, data_dir=folder, max_gen_toks=args.max_gen_toks, temperature=args.temperature,
        rotations=rotations, sink=args.sink, recent=args.recent, batch_size=args.batch_size,
        think_end_token=args.think_end_token, task_dirs=args.task_dir, environment=_environment(argv),
        progress=not args.json,
    )
    print(json.dumps(summary) if args.json else summary["table"])


def _arg(parse):
    """An argparse ``type`` that turns the parser's ValueError into a clean usage error."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = parse.__name__
    return convert


def _data_folder(given: str | None) -> Path | None:
    """``--data-dir`` if given (an error if it is not a folder), else ``$OSCAR_HF_DATA_DIR``, else ``../shared/data``."""
    from oscar_hf.evaluation.data import data_dir

    if given:
        if not Path(given).is_dir():
            raise SystemExit(f"--data-dir {given} is not a folder")
        return Path(given)
    return data_dir(Path("../shared/data"))


def cmd_eval_niah(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.report import write_outputs
    from oscar_hf.evaluation.niah import (Haystack, NeedleError, haystack_files, niah_markdown, niah_result, plot_niah, read_haystack,
                       run_niah)

    started = time.perf_counter()
    try:
        files = haystack_files(_data_folder(args.data_dir), args.haystack)
        if args.needles < 1 or args.max_new_tokens < 1:
            raise NeedleError("--needles and --max-new-tokens must be at least 1")
        model, tokenizer = _load(args)
        rotations = _rotations_for(args.model, args.rotations, args.shared_rotations, args.methods)
        haystack = Haystack(tokenizer, read_haystack(files))
        seeds = list(range(args.seed, args.seed + args.needles))
        trials = run_niah(model, tokenizer, haystack, args.methods, args.lengths, args.depths, seeds, rotations,
                          args.max_new_tokens, chat=not args.no_chat, progress=not args.json)
    except NeedleError as error:
        raise SystemExit(f"oscar-hf eval niah: {error}") from None
    settings = {"model": args.model, "dtype": str(model.dtype), "haystack": f"{args.haystack} ({files[0].parent})",
                "haystack_tokens": len(haystack), "methods": args.methods, "lengths": args.lengths,
                "depths": args.depths, "seeds": seeds, "max_new_tokens": args.max_new_tokens,
                "chat": not args.no_chat and bool(getattr(tokenizer, "chat_template", None))}
    result = niah_result(trials, {**_environment(argv), "seconds": round(time.perf_counter() - started)}, settings)
    if args.out:
        for path in write_outputs(result, Path(args.out), niah_markdown(result), plot_niah):
            logger.info("wrote %s", path)
    print(json.dumps(result) if args.json else niah_markdown(result))


def cmd_eval_kl_curve(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.evaluation.data import WIKITEXT2_TEST
    from oscar_hf.evaluation.report import write_outputs
    from oscar_hf.evaluation.kl_curve import kl_curve_markdown, kl_curve_result, plot_kl_curve, position_stats
    from oscar_hf.core.models import model_context

    started = time.perf_counter()
    text_path = Path(args.text) if args.text else None
    if text_path is None:
        folder = _data_folder(args.data_dir)
        if folder is None:
            raise SystemExit("oscar-hf eval kl-curve: no --text and no data directory "
                             "(pass --text FILE, --data-dir or set $OSCAR_HF_DATA_DIR)")
        text_path = folder / WIKITEXT2_TEST
    if not text_path.is_file():
        raise SystemExit(f"oscar-hf eval kl-curve: {text_path} is not a file")
    if args.bucket < 1 or args.windows < 1:
        raise SystemExit("oscar-hf eval kl-curve: --bucket and --windows must be at least 1")
    model, tokenizer = _load(args)
    limit = model_context(model)
    if limit is not None and args.ctx > limit:
        raise SystemExit(f"oscar-hf eval kl-curve: --ctx {args.ctx} exceeds the model's context of {limit} tokens")
    rotations = _rotations_for(args.model, args.rotations, args.shared_rotations, args.methods)
    token_ids = tokenizer(text_path.read_text(encoding="utf-8"), return_tensors="pt",
                          add_special_tokens=False)["input_ids"][0]
    if token_ids.numel() < args.ctx:
        raise SystemExit(f"oscar-hf eval kl-curve: {text_path} has {token_ids.numel()} tokens, fewer than --ctx {args.ctx}")
    stats, starts, first = position_stats(model, token_ids, args.methods, rotations, args.ctx, args.windows,
                                          progress=not args.json)
    settings = {"model": args.model, "dtype": str(model.dtype), "text": str(text_path),
                "text_tokens": int(token_ids.numel()), "ctx": args.ctx, "windows": args.windows, "methods": args.methods}
    meta = {**_environment(argv), "seconds": round(time.perf_counter() - started)}
    result = kl_curve_result(stats, starts, first, args.bucket, meta, settings)
    if args.out:
        for path in write_outputs(result, Path(args.out), kl_curve_markdown(result), plot_kl_curve):
            logger.info("wrote %s", path)
    print(json.dumps(result) if args.json else kl_curve_markdown(result))


def cmd_calibrate(args: argparse.Namespace, argv: list[str]) -> None:
    from oscar_hf.cli.calibrate import format_summary, run_calibration

    if args.clip_search and (args.objective != "qqt_sst" or args.factors != "UHP"):
        raise SystemExit("the clip search chooses between U·H·P and H·P itself: add --no-clip-search to pick "
                         "--objective and --factors")
    if args.refine and not args.clip_search:
        raise SystemExit("--refine starts from the clip search's rotations and ratios; drop --no-clip-search")
    if args.allocate_bits and not args.clip_search:
        raise SystemExit("--allocate-bits ranks layers against the clip search's rotations and ratios; drop --no-clip-search")
    if args.allocate_bits < 0:
        raise SystemExit("--allocate-bits takes a number of layers (0: none)")
    model, tokenizer = _load(args)
    _, summary = run_calibration(args, model, tokenizer, argv)
    print(json.dumps({**_environment(argv), **summary}) if args.json else format_summary(summary))


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a hub id or a local dir")
    parser.add_argument("--rotations", help="rotation directory (default: the bundled ones for the default model)")
    parser.add_argument("--shared-rotations", action="store_true",
                        help="from a folder that also holds per-KV-head rotations, take the shared (one per layer) ones")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                        help="model dtype; auto = float32 on CPU, bfloat16 on GPU (windows are stored in it)")


def _add_report_options(parser: argparse.ArgumentParser, handler, example_stem: str) -> None:
    """``--json`` and ``--out STEM`` (JSON, markdown and PNG) of an evaluation that draws a plot."""
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help=f"write STEM.json, STEM.md and STEM.png (e.g. {example_stem})")
    parser.set_defaults(handler=handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-hf", description="OSCAR 2-bit KV-cache quantization for transformers")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="answer a question about a ~1,500-token document with an uncompressed "
                                            "and a 2-bit KV cache; compare answers, KV memory and speed")
    _add_model_options(demo)
    demo.add_argument("--methods", type=_methods, default=["oscar-int2"],
                      help="caches to compare with the uncompressed one (none, always run first)")
    demo.add_argument("--max-new-tokens", type=int, default=40)
    demo.add_argument("--json", action="store_true", help="print one machine-readable JSON object")
    demo.set_defaults(handler=cmd_demo)

    evaluate = commands.add_parser("eval", help="evaluations").add_subparsers(dest="evaluation", required=True)
    kl = evaluate.add_parser("kl", help="teacher-forced perplexity and KL from BF16 per method")
    _add_model_options(kl)
    kl.add_argument("--text", required=True, help="a UTF-8 text file, read in place")
    kl.add_argument("--ctx", type=int, default=2048)
    kl.add_argument("--windows", type=int, default=6)
    kl.add_argument("--methods", type=_methods, default=["none", "naive-int2", "quarot-int2", "oscar-int2"])
    kl.add_argument("--json", action="store_true")
    kl.add_argument("--out", help="also write the JSON result to this file")
    kl.set_defaults(handler=cmd_eval_kl)

    niah = evaluate.add_parser("niah", help="needle in a haystack: retrieve a 7-digit number at several depths and lengths")
    _add_model_options(niah)
    niah.add_argument("--methods", type=_methods, default=ONE_RECIPE_METHODS)
    niah.add_argument("--lengths", type=_arg(parse_lengths), default=[2048, 4096],
                      help="prompt lengths in tokens, e.g. 2K,4K,8176 (prompt + new tokens must fit the context)")
    niah.add_argument("--depths", type=_arg(parse_depths), default=[0.0, 25.0, 50.0, 75.0, 100.0],
                      help="needle depths in %% of the haystack")
    niah.add_argument("--needles", type=int, default=2, help="needles (seeds) per length and depth")
    niah.add_argument("--seed", type=int, default=0, help="first seed; needle i uses seed + i")
    niah.add_argument("--haystack", choices=["essays", "gutenberg"], default="essays",
                      help="Paul Graham essays (niah_paul_graham_essays/) or Gutenberg books (gutenberg_books/)")
    niah.add_argument("--data-dir", help="folder holding the haystack folders, read in place "
                                         "(default $OSCAR_HF_DATA_DIR, else ../shared/data)")
    niah.add_argument("--max-new-tokens", type=int, default=12)
    niah.add_argument("--no-chat", action="store_true", help="plain prompt instead of the chat template")
    _add_report_options(niah, cmd_eval_niah, "eval/results/niah_default")

    curve = evaluate.add_parser("kl-curve", help="teacher-forced KL from BF16 per method as a function of context length")
    _add_model_options(curve)
    curve.add_argument("--text", help="a UTF-8 text file, read in place (default: WikiText-2 test in the data dir)")
    curve.add_argument("--data-dir", help="default $OSCAR_HF_DATA_DIR, else ../shared/data")
    curve.add_argument("--ctx", type=int, default=8192, help="window length: the curve runs up to it")
    curve.add_argument("--windows", type=int, default=2)
    curve.add_argument("--bucket", type=int, default=256, help="positions averaged per point")
    curve.add_argument("--methods", type=_methods, default=ONE_RECIPE_METHODS)
    _add_report_options(curve, cmd_eval_kl_curve, "eval/results/kl_curve_default")

    tasks = evaluate.add_parser("tasks", help="accuracy on reasoning/code tasks through lm-eval (the paper's Table 2)")
    _add_model_options(tasks)
    tasks.add_argument("--methods", type=_methods, default=ONE_RECIPE_METHODS)
    tasks.add_argument("--tasks", type=_tasks, default=["aime25", "gpqa_diamond", "math500", "gsm8k", "humaneval"],
                       help="short task names: the YAMLs in oscar_hf/tasks (and --task-dir)")
    tasks.add_argument("--limit", type=int, help="first N examples of each task")
    tasks.add_argument("--seeds", type=int, default=1, help="runs per (method, task); seeds only matter with sampling")
    tasks.add_argument("--out", required=True, help="output folder: runs/*.json, table.md, summary.json, accuracy.png")
    tasks.add_argument("--data-dir", help="local data (read in place; default $OSCAR_HF_DATA_DIR; "
                                          "neither: lm-eval's public datasets, downloaded)")
    tasks.add_argument("--max-gen-toks", type=int, help="cap on generated tokens per answer (tasks ask up to 32,768)")
    tasks.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples with top_p 0.95, top_k 40 (the paper: 1.0)")
    tasks.add_argument("--sink", type=int, default=64)
    tasks.add_argument("--recent", type=int, default=256)
    tasks.add_argument("--batch-size", type=int, default=1)
    tasks.add_argument("--think-end-token", help="e.g. </think>: stop strings only apply after it")
    tasks.add_argument("--task-dir", action="append", default=[], help="a folder of extra task YAMLs")
    tasks.add_argument("--json", action="store_true")
    tasks.set_defaults(handler=cmd_eval_tasks)

    calibrate = commands.add_parser("calibrate", help="fit OSCAR rotations (and clip ratios) to a model")
    calibrate.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a hub id or a local dir")
    calibrate.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    calibrate.add_argument("--data", nargs="+", required=True,
                           help="text files (documents) and/or .jsonl files (one prompt or chat per line), read in place")
    calibrate.add_argument("--tokens", type=int, default=20000, help="calibration token budget")
    calibrate.add_argument("--out", required=True, help="directory to write the rotations to")
    calibrate.add_argument("--clip-search", action=argparse.BooleanOptionalAction, default=True,
                           help="choose each layer's clip ratios and rotation variant (U·H·P or H·P) by attention-output "
                                "error, the recipe oscar-int2 is best with (default); --no-clip-search: plain "
                                "--factors rotations and the fixed clips, the paper's recipe (oscar-int2-paper)")
    calibrate.add_argument("--refine", action="store_true",
                           help="after the clip search, fit each R_K/R_V on the orthogonal group to the quantized "
                                "attention-output error and search its clip ratio again (slower)")
    calibrate.add_argument("--allocate-bits", type=int, default=0, metavar="N",
                           help="after --clip-search, store 4-bit keys in the N layers where they cut the calibration "
                                "KL most and 1-bit values in the 2N where they cost least (oscar-int2's history bits)")
    calibrate.add_argument("--chat", action="store_true", help="render .jsonl prompts with the chat template")
    calibrate.add_argument("--seq-len", type=int, default=2048)
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--objective", choices=["qqt_sst", "ktk_vtv"], default="qqt_sst")
    calibrate.add_argument("--factors", choices=["UHP", "UH", "UP", "HP", "H", "U", ""], default="UHP")
    calibrate.add_argument("--per-head", action="store_true",
                           help="one rotation per KV head, from that head's own C_Q and C_S (default: one per layer)")
    calibrate.add_argument("--json", action="store_true")
    calibrate.set_defaults(handler=cmd_calibrate)

    tasks_out = commands.add_parser(
        "lm-eval-tasks", help="write the offline lm-eval tasks (oscar_gsm8k, ...) for local data, "
                              "for lm_eval --model oscar ... --include_path OUT")
    tasks_out.add_argument("--data-dir", help="local data, read in place (default $OSCAR_HF_DATA_DIR, else ../shared/data)")
    tasks_out.add_argument("--out", required=True, help="folder for the task YAMLs")
    tasks_out.add_argument("--task-dir", action="append", default=[], help="a folder of extra task YAMLs")
    tasks_out.set_defaults(handler=cmd_lm_eval_tasks)

    memory = commands.add_parser("memory", help="prefill a long text and print each method's memory report")
    _add_model_options(memory)
    memory.add_argument("--tokens", type=int, default=4096)
    memory.add_argument("--text", help="text to prefill (default: the demo document, repeated)")
    memory.add_argument("--methods", type=_methods, default=["none", "int4", "oscar-k4v2", "oscar-int2"])
    memory.add_argument("--per-layer", action="store_true", help="print the per-layer table")
    memory.add_argument("--json", action="store_true")
    memory.set_defaults(handler=cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    args.handler(args, argv)


if __name__ == "__main__":
    main()
