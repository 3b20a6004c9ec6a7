"""Needle-in-a-haystack scores from teacher-forced passes instead of generation.

A trial is a prompt from :func:`oscar_hf.evaluation.haystack.build_prompt`; real use prefills it in one chunk and
decodes the answer against the cache that chunk left (:func:`~oscar_hf.calibration.teacher_forcing.teacher_forced_logits`
with ``prefill`` = the prompt's length reproduces that schedule in one pass). Two scores come from it:

* **answer log-probability**: the summed log-probability of the needle's number (its digit tokens,
  after the leading space the answer prefix calls for), teacher-forced after ``prompt + " "``;
  a smooth score that moves before exact match flips;
* **exact match**, decided as greedy generation would: the pass verifies a *draft* of the answer
  (``" " + number``) like speculative decoding: greedy decoding follows the draft as long as each
  draft token is the argmax given the tokens before it. Where the argmax leaves the draft, the greedy
  text so far is judged the way :func:`oscar_hf.evaluation.haystack.is_correct` judges a generated answer (the first
  number in it, commas removed): a wrong digit or a finished wrong number is a miss, an EOS ends the
  answer; a detour that can still lead to the right number (a lead-in such as ``":"``, or a thousands
  comma) becomes the next draft, verified by another pass of that trial only. That pass reuses the
  prompt's K/V kept from the first (``teacher_forced_logits(..., past_key_values=...)``), so it
  costs the answer's few rows, not another prefill.

The token after the number decides whether the number is finished: the greedy answer counts only if
that token begins with neither a digit nor a comma followed by a digit (``"80560201"`` and
``"8056020,1"`` are other numbers), or is EOS, or the ``max_new_tokens`` budget of real generation
ends there. A bare comma after the number is verified one token further. So exact match equals that
of greedy generation with ``max_new_tokens`` new tokens, up to argmax ties within rounding of the
two computations, at one prefill per trial and never more passes than new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from oscar_hf.calibration.teacher_forcing import teacher_forced_logits
from oscar_hf.core.cache import OscarCache
from oscar_hf.evaluation.haystack import NUMBER, NeedlePrompt, encode, extract_number
from oscar_hf.log import get_logger

logger = get_logger(__name__)


@dataclass
class GreedyWalk:
    """The state of one trial's exact-match decision: the draft to verify and what is settled so far."""

    prompt: list[int]
    value: str
    draft: list[int]
    verified: int = 0  # leading draft tokens known to be greedy
    correct: bool | None = None
    answer: list[int] = field(default_factory=list)  # greedy tokens up to the decision
    answer_logprob: float | None = None
    passes: int = 0
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the prompt's K/V per layer while undecided


def eos_ids(model: PreTrainedModel) -> set[int]:
    """The token ids that end greedy generation with ``model``'s generation config."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def step(
    walk: GreedyWalk, greedy: Sequence[int], tokenizer: PreTrainedTokenizerBase, stop: set[int], max_new_tokens: int
) -> None:
    """Advance ``walk`` by one verified pass: ``greedy[j]`` is the argmax after ``prompt + draft[:j]``.

    Sets ``correct`` when the answer is decided, else the next ``draft`` (see the module docstring).
    """
    draft = walk.draft
    j = next((i for i in range(walk.verified, len(draft)) if draft[i] != greedy[i]), len(draft))
    generated = draft[:j] + ([int(greedy[j])] if j < max_new_tokens else [])
    walk.answer, walk.verified = generated, len(generated)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    if len(generated) >= max_new_tokens or generated[-1] in stop:
        walk.correct = extract_number(text) == walk.value
        return
    match = NUMBER.search(text)
    if match is None:  # a lead-in without digits: the number may still follow
        continuation = walk.value if not text or text[-1].isspace() else " " + walk.value
    else:
        digits, tail = match.group(0).replace(",", ""), text[match.end() :]
        if tail.strip(","):  # something else follows the number: it is finished
            walk.correct = digits == walk.value
            return
        if not walk.value.startswith(digits):
            walk.correct = False
            return
        continuation = walk.value[len(digits) :]  # empty: the next pass shows the token after the number
    walk.draft = (generated + encode(tokenizer, continuation))[:max_new_tokens]


def _verify(
    model: PreTrainedModel, cache: OscarCache, batch: list[GreedyWalk], first: bool, device: torch.device
) -> tuple[torch.Tensor, list[list[int]]]:
    """One pass over the batch's drafts: log-probabilities and ``greedy[row][j]``, the argmax before ``draft[j]``.

    A first pass prefills the prompts and keeps each undecided row's prompt K/V; a later pass runs
    only the drafts after those (its ``greedy[row][0]`` is a placeholder: the first token is verified).
    """
    prompt_length, draft_length = len(batch[0].prompt), len(batch[0].draft)
    past = DynamicCache(config=model.config)
    if first:
        ids = torch.tensor([w.prompt + w.draft for w in batch], device=device)
        logits = teacher_forced_logits(model, ids, cache, prompt_length, draft_length + 1, past)
        past.crop(-draft_length)
        for row, walk in enumerate(batch):
            walk.prefix = [
                (layer.keys[row : row + 1].clone(), layer.values[row : row + 1].clone()) for layer in past.layers
            ]
    else:
        for index in range(len(batch[0].prefix)):
            past.update(
                torch.cat([w.prefix[index][0] for w in batch]), torch.cat([w.prefix[index][1] for w in batch]), index
            )
        ids = torch.tensor([w.draft for w in batch], device=device)
        logits = teacher_forced_logits(model, ids, cache, prompt_length, past_key_values=past)
        logits = torch.cat([logits[:, :1], logits], dim=1)  # position 0: the verified first token's placeholder
    log_probs = logits.float().log_softmax(-1)
    return log_probs, log_probs.argmax(-1).tolist()


def _answer_logprob(walk: GreedyWalk, log_probs: torch.Tensor, tokenizer: PreTrainedTokenizerBase) -> float:
    """Summed log-probability of the first draft's tokens from its first digit on (the number)."""
    first = next((i for i, t in enumerate(walk.draft) if any(c.isdigit() for c in tokenizer.decode([t]))), 0)
    targets = torch.tensor(walk.draft, device=log_probs.device)
    return float(log_probs[torch.arange(len(walk.draft), device=log_probs.device), targets][first:].sum())


@torch.no_grad()
def score_walks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    walks: Sequence[GreedyWalk],
    cache: OscarCache,
    max_new_tokens: int = 12,
    batch_size: int = 1,
    progress: bool = True,
    description: str = "needle passes",
) -> None:
    """Decide every walk's exact match (and, on its first pass, its answer log-probability) in place.

    Walks whose prompt and draft have the same lengths share batched passes of up to ``batch_size`` rows.
    """
    if min(batch_size, max_new_tokens) < 1:
        raise ValueError("batch_size and max_new_tokens must be at least 1")
    stop, device = eos_ids(model), next(model.parameters()).device
    for walk in walks:
        walk.draft = walk.draft[:max_new_tokens]
    bar = tqdm(total=len(walks), desc=description, disable=not progress)
    while pending := [w for w in walks if w.correct is None]:
        groups: dict[tuple[int, int, bool], list[GreedyWalk]] = {}
        for walk in pending:
            groups.setdefault((len(walk.prompt), len(walk.draft), walk.prefix is None), []).append(walk)
        for (_, _, first), group in groups.items():
            for start in range(0, len(group), batch_size):
                batch = group[start : start + batch_size]
                log_probs, greedy = _verify(model, cache, batch, first, device)
                for row, walk in enumerate(batch):
                    if first:
                        walk.answer_logprob = _answer_logprob(walk, log_probs[row], tokenizer)
                    walk.passes += 1
                    step(walk, greedy[row], tokenizer, stop, max_new_tokens)
                    if walk.correct is not None:
                        walk.prefix = None
                        bar.update()
    bar.close()


@dataclass
class ForcedTrial:
    """One needle trial of one recipe, scored teacher-forced."""

    recipe: str
    length: int
    depth: float
    seed: int
    expected: str
    correct: bool
    answer_logprob: float  # nats, summed over the number's tokens
    answer: str  # the greedy answer up to the token that decided it
    passes: int
    needle_position: int
    actual_depth: float

    def to_dict(self) -> dict:
        return asdict(self)


def score_prompts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[NeedlePrompt],
    caches: dict[str, OscarCache],
    max_new_tokens: int = 12,
    batch_size: int = 1,
    progress: bool = True,
) -> tuple[list[ForcedTrial], dict[str, dict[int, float]]]:
    """Every (recipe, prompt) trial, and the seconds each recipe's passes took per prompt length."""
    trials, seconds = [], {}
    for label, cache in caches.items():
        seconds[label] = {}
        for length in sorted({p.length for p in prompts}):
            chosen = [p for p in prompts if p.length == length]
            walks = [GreedyWalk(p.input_ids, p.needle.value, encode(tokenizer, " " + p.needle.value)) for p in chosen]
            started = time.perf_counter()
            score_walks(
                model,
                tokenizer,
                walks,
                cache,
                max_new_tokens,
                batch_size,
                progress,
                f"needles {label} at {length} tokens",
            )
            seconds[label][length] = round(time.perf_counter() - started, 2)
            for prompt, walk in zip(chosen, walks):
                trial = ForcedTrial(
                    recipe=label,
                    length=length,
                    depth=prompt.depth,
                    seed=prompt.seed,
                    expected=prompt.needle.value,
                    correct=bool(walk.correct),
                    answer_logprob=round(walk.answer_logprob, 4),
                    answer=tokenizer.decode(walk.answer, skip_special_tokens=True),
                    passes=walk.passes,
                    needle_position=prompt.needle_start,
                    actual_depth=round(prompt.actual_depth, 2),
                )
                logger.info(
                    "%s length %d depth %g seed %d: %r, log p %.2f (%s)",
                    label,
                    length,
                    prompt.depth,
                    prompt.seed,
                    trial.answer,
                    trial.answer_logprob,
                    "correct" if trial.correct else f"expected {trial.expected}",
                )
                trials.append(trial)
    return trials, seconds


def needle_summary(trials: Sequence[ForcedTrial]) -> dict[str, dict]:
    """``{recipe: {"by_length": {length: {...}}, "by_depth": {length: {depth: exact match}}, "all": {...}}}``.

    Each aggregate holds ``exact_match`` (share of trials), ``answer_logprob`` (mean, nats) and ``trials``.
    """

    def aggregate(group: list[ForcedTrial]) -> dict:
        return {
            "exact_match": round(sum(t.correct for t in group) / len(group), 4),
            "answer_logprob": round(sum(t.answer_logprob for t in group) / len(group), 4),
            "trials": len(group),
        }

    out: dict[str, dict] = {}
    for recipe in dict.fromkeys(t.recipe for t in trials):
        mine = [t for t in trials if t.recipe == recipe]
        lengths = sorted({t.length for t in mine})
        out[recipe] = {
            "by_length": {str(n): aggregate([t for t in mine if t.length == n]) for n in lengths},
            "by_depth": {
                str(n): {
                    f"{d:g}": aggregate([t for t in mine if t.length == n and t.depth == d])["exact_match"]
                    for d in sorted({t.depth for t in mine})
                }
                for n in lengths
            },
            "all": aggregate(mine),
        }
    return out
