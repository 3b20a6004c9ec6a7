"""Teacher-forced needle scores: the greedy walk's rules, and agreement with real prefill + greedy generation."""

from __future__ import annotations

import pytest
import torch

from oscar_hf import OscarCache, RotationSet
from oscar_hf.evaluation.haystack import (
    Haystack,
    Needle,
    build_prompt,
    extract_number,
    haystack_files,
    is_correct,
    read_haystack,
)
from oscar_hf.evaluation.niah_forced import GreedyWalk, needle_summary, score_prompts, score_walks, step
from tests.conftest import generate, tiny_model
from tests.test_niah import VOCAB, byte_tokenizer, write_essays

SMALL = dict(sink=4, recent=8, block=2)
EOS = 1


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def walk_until_decided(tokenizer, value: str, greedy_text: str, max_new_tokens: int = 12, eos_at: int | None = None):
    """Run ``step`` against a fixed greedy continuation (what generation would emit), pass by pass."""
    greedy = ids(tokenizer, greedy_text)
    if eos_at is not None:
        greedy.insert(eos_at, EOS)
    greedy += ids(tokenizer, "x" * 20)
    walk = GreedyWalk([], value, ids(tokenizer, " " + value)[:max_new_tokens])
    while walk.correct is None:
        # position j of the pass predicts draft[j]; the greedy token there is greedy[j] only while the
        # draft agrees with the greedy path before j, which the walk guarantees up to ``verified``
        agree = next((i for i, (d, g) in enumerate(zip(walk.draft, greedy)) if d != g), len(walk.draft))
        seen = greedy[: agree + 1] + [0] * (len(walk.draft) - agree)
        walk.passes += 1
        step(walk, seen, tokenizer, {EOS}, max_new_tokens)
    return walk


@pytest.mark.parametrize(
    "greedy_text, correct, passes",
    [
        (" 8056020.\n", True, 1),
        (" 8056020\n", True, 1),
        (" 80560201.", False, 1),  # a longer number
        (" 8056021.", False, 1),
        (": 8056020.", True, 2),  # a lead-in, then the draft again
        (" 8,056,020.", True, 3),  # thousands commas: each comma is a detour
        (" 8056020, and", True, 2),  # a bare comma is verified one token further
        (" 8056020,1", False, 2),
        (" 805602", False, 1),  # then "x": a finished shorter number
        ("is 8056020.", True, 3),  # each lead-in token costs a pass
        ("The number 8056020.", False, 10),  # the lead-in leaves no room in 12 tokens for the whole number
    ],
)
def test_walk_decides_like_greedy_generation(tokenizer, greedy_text, correct, passes):
    walk = walk_until_decided(tokenizer, "8056020", greedy_text)
    assert walk.correct is correct and walk.passes == passes
    generated = tokenizer.decode(ids(tokenizer, greedy_text + "x" * 20)[:12])
    assert is_correct(generated, Needle("Paris", "8056020")) is correct


def test_walk_stops_at_eos_and_at_the_token_budget(tokenizer):
    assert walk_until_decided(tokenizer, "8056020", " 8056020", eos_at=8).correct is True
    assert walk_until_decided(tokenizer, "8056020", " 8056020", eos_at=5).correct is False  # " 8056" then EOS
    assert walk_until_decided(tokenizer, "8056020", " 8056020", max_new_tokens=8).correct is True  # budget ends it
    assert walk_until_decided(tokenizer, "8056020", " 8056020", max_new_tokens=7).correct is False
    assert walk_until_decided(tokenizer, "8056020", ": 8056020", max_new_tokens=8).correct is False


@pytest.fixture(scope="module")
def digit_model():
    """A tiny random Llama whose LM head only ranks digits, a few separators and EOS, so greedy answers hold numbers."""
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", vocab_size=VOCAB)
    allowed = {EOS, *(ids(tokenizer, c)[0] for c in "0123456789,.: ")}
    with torch.no_grad():
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[list(allowed)] = True
        model.lm_head.weight[~keep] = 0.0
        model.lm_head.weight[keep] *= 20.0
    model.generation_config.eos_token_id = EOS
    return model


@pytest.mark.parametrize("method", ["none", "naive-int2", "oscar-int2", "oscar-k4v2"])
def test_exact_match_agrees_with_real_greedy_generation(digit_model, tokenizer, method):
    rotations = RotationSet.hadamard(16, [0, 1]) if method.startswith("oscar") else None
    torch.manual_seed(1)
    prompts = torch.randint(3, 256, (6, 37)).tolist()  # longer than sink + recent + block
    walks, expected = [], []
    for prompt in prompts:
        cache = OscarCache(digit_model, method, rotations=rotations, **SMALL)
        output = generate(digit_model, torch.tensor([prompt]), cache, max_new_tokens=12, min_new_tokens=0)
        answer = tokenizer.decode(output[0, len(prompt) :], skip_special_tokens=True)
        number = extract_number(answer) or "1234"
        for value in (number, number[:-1] or "9", number + "7", number[:-1] + str((int(number[-1]) + 1) % 10)):
            walks.append(GreedyWalk(prompt, value, ids(tokenizer, " " + value)))
            expected.append(is_correct(answer, Needle("Paris", value)))
    cache = OscarCache(digit_model, method, rotations=rotations, **SMALL)
    score_walks(digit_model, tokenizer, walks, cache, max_new_tokens=12, batch_size=4, progress=False)
    assert [w.correct for w in walks] == expected
    assert sum(expected) >= 4  # most greedy answers hold a number: the True side is exercised
    assert any(w.passes > 2 for w in walks)  # and so are detours from the first draft, batched from kept K/V
    assert all(w.prefix is None for w in walks)  # released once decided


def test_answer_logprob_is_the_numbers_teacher_forced_log_probability(digit_model, tokenizer):
    torch.manual_seed(2)
    prompt = torch.randint(3, 256, (30,)).tolist()
    walk = GreedyWalk(prompt, "4711", ids(tokenizer, " 4711"))
    score_walks(digit_model, tokenizer, [walk], OscarCache(digit_model, "none"), progress=False)
    with torch.no_grad():
        log_probs = digit_model(torch.tensor([prompt + ids(tokenizer, " 4711")])).logits[0].log_softmax(-1)
    digits = ids(tokenizer, "4711")
    expected = sum(log_probs[len(prompt) + k, t] for k, t in enumerate(digits))  # after prompt + " "
    assert walk.answer_logprob == pytest.approx(float(expected), abs=1e-4)


def test_score_prompts_summarises_per_recipe_length_and_depth(digit_model, tokenizer, tmp_path):
    haystack = Haystack(tokenizer, read_haystack(haystack_files(write_essays(tmp_path), "essays")))
    prompts = [
        build_prompt(tokenizer, haystack, n, d, seed) for n in (500, 600) for d in (0.0, 50.0) for seed in (0, 1)
    ]
    caches = {"none": OscarCache(digit_model, "none"), "int2": OscarCache(digit_model, "naive-int2", **SMALL)}
    trials, seconds = score_prompts(digit_model, tokenizer, prompts, caches, batch_size=2, progress=False)
    assert len(trials) == 16 and set(seconds) == {"none", "int2"} and set(seconds["int2"]) == {500, 600}
    summary = needle_summary(trials)
    assert summary["int2"]["by_length"]["500"]["trials"] == 4 and summary["none"]["all"]["trials"] == 8
    assert set(summary["none"]["by_depth"]["600"]) == {"0", "50"}
    assert all(t.answer_logprob < 0 for t in trials)
