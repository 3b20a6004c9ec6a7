"""Per-layer history bit widths stored with calibrated rotations: K at 4 bits in some layers, V at 1 bit in others,
for the method whose widths they were allocated against."""

from __future__ import annotations

import logging

import pytest
import torch

from oscar_hf import METHODS, OscarCache, RotationSet
from oscar_hf.calibration.teacher_forcing import teacher_forced_logits
from oscar_hf.config import TensorQuantConfig, check_bit_budget
from oscar_hf.core.memory import mean_bits_per_element
from oscar_hf.evaluation.kl import evaluate_caches
from oscar_hf.quant import unpack
from tests.conftest import forward

SMALL = dict(sink=4, recent=8, block=2)


def mixed_rotations(key_bits=None, value_bits=None) -> RotationSet:
    """Hadamard rotations of the tiny model's 2 layers with K4 in layer 0 and V1 in both (oscar-int2's budget)."""
    rotations = RotationSet.hadamard(16, [0, 1])
    rotations.key_bits.update({0: 4} if key_bits is None else key_bits)
    rotations.value_bits.update({0: 1, 1: 1} if value_bits is None else value_bits)
    return rotations


def test_for_layer_applies_the_widths_without_clipping_the_changed_tensor():
    config = METHODS["oscar-int2"]
    layer = config.for_layer(key_clip=0.9, value_clip=0.88, key_bits=4, value_bits=None)
    assert (layer.key.bits, layer.key.clip_ratio) == (4, 0.0)
    assert (layer.value.bits, layer.value.clip_ratio) == (2, 0.88)
    same_width = config.for_layer(key_clip=0.9, key_bits=2)
    assert (same_width.key.bits, same_width.key.clip_ratio) == (2, 0.9)
    assert config.with_overrides(layer_bits=False).for_layer(key_bits=4).key.bits == 2
    assert METHODS["quarot-int2"].for_layer(key_bits=4) is METHODS["quarot-int2"]  # not a calibrated method


def test_for_layer_applies_widths_only_to_the_method_they_were_allocated_for():
    k3v2 = METHODS["oscar-k3v2"]
    layer = k3v2.for_layer(key_clip=0.9, value_clip=0.88, key_bits=4, value_bits=1, base_bits=(3, 2))
    assert (layer.key.bits, layer.key.clip_ratio, layer.value.bits, layer.value.clip_ratio) == (4, 0.0, 1, 0.0)
    # searched clip ratios reach 2-bit tensors only: the 2-bit values, not the 3-bit keys
    kept = k3v2.for_layer(key_clip=0.9, value_clip=0.88, key_bits=4, value_bits=1)  # widths made for K2 V2
    assert (kept.key.bits, kept.key.clip_ratio, kept.value.bits, kept.value.clip_ratio) == (
        3,
        k3v2.key.clip_ratio,
        2,
        0.88,
    )
    assert METHODS["oscar-int2"].for_layer(key_bits=4, value_bits=1, base_bits=(3, 2)) == METHODS["oscar-int2"]


def test_k3v2_widths_reach_only_oscar_k3v2_and_int2_widths_only_oscar_int2(tiny, caplog):
    k3v2_widths = mixed_rotations(value_bits={1: 1})  # K4 in layer 0, V1 in layer 1: oscar-k3v2's budget
    k3v2_widths.base_bits = (3, 2)
    cache = OscarCache(tiny, "oscar-k3v2", rotations=k3v2_widths, **SMALL)
    assert [(layer.config.key.bits, layer.config.value.bits) for layer in cache.layers] == [(4, 2), (3, 1)]
    cases = (
        ("oscar-int2", k3v2_widths, [(2, 2)] * 2, "allocated for K3 V2; method 'oscar-int2' (K2 V2)"),
        ("oscar-k3v2", mixed_rotations(), [(3, 2)] * 2, "allocated for K2 V2; method 'oscar-k3v2' (K3 V2)"),
    )
    for method, rotations, widths, message in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="oscar_hf"):
            cache = OscarCache(tiny, method, rotations=rotations, **SMALL)
        assert [(layer.config.key.bits, layer.config.value.bits) for layer in cache.layers] == widths
        assert message in caplog.text


def test_base_bits_are_checked_and_kept_by_the_set_operations():
    with pytest.raises(ValueError, match="base_bits must be"):
        RotationSet(16, base_bits=(8, 2))
    rotations = RotationSet(16, {0: torch.eye(16).expand(2, 16, 16)}, key_bits={0: 4}, base_bits=(3, 2))
    assert rotations.select_kv_heads(0, 1).base_bits == (3, 2) == rotations.as_per_head(2).base_bits


def test_the_cache_quantizes_each_layer_at_its_own_widths(tiny):
    cache = OscarCache(tiny, "oscar-int2", rotations=mixed_rotations(), **SMALL)
    widths = [(layer.config.key.bits, layer.config.value.bits) for layer in cache.layers]
    assert widths == [(4, 1), (2, 1)]
    assert cache.layers[1].config.key.clip_ratio == METHODS["oscar-int2"].key.clip_ratio
    forward(tiny, torch.randint(3, 200, (2, 40)), cache)
    first, second = cache.layers
    history = first.history_length
    assert history > 0
    # codes per row at head_dim 16: 4-bit K 8 bytes, 1-bit V 2 bytes, 2-bit K 4 bytes
    assert first.history_keys.codes.view().shape[-1] == 8 and first.history_values.codes.view().shape[-1] == 2
    assert second.history_keys.codes.view().shape[-1] == 4 and second.history_values.codes.view().shape[-1] == 2
    report = cache.memory_report()
    assert report.layers[0].code_bytes == 2 * 2 * history * (8 + 2)  # batch 2, 2 KV heads
    assert report.layers[1].code_bytes == 2 * 2 * history * (4 + 2)
    values = unpack(first.history_values.codes.view(), 1)
    assert set(values.unique().tolist()) == {0, 1}


def test_an_allocation_that_changes_the_history_bits_is_refused_unless_allowed(tiny):
    rotations = mixed_rotations(value_bits={0: 1})  # K4 in one layer, V1 in only one: +1 bit a token
    with pytest.raises(ValueError, match="rebalance the allocation"):
        OscarCache(tiny, "oscar-int2", rotations=rotations)
    cache = OscarCache(tiny, "oscar-int2", rotations=rotations, allow_bits_change=True)
    assert [layer.config.value.bits for layer in cache.layers] == [1, 2]
    plain = OscarCache(tiny, "oscar-int2", rotations=rotations, layer_bits=False)
    assert [(layer.config.key.bits, layer.config.value.bits) for layer in plain.layers] == [(2, 2), (2, 2)]
    check_bit_budget(METHODS["oscar-int2"], [METHODS["oscar-int2"]] * 3)


def test_bad_widths_and_symmetric_1bit_rows_are_refused():
    with pytest.raises(ValueError, match=r"value_bits of layer 0 must be one of \(1, 2, 3, 4\)"):
        RotationSet(16, value_bits={0: 8})
    with pytest.raises(ValueError, match="symmetric"):
        TensorQuantConfig(1, symmetric=True).validate("value", 16)


@pytest.mark.parametrize("prefill", [0, 30])
def test_teacher_forcing_matches_decoding_with_mixed_widths(tiny, prefill):
    rotations = mixed_rotations()
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (1, 44))
    cache = OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL)
    if prefill:
        real = [forward(tiny, ids[:, :prefill], cache).logits[:, -1:]]
        real += [forward(tiny, ids[:, i : i + 1], cache).logits for i in range(prefill, ids.shape[1])]
        keep = ids.shape[1] - prefill + 1
    else:
        real = [forward(tiny, ids[:, i : i + 1], cache).logits for i in range(ids.shape[1])]
        keep = 0
    assert cache.layers[0].history_length > 0
    one_pass = teacher_forced_logits(
        tiny, ids, OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL), prefill, logits_to_keep=keep
    )
    torch.testing.assert_close(one_pass, torch.cat(real, dim=1), atol=2e-4, rtol=2e-4)
    uniform = teacher_forced_logits(
        tiny,
        ids,
        OscarCache(tiny, "oscar-int2", rotations=RotationSet.hadamard(16, [0, 1]), **SMALL),
        prefill,
        logits_to_keep=keep,
    )
    assert (uniform - one_pass).abs().max() > 1e-3  # the widths reached the evaluated attention


def test_evaluation_reports_each_layers_widths(tiny):
    rotations = mixed_rotations(value_bits={0: 1})  # +1 bit a token over the 2 layers
    caches = {
        "int2": OscarCache(tiny, "oscar-int2", rotations=RotationSet.hadamard(16, [0, 1]), **SMALL),
        "more": OscarCache(tiny, "oscar-int2", rotations=rotations, allow_bits_change=True, **SMALL),
    }
    tokens = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(0))
    int2, more = evaluate_caches(tiny, tokens, caches, context=48, windows=1, progress=False)
    # history elements of the 2 layers: (4 + 1 + 2 + 2) / 4 code bits against 2, plus the same metadata
    assert more.bits_per_element > int2.bits_per_element
    expected = mean_bits_per_element([layer.config for layer in caches["more"].layers], 48, 16)
    assert more.bits_per_element == round(expected, 3)
