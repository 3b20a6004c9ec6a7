"""Compare cache recipes by memory, held-out KL and perplexity and needle retrieval, driven by a JSON config.

    python -m eval.ablate --config eval/configs/quality.json [--device cuda --dtype bfloat16] [--out STEM]

A config holds (every section but ``model`` and ``variants`` is optional):

* ``context`` (one window length or a list, e.g. ``[2048, 8192]``) and ``windows`` (windows per
  text, one number or one per context) of the teacher-forced KL/perplexity evaluation, run on each
  of ``eval_texts`` (``{name: {"file": path under the data dir, "chars": [start, end]}}``): text no
  rotation was calibrated on;
* ``calibrations``: ``{name: {"files", "tokens", "chars"?, "chat"?, "seq_len"?, "seed"?}}``, each
  run once (covariances) for every variant that names it;
* ``needles``: ``{"lengths", "depths", "needles", "seed"?, "haystack"?, "max_new_tokens"?, "chat"?,
  "batch_size"?}``: needle-in-a-haystack trials scored teacher-forced under the real
  prefill-then-decode schedule (:mod:`oscar_hf.evaluation.niah_forced`): exact match of the greedy answer and
  the log-probability of the number, one forward pass per trial in the common case;
* ``variants`` (recipes): ``{"label", "method"}`` plus where the rotations come from, one of
  ``"rotations"`` (``"default"``: the set bundled for the model, or a directory) or
  ``"calibration"`` (a name above) made by the library's recipe (:func:`oscar_hf.calibration.recipe.fit`):
  ``"calibrate"`` (:class:`~oscar_hf.calibration.recipe.Recipe` fields, e.g. ``{"objective": "ktk_vtv",
  "factors": "HP"}``), ``"clip_search"`` and ``"refine"`` (true or false; the search measures the
  variant's own method); ``"allocate_bits"`` (with ``"rotations"`` a directory whose ``config.json``
  records a bit allocation): the set's recorded scores spent on that many layers' worth of 4-bit keys
  (:meth:`~oscar_hf.calibration.bit_allocation.BitAllocation.respend`); and ``"overrides"``: OscarConfig
  fields, nested ones as dicts (``{"recent": 128, "key": {"group_size": 32, "clip_ratio": 0.0}}``, dtypes by name).

Every recipe gets its bits per element at each evaluated length and at 128K tokens for head_dim 128.
Results go to ``--out`` (default ``eval/results/<config name>``) ``.json``, ``.md`` and ``.png``,
with the command, machine and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eval.ablate_report import plot, to_markdown
from oscar_hf import OscarCache, RotationSet
from oscar_hf.calibration.bit_allocation import BitAllocation
from oscar_hf.calibration.covariances import collect_covariances
from oscar_hf.calibration.data import CalibrationTexts, calibration_batches, read_calibration_files
from oscar_hf.calibration.recipe import Recipe, feedback_batches, finish, fit
from oscar_hf.config import METHODS, OscarConfig, resolve_method
from oscar_hf.core.memory import bits_per_element
from oscar_hf.core.models import DTYPES, load_model, model_context
from oscar_hf.evaluation.haystack import Haystack, build_prompt, haystack_files, read_haystack
from oscar_hf.evaluation.kl import evaluate_caches
from oscar_hf.evaluation.niah import check_lengths
from oscar_hf.evaluation.niah_forced import needle_summary, score_prompts
from oscar_hf.evaluation.report import write_outputs
from oscar_hf.log import get_logger
from oscar_hf.model_info import head_dim_of
from oscar_hf.provenance import command_line, portable_path, provenance
from oscar_hf.rotations.files import load_rotation_config
from oscar_hf.rotations.resolve import resolve_rotations

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "eval" / "results"
LONG_CONTEXT, LONG_HEAD_DIM = 131072, 128  # the paper's BPE point
logger = get_logger("oscar_hf.ablate")


# ----------------------------------------------------------------------------------------- inputs


def read_text(data_dir: Path, spec: dict) -> str:
    text = (data_dir / spec["file"]).read_text(encoding="utf-8")
    start, end = spec.get("chars", [0, None])
    return text[start:end]


def calibration_inputs(tokenizer, data_dir: Path, spec: dict) -> tuple[CalibrationTexts, list[torch.Tensor]]:
    """A calibration's texts and its rows."""
    files = [data_dir / f for f in spec["files"]]
    if "chars" in spec:
        start, end = spec["chars"]
        texts = CalibrationTexts(documents=[f.read_text(encoding="utf-8")[start:end] for f in files])
    else:
        texts = read_calibration_files(files, tokenizer, chat=spec.get("chat", False))
    batches = calibration_batches(tokenizer, texts, spec["tokens"], spec.get("seq_len", 2048), spec.get("seed", 0))
    return texts, batches


def per_context(config: dict) -> list[tuple[int, int]]:
    """``[(context, windows)]`` of the KL/perplexity evaluation."""
    contexts = config["context"] if isinstance(config["context"], list) else [config["context"]]
    windows = config["windows"] if isinstance(config["windows"], list) else [config["windows"]] * len(contexts)
    if len(windows) != len(contexts):
        raise ValueError(f"windows {config['windows']} must be one number or one per context {contexts}")
    return list(zip(contexts, windows))


# ---------------------------------------------------------------------------------------- recipes


VARIANT_KEYS = {
    "label",
    "method",
    "rotations",
    "allocate_bits",
    "calibration",
    "calibrate",
    "clip_search",
    "refine",
    "overrides",
}
NEEDLE_KEYS = {"lengths", "depths", "needles", "seed", "haystack", "max_new_tokens", "chat", "batch_size"}


def recipe_config(variant: dict) -> OscarConfig:
    """The variant's method with its ``overrides`` applied (nested dataclass fields as dicts, dtypes by name)."""
    unknown = sorted(set(variant) - VARIANT_KEYS)
    if unknown:
        raise ValueError(
            f"variant {variant.get('label')!r}: unknown key(s) {unknown}; a variant takes "
            f"{sorted(VARIANT_KEYS)} (calibration options go in calibrate, cache fields in overrides)"
        )
    method = variant["method"]
    if method not in METHODS:
        raise ValueError(f"variant {variant['label']!r}: unknown method {method!r}; choose from {sorted(METHODS)}")
    base = METHODS[method]
    overrides = {}
    for name, value in variant.get("overrides", {}).items():
        current = getattr(base, name, None)
        if isinstance(value, dict):
            if not dataclasses.is_dataclass(current):
                raise ValueError(f"variant {variant['label']!r}: override {name!r} of {method} takes no fields")
            value = dataclasses.replace(current, **value)
        elif isinstance(current, torch.dtype) and isinstance(value, str):
            value = getattr(torch, value)
        overrides[name] = value
    return resolve_method(base, **overrides)


class Calibrations:
    """Covariances, clip-search batches and the key feedback's rows (a function of the recipe) of each named
    calibration, collected on first use."""

    def __init__(self, model, tokenizer, data_dir: Path, specs: dict) -> None:
        self.model, self.tokenizer, self.data_dir, self.specs = model, tokenizer, data_dir, specs
        self.done: dict[str, tuple] = {}

    def __getitem__(self, name: str) -> tuple[dict, list[torch.Tensor], Callable[[Recipe], list[torch.Tensor]]]:
        if name not in self.specs:
            raise ValueError(f"unknown calibration {name!r}; the config defines {sorted(self.specs)}")
        if name not in self.done:
            logger.info("calibration %s", name)
            texts, batches = calibration_inputs(self.tokenizer, self.data_dir, self.specs[name])

            def feedback_rows(recipe: Recipe) -> list[torch.Tensor]:
                return feedback_batches(self.model, self.tokenizer, texts, recipe)

            self.done[name] = (collect_covariances(self.model, batches), batches, feedback_rows)
        return self.done[name]


def variant_cache(model, variant: dict, calibrations: Calibrations) -> OscarCache:
    """A cache of the variant's recipe (see the module docstring); it only supplies configuration and rotations."""
    config, label = recipe_config(variant), variant["label"]
    sources = [key for key in ("rotations", "calibration") if key in variant]
    if len(sources) > 1:
        raise ValueError(f"variant {label!r}: give either rotations or calibration, not both")
    if "calibration" not in variant and ("calibrate" in variant or "clip_search" in variant):
        raise ValueError(f"variant {label!r}: calibrate and clip_search need a calibration")
    if "allocate_bits" in variant and "rotations" not in variant:
        raise ValueError(
            f"variant {label!r}: allocate_bits re-spends the recorded scores of a saved set: give rotations"
        )
    rotations = None
    if "rotations" in variant:
        rotations = resolve_rotations(model, variant["rotations"], method=config)
        if "allocate_bits" in variant:
            rotations = respent(rotations, Path(variant["rotations"]), variant["allocate_bits"], label)
    elif "calibration" in variant:
        covariances, batches, feedback_rows = calibrations[variant["calibration"]]
        searched = {"search_for": variant["method"]} if variant.get("clip_search") else {}
        try:  # the library's recipe, validated as oscar_hf.calibrate validates it
            recipe = Recipe(
                clip_search=bool(variant.get("clip_search")),
                refine=bool(variant.get("refine")),
                **{**searched, **variant.get("calibrate", {})},
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"variant {label!r}: {error}") from None
        if recipe.from_rotations:
            raise ValueError(f"variant {label!r}: give a saved set as rotations, not calibrate.from_rotations")
        rotations, _ = fit(recipe, model, batches, covariances, progress=False, config=config)
        rows = feedback_rows(recipe) if recipe.key_feedback else None
        rotations, _, _ = finish(recipe, model, batches, rotations, rows, progress=False, config=config)
    return OscarCache(model, config, rotations=rotations)


def respent(rotations: RotationSet, directory: Path, layers: int, label: str) -> RotationSet:
    """``rotations`` with the widths the bit allocation recorded in ``directory`` gives for ``layers``."""
    record = load_rotation_config(directory).get("bit_allocation") if directory.is_dir() else None
    if record is None:
        raise ValueError(f"variant {label!r}: allocate_bits needs a rotation directory that records a bit allocation")
    return BitAllocation.from_dict(record).respend(layers).widths_of(rotations)


def memory_table(caches: dict[str, OscarCache], lengths: list[int], head_dim: int) -> dict[str, dict[str, float]]:
    """Bits per element of every recipe at each length (this model's head_dim) and at 128K for head_dim 128."""
    long_key = f"{LONG_CONTEXT}@hd{LONG_HEAD_DIM}"
    return {
        label: {
            **{str(n): round(bits_per_element(cache.oscar_config, n, head_dim), 4) for n in lengths},
            long_key: round(bits_per_element(cache.oscar_config, LONG_CONTEXT, LONG_HEAD_DIM), 4),
        }
        for label, cache in caches.items()
    }


# ------------------------------------------------------------------------------------ evaluations


def kl_scores(model, tokenizer, data_dir: Path, config: dict, caches: dict[str, OscarCache]) -> dict:
    """``{text: {context: {label: MethodScore dict}}}``."""
    scores = {}
    for name, spec in config.get("eval_texts", {}).items():
        ids = tokenizer(read_text(data_dir, spec), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        scores[name] = {}
        for context, windows in per_context(config):
            logger.info("KL and perplexity on %s, %d windows of %d tokens", name, windows, context)
            results = evaluate_caches(model, ids, caches, context, windows)
            scores[name][str(context)] = {s.method: s.to_dict() for s in results}
    return scores


def needle_settings(spec: dict) -> dict:
    if not isinstance(spec, dict):
        raise ValueError(f"needles must be an object of settings, got {spec!r} (leave the key out for no needles)")
    unknown, missing = sorted(set(spec) - NEEDLE_KEYS), sorted({"lengths", "depths", "needles"} - set(spec))
    if unknown or missing:
        raise ValueError(f"needles: unknown key(s) {unknown}, missing {missing}; it takes {sorted(NEEDLE_KEYS)}")
    settings = {"haystack": "essays", "seed": 0, "max_new_tokens": 12, "chat": True, "batch_size": 1, **spec}
    return settings


def needle_scores(model, tokenizer, data_dir: Path, settings: dict, caches: dict[str, OscarCache]) -> dict:
    """Trials, per-recipe summaries and seconds of the teacher-forced needle test."""
    check_lengths(settings["lengths"], model_context(model), settings["max_new_tokens"])
    haystack = Haystack(tokenizer, read_haystack(haystack_files(data_dir, settings["haystack"])))
    seeds = range(settings["seed"], settings["seed"] + settings["needles"])
    prompts = [
        build_prompt(tokenizer, haystack, n, d, s, settings["chat"])
        for n in settings["lengths"]
        for s in seeds
        for d in settings["depths"]
    ]
    trials, seconds = score_prompts(
        model, tokenizer, prompts, caches, settings["max_new_tokens"], settings["batch_size"]
    )
    return {"summary": needle_summary(trials), "seconds": seconds, "trials": [t.to_dict() for t in trials]}


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("OSCAR_HF_DATA_DIR"),
        help="the evaluation data (default: $OSCAR_HF_DATA_DIR)",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="auto",
        help="model dtype (auto: bfloat16 on CUDA, float32 elsewhere)",
    )
    parser.add_argument("--model", help="override the config's model (a name or directory)")
    parser.add_argument("--batch-size", type=int, help="override needles.batch_size (rows per teacher-forced pass)")
    parser.add_argument("--no-needles", action="store_true", help="skip the config's needles (KL and perplexity only)")
    parser.add_argument("--out", type=Path, help="output stem (default eval/results/<config name>)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and every needle answer")
    args = parser.parse_args(argv)
    if args.data_dir is None:
        parser.error("no evaluation data: pass --data-dir or set $OSCAR_HF_DATA_DIR")
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = json.loads(args.config.read_text())
    started = time.perf_counter()
    model, tokenizer = load_model(args.model or config["model"], dtype=DTYPES[args.dtype], device=args.device)
    calibrations = Calibrations(model, tokenizer, args.data_dir, config.get("calibrations", {}))
    caches = {v["label"]: variant_cache(model, v, calibrations) for v in config["variants"]}
    needles = needle_settings(config["needles"]) if "needles" in config and not args.no_needles else None
    if needles and args.batch_size:
        needles["batch_size"] = args.batch_size
    kl_windows = per_context(config) if config.get("eval_texts") else []
    lengths = sorted({c for c, _ in kl_windows} | set(needles["lengths"] if needles else []))
    head_dim = head_dim_of(model)
    result = {
        "config": portable_path(args.config),
        "description": config["description"],
        "model": args.model or config["model"],
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        **provenance(command_line(argv=argv)),
        "kl_windows": kl_windows,
        "eval_texts": config.get("eval_texts", {}),
        "needle_settings": needles,
        "calibrations": config.get("calibrations", {}),
        "recipes": config["variants"],
        "variants": list(caches),
        "bits_per_element": memory_table(caches, lengths, head_dim),
    }
    result["scores"] = kl_scores(model, tokenizer, args.data_dir, config, caches)
    result["needles"] = needle_scores(model, tokenizer, args.data_dir, needles, caches) if needles else None
    result["seconds"] = round(time.perf_counter() - started)
    stem = args.out or RESULTS / args.config.stem
    for path in write_outputs(result, stem, to_markdown(result), plot):
        logger.info("wrote %s", path)
    print(to_markdown(result))
    return result


if __name__ == "__main__":
    main()
