"""Compare cache variants by teacher-forced KL and perplexity, driven by a JSON config.

    python eval/ablate.py --config eval/configs/rotation_ablation.json [--data-dir DIR]

A config names calibration data sets, held-out evaluation texts and variants (a method plus
optional calibration, objective, factors, clip search, group size, clip ratios or rotation kind;
``"rotations": "bundled"`` uses the rotations shipped for the default model instead of a calibration).
Each calibration runs once and serves every variant that uses it. Results go to
``eval/results/<config name>.{json,md,png}`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # measure this checkout even when another oscar-hf is installed

from oscar_hf import OscarCache  # noqa: E402
from oscar_hf.calibration import collect_covariances, rotations_from_covariances  # noqa: E402
from oscar_hf.calibration_data import CalibrationTexts, calibration_batches, read_calibration_files  # noqa: E402
from oscar_hf.clip_search import search_layers  # noqa: E402
from oscar_hf.config import METHODS  # noqa: E402
from oscar_hf.evaluation import evaluate_caches  # noqa: E402
from oscar_hf.models import load_model  # noqa: E402
from oscar_hf.zoo import DEFAULT_ROTATIONS, bundled_rotations_dir, from_pretrained  # noqa: E402

RESULTS = REPO / "eval" / "results"


def read_text(data_dir: Path, spec: dict) -> str:
    text = (data_dir / spec["file"]).read_text(encoding="utf-8")
    start, end = spec.get("chars", [0, None])
    return text[start:end]


def calibration_inputs(tokenizer, data_dir: Path, spec: dict) -> list[torch.Tensor]:
    files = [data_dir / f for f in spec["files"]]
    if "chars" in spec:
        start, end = spec["chars"]
        texts = CalibrationTexts(documents=[f.read_text(encoding="utf-8")[start:end] for f in files])
    else:
        texts = read_calibration_files(files, tokenizer, chat=spec.get("chat", False))
    return calibration_batches(tokenizer, texts, spec["tokens"], spec.get("seq_len", 2048), spec.get("seed", 0))


def variant_cache(model, variant: dict, calibrated: dict) -> OscarCache:
    config = METHODS[variant["method"]]
    if "group_size" in variant:
        config = replace(config, key=replace(config.key, group_size=variant["group_size"]),
                         value=replace(config.value, group_size=variant["group_size"]))
    if "key_clip" in variant:
        config = replace(config, key=replace(config.key, clip_ratio=variant["key_clip"]),
                         value=replace(config.value, clip_ratio=variant["value_clip"]))
    if "rotation" in variant:
        config = replace(config, rotation=variant["rotation"])
    rotations = None
    if variant.get("rotations") == "bundled":
        rotations = from_pretrained(bundled_rotations_dir(DEFAULT_ROTATIONS))
    elif "calibration" in variant:
        covariances, batches = calibrated[variant["calibration"]]
        if variant.get("clip_search"):
            rotations, _ = search_layers(model, sorted(batches, key=lambda b: -b.shape[1])[:2], covariances)
        else:
            rotations = rotations_from_covariances(covariances, variant.get("objective", "qqt_sst"),
                                                   variant.get("factors", "UHP"))
    return OscarCache(model, config, rotations=rotations)


def to_markdown(result: dict) -> str:
    texts = list(result["eval_texts"])
    head = "| variant | BPE | " + " | ".join(f"{t} KL | {t} PPL" for t in texts) + " |"
    rows = [head, "|---|---|" + "---|---|" * len(texts)]
    for label in result["variants"]:
        scores = [result["scores"][t][label] for t in texts]
        cells = " | ".join(f"{s['kl_from_none']:.4f} | {s['perplexity']:.3f}" for s in scores)
        rows.append(f"| {label} | {scores[0]['bits_per_element']:.2f} | {cells} |")
    meta = f"\n\n`{result['command']}` on {result['machine']}, {result['date']}; {result['context']}-token windows x {result['windows']} per text, KL in nats from BF16 over positions after sink + recent."
    return result["description"] + "\n\n" + "\n".join(rows) + meta + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [v for v in result["variants"] if result["scores"][next(iter(result["eval_texts"]))][v]["kl_from_none"] > 0]
    texts = list(result["eval_texts"])
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.5))
    height = 0.8 / len(texts)
    for i, text in enumerate(texts):
        values = [result["scores"][text][label]["kl_from_none"] for label in labels]
        ax.barh([y + i * height for y in range(len(labels))], values, height=height, label=text)
    ax.set_yticks([y + height * (len(texts) - 1) / 2 for y in range(len(labels))], labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("KL divergence from BF16 (nats, log scale; lower is better)")
    ax.set_title(f"{Path(result['config']).stem}: {result['model']} at {result['context']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path,
                        default=Path(os.environ.get("OSCAR_HF_DATA_DIR", REPO.parent / "shared" / "data")))
    args = parser.parse_args()
    config = json.loads(args.config.read_text())
    started = time.perf_counter()
    model, tokenizer = load_model(config["model"])
    calibrated = {}
    for name, spec in config["calibrations"].items():
        batches = calibration_inputs(tokenizer, args.data_dir, spec)
        calibrated[name] = (collect_covariances(model, batches), batches)
    caches = {v["label"]: variant_cache(model, v, calibrated) for v in config["variants"]}
    scores = {}
    for name, spec in config["eval_texts"].items():
        ids = tokenizer(read_text(args.data_dir, spec), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        results = evaluate_caches(model, ids, caches, config["context"], config["windows"])
        scores[name] = {s.method: s.to_dict() for s in results}
    result = {
        "config": str(args.config), "description": config["description"], "model": config["model"],
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, "
                   f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'})",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.perf_counter() - started),
        "context": config["context"], "windows": config["windows"], "eval_texts": config["eval_texts"],
        "variants": [v["label"] for v in config["variants"]], "scores": scores,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / args.config.stem
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    stem.with_suffix(".md").write_text(to_markdown(result))
    plot(result, stem.with_suffix(".png"))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
