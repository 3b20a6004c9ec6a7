"""Calibration data: plain text files, JSONL prompts or chat conversations, cut into token rows.

Documents (``.txt`` and other text files) are joined with EOS and cut into ``seq_len`` windows,
as long text is what a long-context cache sees. Prompts (``.jsonl``: one JSON object per line)
each become their own row, like the reference's calibration, which prefills GPQA prompts one by
one through the model's chat template. Rows are drawn with a seeded shuffle until the token budget
is reached, so a calibration is deterministic.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from oscar_hf.log import get_logger

logger = get_logger(__name__)

PROMPT_FIELDS = ("text", "prompt", "question", "problem", "Question", "input", "content")


@dataclass
class CalibrationTexts:
    """Long documents and separate prompts read from calibration files."""

    documents: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)


def read_calibration_files(
    paths: Sequence[str | Path], tokenizer: PreTrainedTokenizerBase | None = None, chat: bool = False
) -> CalibrationTexts:
    """Read files in place: ``.jsonl`` records become prompts, anything else one document.

    A record with ``messages`` (a chat conversation) is rendered with the tokenizer's chat template;
    with ``chat=True`` so is a record's prompt field (the first of :data:`PROMPT_FIELDS` present),
    as a single user turn.
    """
    texts = CalibrationTexts()
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"calibration file not found: {path}")
        if path.suffix == ".jsonl":
            texts.prompts += [_prompt(record, path, tokenizer, chat) for record in _records(path)]
        else:
            texts.documents.append(_strip_gutenberg(path.read_text(encoding="utf-8")))
    return texts


def _records(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not valid JSON: {error}") from error
    return records


def _prompt(record: dict, path: Path, tokenizer: PreTrainedTokenizerBase | None, chat: bool) -> str:
    messages = record.get("messages")
    if messages is None:
        text = next((record[name] for name in PROMPT_FIELDS if isinstance(record.get(name), str)), None)
        if text is None:
            raise ValueError(f"{path}: a record has none of the fields {PROMPT_FIELDS} or 'messages'")
        if not chat:
            return text
        messages = [{"role": "user", "content": text}]
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{path}: chat-formatted calibration needs a tokenizer with a chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg's licence header and footer when present; other text is unchanged."""
    text = text.replace("\r\n", "\n")
    start = text.find("*** START OF")
    if start != -1:
        text = text[text.find("\n", start) + 1 :]
    end = text.find("*** END OF")
    return (text[:end] if end != -1 else text).strip()


def calibration_batches(
    tokenizer: PreTrainedTokenizerBase,
    texts: CalibrationTexts,
    budget: int = 20000,
    seq_len: int = 2048,
    seed: int = 0,
) -> list[torch.LongTensor]:
    """``[1, <=seq_len]`` rows of exactly ``budget`` tokens (fewer if the data is shorter), in a seeded order."""
    if budget <= 0 or seq_len <= 0:
        raise ValueError(f"budget and seq_len must be positive, got {budget} and {seq_len}")
    rows = _document_windows(tokenizer, texts.documents, seq_len) + [
        ids[:seq_len] for ids in (_encode(tokenizer, p) for p in texts.prompts) if ids
    ]
    if not rows:
        raise ValueError("the calibration texts are empty")
    random.Random(seed).shuffle(rows)
    batches, remaining = [], budget
    for row in rows:
        taken = row[:remaining]
        batches.append(torch.tensor(taken, dtype=torch.long)[None])
        remaining -= len(taken)
        if remaining == 0:
            break
    if remaining:
        logger.warning("the calibration texts hold only %d of the %d requested tokens", budget - remaining, budget)
    return batches


def token_batches(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], budget: int = 20000, seq_len: int = 2048, seed: int = 0
) -> list[torch.LongTensor]:
    """:func:`calibration_batches` for plain documents."""
    return calibration_batches(tokenizer, CalibrationTexts(documents=list(texts)), budget, seq_len, seed)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # No BOS/EOS added: a chat-templated prompt already carries its special tokens as text.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _document_windows(tokenizer: PreTrainedTokenizerBase, documents: Sequence[str], seq_len: int) -> list[list[int]]:
    """Documents joined with EOS and cut into consecutive ``seq_len`` windows (the last may be shorter)."""
    separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    stream: list[int] = []
    for document in documents:
        if stream:
            stream += separator
        stream += _encode(tokenizer, document)
    return [stream[start : start + seq_len] for start in range(0, len(stream), seq_len)]
