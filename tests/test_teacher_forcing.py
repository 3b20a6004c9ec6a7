"""The one-pass teacher-forced evaluator reproduces real step-by-step decoding with OscarCache."""

from __future__ import annotations

import pytest
import torch

from oscar_hf import OscarCache, OscarConfig, RotationSet
from oscar_hf.cache import OscarLayer
from oscar_hf.teacher_forcing import history_lengths, teacher_forced_logits
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
