"""The haystack and the prompt of the needle test: a needle sentence ``The special magic number for
<city> is: <7-digit number>.`` inserted at a chosen depth of real text (the Paul Graham essays of the
original needle test, or Project Gutenberg books, read in place from the data directory), and the
question with RULER's answer prefix, all assembled as token ids so that every prompt has exactly the
asked number of tokens; and how an answer is scored (an exact match of the number).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

ESSAYS_DIR = "niah_paul_graham_essays"
GUTENBERG_DIR = "gutenberg_books"
HAYSTACKS = {"essays": ESSAYS_DIR, "gutenberg": GUTENBERG_DIR}

INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards."
)
NEEDLE = "The special magic number for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"

CITIES = (
    "Amsterdam",
    "Athens",
    "Bangkok",
    "Barcelona",
    "Beijing",
    "Berlin",
    "Bogota",
    "Boston",
    "Brussels",
    "Budapest",
    "Buenos Aires",
    "Cairo",
    "Cape Town",
    "Chicago",
    "Copenhagen",
    "Dakar",
    "Dublin",
    "Edinburgh",
    "Helsinki",
    "Istanbul",
    "Jakarta",
    "Kyoto",
    "Lagos",
    "Lima",
    "Lisbon",
    "London",
    "Madrid",
    "Manila",
    "Melbourne",
    "Mexico City",
    "Montreal",
    "Moscow",
    "Mumbai",
    "Nairobi",
    "Oslo",
    "Paris",
    "Prague",
    "Reykjavik",
    "Rome",
    "Santiago",
    "Seoul",
    "Singapore",
    "Stockholm",
    "Sydney",
    "Tokyo",
    "Toronto",
    "Vancouver",
    "Vienna",
    "Warsaw",
    "Zurich",
)
_PLACEHOLDER = "\x00HAYSTACK\x00"
_SENTENCE_END = re.compile(r"[.!?]['\")\]]*\s*$")
_SNAP_WINDOW = 200  # tokens searched backwards for a sentence boundary


class NeedleError(ValueError):
    """A needle test that cannot be built as asked (missing data, prompt longer than the context...)."""


@dataclass(frozen=True)
class Needle:
    key: str
    value: str

    @classmethod
    def from_seed(cls, seed: int) -> Needle:
        rng = random.Random(seed)
        return cls(key=rng.choice(CITIES), value=str(rng.randint(1_000_000, 9_999_999)))


@dataclass
class NeedlePrompt:
    """One prompt: ``input_ids`` of exactly ``length`` tokens, the needle at ``[needle_start, needle_end)``."""

    input_ids: list[int]
    needle: Needle
    length: int
    depth: float  # asked depth, percent of the haystack
    needle_start: int
    needle_end: int
    haystack_start: int  # first haystack token in the prompt
    haystack_end: int  # one past the last haystack token (the question follows)
    seed: int

    @property
    def actual_depth(self) -> float:
        """Where the needle ended up, in percent of the haystack tokens (after snapping)."""
        haystack = self.haystack_end - self.haystack_start - (self.needle_end - self.needle_start)
        return 100.0 * (self.needle_start - self.haystack_start) / max(haystack, 1)


# ----------------------------------------------------------------------------- haystack text


def haystack_files(data_dir: Path | None, haystack: str = "essays") -> list[Path]:
    """The sorted ``*.txt`` files of ``haystack`` (``essays`` or ``gutenberg``) under ``data_dir``."""
    if haystack not in HAYSTACKS:
        raise NeedleError(f"unknown haystack {haystack!r}; choose from {sorted(HAYSTACKS)}")
    if data_dir is None:
        raise NeedleError(
            f"no data directory: pass --data-dir or set $OSCAR_HF_DATA_DIR (the folder holding {HAYSTACKS[haystack]}/)"
        )
    folder = Path(data_dir) / HAYSTACKS[haystack]
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise NeedleError(f"no haystack text: {folder} has no .txt files (is --data-dir {data_dir} right?)")
    return files


def read_haystack(files: Sequence[Path]) -> str:
    """The files' text joined by blank lines, line endings normalised (files are read in place)."""
    return "\n\n".join(f.read_text(encoding="utf-8").replace("\r\n", "\n").strip() for f in files)


class Haystack:
    """A tokenized haystack text with the positions where a sentence ends."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, text: str) -> None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise NeedleError("the haystack text is empty")
        self.ids = torch.tensor(ids, dtype=torch.long)
        ends = {i for i in set(ids) if _SENTENCE_END.search(tokenizer.decode([i]))}
        self.sentence_end = torch.tensor([i in ends for i in ids], dtype=torch.bool)

    def __len__(self) -> int:
        return self.ids.numel()

    def sentence_start(self, offset: int) -> int:
        """The first position at or after ``offset`` that starts a sentence (``offset`` if none follows)."""
        ends = torch.nonzero(self.sentence_end[offset:]).flatten()
        return (offset + int(ends[0]) + 1) % len(self) if ends.numel() else offset

    def window(self, offset: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` ids from ``offset`` (wrapping around the text) and their sentence-end flags."""
        index = (offset + torch.arange(tokens)) % len(self)
        return self.ids[index], self.sentence_end[index]


# ----------------------------------------------------------------------------- prompts


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (none for an empty text)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def prompt_frame(tokenizer: PreTrainedTokenizerBase, needle: Needle, chat: bool = True) -> tuple[list[int], list[int]]:
    """Token ids before and after the haystack: instruction, then question and answer prefix.

    With ``chat`` and a tokenizer that has a chat template, the user turn holds instruction,
    haystack and question, and the answer prefix opens the assistant turn.
    """
    question = QUESTION.format(key=needle.key)
    answer = ANSWER_PREFIX.format(key=needle.key)
    if chat and getattr(tokenizer, "chat_template", None):
        content = f"{INSTRUCTION}\n{_PLACEHOLDER}\n{question}"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        before, after = rendered.split(_PLACEHOLDER)
        return encode(tokenizer, before), encode(tokenizer, after + answer)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and _adds_bos(tokenizer) else []
    return bos + encode(tokenizer, INSTRUCTION + "\n"), encode(tokenizer, f"\n{question}\n{answer}")


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    haystack: Haystack,
    length: int,
    depth: float,
    seed: int,
    chat: bool = True,
) -> NeedlePrompt:
    """A prompt of exactly ``length`` tokens with seed ``seed``'s needle at ``depth`` percent of the haystack.

    The needle goes before the last sentence boundary at or before the asked depth (searched up to
    200 tokens back; at the exact position if there is none).
    """
    if not 0 <= depth <= 100:
        raise NeedleError(f"depth must be a percentage in [0, 100], got {depth}")
    needle = Needle.from_seed(seed)
    before, after = prompt_frame(tokenizer, needle, chat)
    needle_ids = encode(tokenizer, " " + NEEDLE.format(key=needle.key, value=needle.value))
    room = length - len(before) - len(after) - len(needle_ids)
    if room < 1:
        raise NeedleError(
            f"length {length} is too short: instruction, needle and question alone take {length - room} tokens"
        )
    offset = haystack.sentence_start(random.Random(f"haystack-{seed}").randrange(len(haystack)))
    ids, ends = haystack.window(offset, room)
    cut = round(depth / 100 * room)
    if cut > 0:
        # the needle starts a sentence: after a token that ends one (flag at index cut - 1)
        candidates = torch.nonzero(ends[max(cut - _SNAP_WINDOW, 0) : cut]).flatten()
        if candidates.numel():
            cut = max(cut - _SNAP_WINDOW, 0) + int(candidates[-1]) + 1
    input_ids = before + ids[:cut].tolist() + needle_ids + ids[cut:].tolist() + after
    assert len(input_ids) == length, (len(input_ids), length)
    start = len(before) + cut
    return NeedlePrompt(
        input_ids=input_ids,
        needle=needle,
        length=length,
        depth=depth,
        needle_start=start,
        needle_end=start + len(needle_ids),
        haystack_start=len(before),
        haystack_end=length - len(after),
        seed=seed,
    )


# ----------------------------------------------------------------------------- scoring


NUMBER = re.compile(r"\d(?:[\d,]*\d)?")


def extract_number(answer: str) -> str | None:
    """The first number in ``answer`` with thousands separators removed (``"1,234,567."`` -> ``"1234567"``)."""
    match = NUMBER.search(answer)
    return match.group(0).replace(",", "") if match else None


def is_correct(answer: str, needle: Needle) -> bool:
    """Exact match: the first number in the answer is the needle's number."""
    return extract_number(answer) == needle.value
