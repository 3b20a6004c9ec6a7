"""The one-pass teacher-forced evaluator reproduces real step-by-step decoding with OscarCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarConfig, RotationSet
from oscar_hf.calibration.teacher_forcing import history_lengths, teacher_forced_logits, token_stats
from oscar_hf.core.layer import OscarLayer
from tests.conftest import forward

SMALL = dict(sink=4, recent=8, block=2)


def test_history_lengths_follow_a_real_layer():
    config = OscarConfig(sink=4, recent=8, block=3)
    layer = OscarLayer(config, None, None)
    seen = []
    for _ in range(40):
        layer.update(*[torch.randn(1, 1, 1, 16)] * 2)
        seen.append(layer.history_length)
    # h(i) is the history while query i is attended, i.e. after step i's demotion and before storing i
    expected = history_lengths(40, config).tolist()
    assert seen == expected


@pytest.mark.parametrize("prefill", [2, 12, 13, 19, 30])
def test_history_lengths_after_a_prefill_follow_a_real_layer(prefill):
    config = OscarConfig(sink=4, recent=8, block=3)
    layer = OscarLayer(config, None, None)
    layer.update(*[torch.randn(1, 1, prefill, 16)] * 2)
    seen = [0] * prefill  # the prefill chunk attends to its own unquantized K/V
    for _ in range(30):
        layer.update(*[torch.randn(1, 1, 1, 16)] * 2)
        seen.append(layer.history_length)  # what the decoded query saw: demotion runs before its attention
    assert seen == history_lengths(prefill + 30, config, prefill).tolist()


@pytest.mark.parametrize("method", ["naive-int2", "quarot-int2", "oscar-int2", "int4", "oscar-k4v2", "none"])
@pytest.mark.parametrize("prefill", [30, 13])  # with and without a history right after the prefill
def test_matches_prefill_then_step_by_step_decoding(tiny, method, prefill):
    rotations = RotationSet.hadamard(16, [0, 1]) if method.startswith("oscar") else None
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (2, prefill + 10))
    answer = ids.shape[1] - prefill + 1  # the prefill's last position predicts the first decoded token
    cache = OscarCache(tiny, method, rotations=rotations, **SMALL)
    real = [forward(tiny, ids[:, :prefill], cache).logits[:, -1:]]
    real += [forward(tiny, ids[:, i : i + 1], cache).logits for i in range(prefill, ids.shape[1])]
    one_pass = teacher_forced_logits(
        tiny, ids, OscarCache(tiny, method, rotations=rotations, **SMALL), prefill, logits_to_keep=answer
    )
    torch.testing.assert_close(one_pass, torch.cat(real, dim=1), atol=2e-5, rtol=2e-5)
    assert tiny.config._attn_implementation == "oscar"


@pytest.mark.parametrize("method", ["oscar-int2", "none"])
def test_a_cropped_prefill_cache_continues_the_schedule(tiny, method):
    rotations = RotationSet.hadamard(16, [0, 1]) if method.startswith("oscar") else None
    cache = OscarCache(tiny, method, rotations=rotations, **SMALL)
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (2, 40))
    past = DynamicCache(config=tiny.config)
    whole = teacher_forced_logits(tiny, ids, cache, prefill=30, logits_to_keep=10, past_key_values=past)
    assert past.get_seq_length() == 40
    past.crop(-10)
    continued = teacher_forced_logits(tiny, ids[:, 30:], cache, prefill=30, past_key_values=past)
    torch.testing.assert_close(continued, whole, atol=2e-5, rtol=2e-5)
    past.crop(-20)  # the continuation extended it to 40 again
    if method != "none":
        with pytest.raises(ValueError, match="at least the 30 prefill tokens"):
            teacher_forced_logits(tiny, ids[:, 20:], cache, prefill=30, past_key_values=past)


def test_a_prefill_schedule_differs_from_decoding_every_token(tiny):
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (1, 40))
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    decoded = teacher_forced_logits(tiny, ids, cache, logits_to_keep=5)
    prefilled = teacher_forced_logits(tiny, ids, cache, prefill=35, logits_to_keep=5)
    assert (decoded - prefilled).abs().max() > 1e-3  # the prefill's own queries saw no quantized key
    with pytest.raises(ValueError, match="prefill"):
        teacher_forced_logits(tiny, ids, cache, prefill=40)


@pytest.mark.parametrize("method", ["naive-int2", "quarot-int2", "oscar-int2", "oscar-k4v2", "oscar-k3v2", "none"])
def test_matches_token_by_token_decoding(tiny, method):
    rotations = RotationSet.hadamard(16, [0, 1]) if method.startswith("oscar") else None
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (1, 48))
    cache = OscarCache(tiny, method, rotations=rotations, **SMALL)
    stepwise = torch.cat([forward(tiny, ids[:, i : i + 1], cache).logits for i in range(ids.shape[1])], dim=1)
    assert cache.layers[0].history_length == history_lengths(48, cache.oscar_config)[-1]
    one_pass = teacher_forced_logits(tiny, ids, OscarCache(tiny, method, rotations=rotations, **SMALL))
    torch.testing.assert_close(one_pass, stepwise, atol=2e-4, rtol=2e-4)
    assert tiny.config._attn_implementation == "oscar"  # restored


def test_quantization_changes_the_logits(tiny):
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (1, 48))
    exact = teacher_forced_logits(tiny, ids, OscarCache(tiny, "none"))
    int2 = teacher_forced_logits(tiny, ids, OscarCache(tiny, "naive-int2", **SMALL))
    first_quantized = SMALL["sink"] + SMALL["recent"] + SMALL["block"] - 1
    torch.testing.assert_close(int2[:, :first_quantized], exact[:, :first_quantized])
    assert (int2[:, first_quantized:] - exact[:, first_quantized:]).abs().max() > 1e-3


def test_token_stats_do_not_depend_on_the_chunk_of_positions():
    """The log-probabilities are taken a few positions at a time; the statistics are those of one pass."""
    generator = torch.Generator().manual_seed(0)
    logits, reference = torch.randn(2, 10, 50, generator=generator).to(torch.bfloat16)
    targets = torch.randint(0, 50, (10,), generator=generator)
    whole = token_stats(logits, reference, targets, chunk=10)
    for got, want in zip(token_stats(logits, reference, targets, chunk=3), whole):
        torch.testing.assert_close(got, want)
    log_probs, expected = logits.float().log_softmax(-1), reference.float().log_softmax(-1)
    torch.testing.assert_close(whole[1], (expected.exp() * (expected - log_probs)).sum(-1))
    torch.testing.assert_close(whole[0], -log_probs[torch.arange(10), targets])


def test_a_pass_keeps_no_rotations_cast_for_its_cache(tiny):
    """Bit allocation runs a pass for each of dozens of caches of one model: their rotations cast to the
    model's dtype must not pile up (on the 8B shape they were several GiB), and the logits stay the same."""
    ids = torch.randint(3, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    layers = list(range(tiny.config.num_hidden_layers))
    cache = OscarCache(tiny, "oscar-int2", rotations=RotationSet.hadamard(16, layers), **SMALL)
    first = teacher_forced_logits(tiny, ids, cache)
    assert all(not layer.rotation_copies() for layer in cache.layers if isinstance(layer, OscarLayer))
    torch.testing.assert_close(teacher_forced_logits(tiny, ids, cache), first)
