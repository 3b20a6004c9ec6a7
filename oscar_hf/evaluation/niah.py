"""Needle in a haystack (RULER-style single needle) for every cache method.

A sentence ``The special magic number for <city> is: <7-digit number>.`` is inserted at a chosen
depth of a haystack of real text (the Paul Graham essays of the original needle test, or Project
Gutenberg books), read in place from the data directory. The model is then asked for the number
(with the chat template when the tokenizer has one, and RULER's answer prefix), answers with a
few greedily generated tokens per method, each with a fresh :class:`~oscar_hf.OscarCache`, and
scores an exact match of the number.

Every prompt has exactly the asked number of tokens: chat prefix and instruction, haystack with
the needle inside it (snapped back to a sentence boundary), question and answer prefix, all
assembled as token ids. The same seed gives the same needle and haystack offset at every length
and depth, so methods, lengths and depths are compared on paired trials.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from oscar_hf.core.models import model_context
from oscar_hf.evaluation.report import tokens_label
from oscar_hf.log import get_logger
from oscar_hf.provenance import machine_line, provenance_line
from oscar_hf.rotations.rotation_set import MethodRotations

logger = get_logger(__name__)

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


@dataclass
class Trial:
    method: str
    length: int
    depth: float
    seed: int
    key: str
    expected: str
    answer: str
    extracted: str | None
    correct: bool
    needle_position: int  # first needle token
    actual_depth: float
    prefill_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def parse_lengths(text: str) -> list[int]:
    """``"2K,4096,8k"`` -> ``[2048, 4096, 8192]`` (K = 1024)."""
    lengths = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)([kK]?)", part)
        if not match:
            raise NeedleError(f"bad length {part!r}: use token counts like 2048 or 2K")
        lengths.append(int(match.group(1)) * (1024 if match.group(2) else 1))
        if lengths[-1] < 1:
            raise NeedleError(f"bad length {part!r}: a prompt holds at least 1 token")
    if not lengths:
        raise NeedleError("no lengths given")
    return lengths


def parse_depths(text: str) -> list[float]:
    """``"0,25,50"`` -> ``[0.0, 25.0, 50.0]``, each checked to lie in [0, 100]."""
    try:
        depths = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise NeedleError(f"bad depths {text!r}: use percentages like 0,25,50,75,100") from None
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad or not depths:
        raise NeedleError(f"depths must be percentages in [0, 100], got {text!r}")
    return depths


def check_lengths(lengths: Sequence[int], context: int | None, max_new_tokens: int) -> None:
    """Raise :class:`NeedleError` if a prompt plus its answer would not fit the model's context."""
    if context is None:
        return
    too_long = [n for n in lengths if n + max_new_tokens > context]
    if too_long:
        raise NeedleError(
            f"length(s) {too_long} plus {max_new_tokens} new tokens exceed the model's context of "
            f"{context} tokens; the longest prompt that fits is {context - max_new_tokens}"
        )


@torch.no_grad()
def run_niah(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    haystack: Haystack,
    methods: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    seeds: Sequence[int],
    rotations: MethodRotations = None,
    max_new_tokens: int = 12,
    chat: bool = True,
    progress: bool = True,
) -> list[Trial]:
    """Every (length, seed, depth, method) trial, each generated with a fresh cache of its method."""
    from oscar_hf.evaluation.demo import run_method

    check_lengths(lengths, model_context(model), max_new_tokens)
    trials = []
    bar = tqdm(total=len(lengths) * len(seeds) * len(depths) * len(methods), desc="needle trials", disable=not progress)
    for length in lengths:
        for seed in seeds:
            for depth in depths:
                prompt = build_prompt(tokenizer, haystack, length, depth, seed, chat)
                ids = torch.tensor([prompt.input_ids])
                for method in methods:
                    bar.set_postfix_str(f"{length} tokens, depth {depth:g}%, {method}")
                    run = run_method(model, tokenizer, ids, method, rotations, max_new_tokens)
                    extracted = extract_number(run.answer)
                    trial = Trial(
                        method=method,
                        length=length,
                        depth=depth,
                        seed=seed,
                        key=prompt.needle.key,
                        expected=prompt.needle.value,
                        answer=run.answer,
                        extracted=extracted,
                        correct=is_correct(run.answer, prompt.needle),
                        needle_position=prompt.needle_start,
                        actual_depth=round(prompt.actual_depth, 2),
                        prefill_seconds=run.prefill_seconds,
                    )
                    logger.info(
                        "%s length %d depth %g seed %d: %r (%s)",
                        method,
                        length,
                        depth,
                        seed,
                        run.answer,
                        "correct" if trial.correct else f"expected {prompt.needle.value}",
                    )
                    trials.append(trial)
                    bar.update()
    bar.close()
    return trials


# ----------------------------------------------------------------------------- reports


def accuracy_table(trials: Sequence[Trial]) -> dict[str, dict[str, dict[str, float]]]:
    """``{method: {length: {depth: accuracy}}}`` (keys as strings, for JSON)."""
    cells: dict[tuple[str, int, float], list[bool]] = {}
    for t in trials:
        cells.setdefault((t.method, t.length, t.depth), []).append(t.correct)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for (method, length, depth), hits in cells.items():
        table.setdefault(method, {}).setdefault(str(length), {})[f"{depth:g}"] = round(sum(hits) / len(hits), 4)
    return table


def summary(trials: Sequence[Trial]) -> dict[str, dict[str, float]]:
    """``{method: {length or "all": accuracy}}``."""
    groups: dict[tuple[str, str], list[bool]] = {}
    for t in trials:
        groups.setdefault((t.method, str(t.length)), []).append(t.correct)
        groups.setdefault((t.method, "all"), []).append(t.correct)
    out: dict[str, dict[str, float]] = {}
    for (method, length), hits in groups.items():
        out.setdefault(method, {})[length] = round(sum(hits) / len(hits), 4)
    return out


def niah_result(trials: Sequence[Trial], meta: dict, settings: dict) -> dict:
    return {
        **meta,
        **settings,
        "summary": summary(trials),
        "accuracy": accuracy_table(trials),
        "trials": [t.to_dict() for t in trials],
    }


def niah_markdown(result: dict) -> str:
    methods, lengths, depths = result["methods"], result["lengths"], result["depths"]
    head = "| method | " + " | ".join(f"{tokens_label(n)} ({n} tokens)" for n in lengths) + " | all |"
    rows = [
        "Accuracy (exact match of the 7-digit number), all depths and needles:",
        "",
        head,
        "|---|" + "---|" * (len(lengths) + 1),
    ]
    for m in methods:
        s = result["summary"][m]
        rows.append(f"| {m} | " + " | ".join(f"{s[str(n)]:.2f}" for n in lengths) + f" | {s['all']:.2f} |")
    rows += [
        "",
        "Per depth (rows: method and length; columns: needle depth in % of the haystack):",
        "",
        "| method | length | " + " | ".join(f"{d:g}%" for d in depths) + " |",
        "|---|---|" + "---|" * len(depths),
    ]
    for m in methods:
        for n in lengths:
            cell = result["accuracy"][m][str(n)]
            rows.append(f"| {m} | {tokens_label(n)} | " + " | ".join(f"{cell[f'{d:g}']:.2f}" for d in depths) + " |")
    meta = (
        f"\n\n{provenance_line(result)}, "
        f"{result['seconds']} s; model {result['model']}, haystack: {result['haystack']}, "
        f"{len(result['seeds'])} needle(s) per cell (seeds {result['seeds']}), greedy, "
        f"{result['max_new_tokens']} new tokens, chat template: {result['chat']}."
    )
    return "\n".join(rows) + meta + "\n"


def plot_niah(result: dict, path: Path) -> None:
    """One panel per method: accuracy over needle depth (rows) and prompt length (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods, lengths, depths = result["methods"], result["lengths"], result["depths"]
    cols = min(3, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.4 * cols + 1, 0.4 * len(depths) * rows + 1.4 * rows + 1),
        squeeze=False,
        layout="constrained",
    )
    image = None
    for ax, method in zip(axes.flat, methods):
        grid = np.array([[result["accuracy"][method][str(n)][f"{d:g}"] for n in lengths] for d in depths])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [tokens_label(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set_title(f"{method} ({result['summary'][method]['all']:.2f})")
        ax.set_xlabel("prompt length (tokens)")
        if ax in axes[:, 0]:
            ax.set_ylabel("needle depth (% of haystack)")
    for ax in list(axes.flat)[len(methods) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    fig.suptitle(
        f"Needle in a haystack, {result['model']}: {len(result['seeds'])} needle(s) per cell\n"
        f"{result['command']}\n{machine_line(result['machine'])}, {result['date']}",
        fontsize=8,
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)
