"""The ``oscar-hf`` command line: ``demo`` and ``eval kl``."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch

from .config import METHODS
from .log import get_logger
from .rotations import RotationSet

logger = get_logger(__name__)


def _rotations_for(model_name: str, rotations_dir: str | None) -> RotationSet | None:
    """Rotations from ``--rotations``, else the ones bundled for the default model, else none."""
    from .models import DEFAULT_MODEL
    from .zoo import DEFAULT_ROTATIONS, bundled_rotations_dir, from_pretrained

    if rotations_dir:
        return from_pretrained(rotations_dir)
    if model_name == DEFAULT_MODEL:
        return from_pretrained(bundled_rotations_dir(DEFAULT_ROTATIONS))
    return None


def _methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    return methods


def _environment(argv: list[str]) -> dict:
    return {
        "command": "oscar-hf " + " ".join(argv),
        "machine": f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} threads)",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
    }


_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load(args: argparse.Namespace):
    from .models import load_model

    return load_model(args.model, dtype=_DTYPES[args.dtype])


def cmd_demo(args: argparse.Namespace, argv: list[str]) -> None:
    from .demo import demo_prompt, format_run, run_method

    model, tokenizer = _load(args)
    rotations = _rotations_for(args.model, args.rotations)
    prompt = demo_prompt(tokenizer)
    if not args.json:
        print(f"Prompt: {prompt.shape[1]} tokens, model in {model.dtype}; question: the lighthouse keeper's dog "
              "(the answer, Biscuit, is in the middle of the document, i.e. in the 2-bit history)\n")
    runs = []
    for method in args.methods:
        run = run_method(model, tokenizer, prompt, method, rotations, args.max_new_tokens)
        runs.append(run)
        if not args.json:
            print(format_run(run) + "\n")
    if args.json:
        print(json.dumps({**_environment(argv), "prompt_tokens": prompt.shape[1], "runs": [vars(r) for r in runs]}))


def cmd_eval_kl(args: argparse.Namespace, argv: list[str]) -> None:
    from .evaluation import evaluate_methods, scores_to_markdown

    model, tokenizer = _load(args)
    rotations = _rotations_for(args.model, args.rotations)
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
    from .demo import filled_context, prefill_report

    model, tokenizer = _load(args)
    rotations = _rotations_for(args.model, args.rotations)
    ids = filled_context(tokenizer, args.tokens, Path(args.text) if args.text else None)
    reports = [prefill_report(model, ids, method, rotations) for method in args.methods]
    if args.json:
        print(json.dumps({**_environment(argv), "model": args.model, "dtype": str(model.dtype),
                          "reports": [r.to_dict() if args.per_layer else r.summary() for r in reports]}))
        return
    for report in reports:
        print(f"## {report.method}\n\n{report.to_markdown() if args.per_layer else report}\n")


def cmd_calibrate(args: argparse.Namespace, argv: list[str]) -> None:
    from .calibrate_command import format_summary, run_calibration

    if args.clip_search and (args.objective != "qqt_sst" or args.factors != "UHP"):
        raise SystemExit("--clip-search chooses between U·H·P and H·P itself; leave --objective and --factors alone")
    model, tokenizer = _load(args)
    _, summary = run_calibration(args, model, tokenizer, argv)
    print(json.dumps({**_environment(argv), **summary}) if args.json else format_summary(summary))


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a hub id or a local dir")
    parser.add_argument("--rotations", help="rotation directory (default: the bundled ones for the default model)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="auto",
                        help="model dtype; auto = float32 on CPU, bfloat16 on GPU (windows are stored in it)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-hf", description="OSCAR 2-bit KV-cache quantization for transformers")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="answer a question about a ~1,500-token document with BF16 and OSCAR INT2")
    _add_model_options(demo)
    demo.add_argument("--methods", type=_methods, default=["none", "oscar-int2"])
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

    calibrate = commands.add_parser("calibrate", help="fit OSCAR rotations (and clip ratios) to a model")
    calibrate.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a hub id or a local dir")
    calibrate.add_argument("--dtype", choices=sorted(_DTYPES), default="auto")
    calibrate.add_argument("--data", nargs="+", required=True,
                           help="text files (documents) and/or .jsonl files (one prompt or chat per line), read in place")
    calibrate.add_argument("--tokens", type=int, default=20000, help="calibration token budget")
    calibrate.add_argument("--out", required=True, help="directory to write the rotations to")
    calibrate.add_argument("--clip-search", action="store_true",
                           help="choose each layer's clip ratios and rotation variant by attention-output error")
    calibrate.add_argument("--chat", action="store_true", help="render .jsonl prompts with the chat template")
    calibrate.add_argument("--seq-len", type=int, default=2048)
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--objective", choices=["qqt_sst", "ktk_vtv"], default="qqt_sst")
    calibrate.add_argument("--factors", choices=["UHP", "UH", "UP", "HP", "H", "U", ""], default="UHP")
    calibrate.add_argument("--json", action="store_true")
    calibrate.set_defaults(handler=cmd_calibrate)

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
