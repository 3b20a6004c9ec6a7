"""OscarCache inside ``generate``: the transformers Cache contract and its silent traps (transformers' ``cache_utils`` and ``generate``)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarConfig, RotationSet, TensorQuantConfig
from oscar_hf.core.layer import OscarLayer
from tests.conftest import forward, generate

SMALL = dict(sink=4, recent=8, block=2)


def prompts(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def left_pad(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def reference(model, input_ids, **kwargs):
    """The same generation with transformers' own DynamicCache and SDPA attention."""
    model.set_attn_implementation("sdpa")
    try:
        return generate(model, input_ids, DynamicCache(config=model.config), **kwargs)
    finally:
        model.set_attn_implementation("oscar")


# ------------------------------------------------------------------- "none" is DynamicCache
def test_none_greedy_is_token_identical(tiny):
    ids = prompts([30])[0][None]
    expected = reference(tiny, ids)
    assert torch.equal(generate(tiny, ids, OscarCache(tiny, "none")), expected)


def test_none_seeded_sampling_is_token_identical(tiny):
    ids = prompts([20])[0][None]
    torch.manual_seed(7)
    expected = reference(tiny, ids, do_sample=True, top_k=20, temperature=1.3)
    torch.manual_seed(7)
    got = generate(tiny, ids, OscarCache(tiny, "none"), do_sample=True, top_k=20, temperature=1.3)
    assert torch.equal(got, expected)


def test_none_left_padded_batch_is_token_identical(tiny):
    ids, mask = left_pad(prompts([9, 17, 30]))
    expected = reference(tiny, ids, attention_mask=mask)
    assert torch.equal(generate(tiny, ids, OscarCache(tiny, "none"), attention_mask=mask), expected)


def test_none_chunked_prefill_is_token_identical(tiny):
    ids = prompts([37])[0][None]
    expected = reference(tiny, ids, prefill_chunk_size=8)
    assert torch.equal(generate(tiny, ids, OscarCache(tiny, "none"), prefill_chunk_size=8), expected)


def test_none_beam_search_with_several_returned_sequences_is_token_identical(tiny):
    ids = prompts([15])[0][None]
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=12)
    expected = reference(tiny, ids, **kwargs)
    assert torch.equal(generate(tiny, ids, OscarCache(tiny, "none"), **kwargs), expected)


# ----------------------------------------------------------------- quantized methods in generate
@pytest.mark.parametrize(
    "method",
    [
        "naive-int2",
        "quarot-int2",
        "int4",
        pytest.param(
            OscarConfig(
                "k3v2", TensorQuantConfig(3, clip_ratio=0.96), TensorQuantConfig(2, clip_ratio=0.92), "hadamard"
            ),
            id="k3v2",
        ),
    ],
)
def test_quantized_methods_run_every_generate_feature(tiny, method):
    ids, mask = left_pad(prompts([9, 17, 30]))
    for kwargs in (
        dict(attention_mask=mask),
        dict(attention_mask=mask, prefill_chunk_size=8),
        dict(attention_mask=mask, num_beams=2, num_return_sequences=2, max_new_tokens=10),
        dict(attention_mask=mask, do_sample=True, top_p=0.9),
    ):
        cache = OscarCache(tiny, method, **SMALL)
        out = generate(tiny, ids, cache, **kwargs)
        assert out.shape[1] == ids.shape[1] + kwargs.get("max_new_tokens", 24)
        assert cache.layers[0].history_length > 0


def test_prefill_attends_to_its_own_unquantized_keys_and_values(tiny):
    ids = prompts([40])[0][None]
    expected = forward(tiny, ids, DynamicCache(config=tiny.config)).logits
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    got = forward(tiny, ids, cache).logits
    torch.testing.assert_close(got, expected)
    layer = cache.layers[0]
    assert (layer.sink_keys.length, layer.history_length, layer.recent_keys.length) == (4, 28, 8)


def test_rotated_storage_matches_unrotated_attention(tiny):
    """Attention in the rotated basis (q·R_K, o·R_V^T) equals attention in the model's basis."""
    ids = prompts([40])[0][None]
    expected = forward(tiny, ids, DynamicCache(config=tiny.config)).logits
    got = forward(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL)).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_every_token_is_quantized_exactly_once(tiny, monkeypatch):
    import oscar_hf.core.quantize_jobs as jobs_module

    rows = []
    real_quantize = jobs_module.quantize_pack_into

    def counting(sources, *args, **kwargs):
        rows.extend(source.shape[2] for source in sources)
        return real_quantize(sources, *args, **kwargs)

    monkeypatch.setattr(jobs_module, "quantize_pack_into", counting)
    cache = OscarCache(tiny, "quarot-int2", **SMALL)
    generate(tiny, prompts([30])[0][None], cache, prefill_chunk_size=7)
    quantized = sum(layer.history_length for layer in cache.layers)
    assert sum(rows) == 2 * quantized  # K and V of each quantized token, once each


def test_left_padding_keeps_each_rows_first_real_tokens_in_the_sink(tiny):
    rows = prompts([9, 17, 30])
    ids, mask = left_pad(rows)
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    out = generate(tiny, ids, cache, attention_mask=mask, max_new_tokens=6)
    layer = cache.layers[0]
    assert layer.sink_end == (30 - 9) + SMALL["sink"]
    assert layer.sink_keys.length == layer.sink_end
    # the row with the most padding sees exactly the layout of its unpadded run
    alone = OscarCache(tiny, "naive-int2", **SMALL)
    expected = generate(tiny, rows[0][None], alone, max_new_tokens=6)
    assert torch.equal(out[0, ids.shape[1] - 9 :], expected[0])


def test_left_padding_longer_than_a_prefill_chunk(tiny):
    ids, mask = left_pad(prompts([5, 30]))
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    generate(tiny, ids, cache, attention_mask=mask, prefill_chunk_size=4, max_new_tokens=4)
    assert cache.layers[0].sink_end == 25 + SMALL["sink"]


def test_beam_reorder_moves_packed_history(tiny):
    cache = OscarCache(tiny, "quarot-int2", **SMALL)
    forward(tiny, torch.stack(prompts([30, 30, 30])), cache)
    layer = cache.layers[1]
    empty = torch.empty(3, 2, 0, 16)
    before = layer.dense_rotated(empty, empty)
    order = torch.tensor([2, 0, 0])
    cache.reorder_cache(order)
    after = layer.dense_rotated(empty, empty)
    for b, a in zip(before, after):
        assert torch.equal(a, b[order])


def test_batch_select_and_repeat_interleave(tiny):
    cache = OscarCache(tiny, "quarot-int2", **SMALL)
    forward(tiny, torch.stack(prompts([30, 30])), cache)
    layer = cache.layers[0]
    empty = torch.empty(2, 2, 0, 16)
    keys, _ = layer.dense_rotated(empty, empty)
    cache.batch_repeat_interleave(3)
    repeated, _ = layer.dense_rotated(empty.repeat(3, 1, 1, 1), empty.repeat(3, 1, 1, 1))
    assert torch.equal(repeated, keys.repeat_interleave(3, dim=0))
    cache.batch_select_indices(torch.tensor([5]))
    selected, _ = layer.dense_rotated(empty[:1], empty[:1])
    assert torch.equal(selected, keys[1:2])


def test_crop_removes_the_newest_tokens_from_the_window_then_the_history(tiny):
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    forward(tiny, prompts([30])[0][None], cache)
    layer, empty = cache.layers[0], torch.empty(1, 2, 0, 16)
    before, _ = layer.dense_rotated(empty, empty)
    cache.crop(-3)
    assert cache.get_seq_length() == 27
    cache.crop(-10)  # the 5 rows left in the window and the last 5 of the history
    assert cache.get_seq_length() == 17 and layer.recent_keys.length == 0
    after, _ = layer.dense_rotated(empty, empty)
    assert torch.equal(after, before[:, :, :17])
    with pytest.raises(ValueError, match="cannot crop 18"):
        cache.crop(-18)
    none = OscarCache(tiny, "none")
    forward(tiny, prompts([30])[0][None], none)
    none.crop(-12)
    assert none.get_seq_length() == 18


def test_reset_empties_the_cache(tiny):
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    forward(tiny, prompts([30])[0][None], cache)
    cache.reset()
    assert cache.get_seq_length() == 0
    out = forward(tiny, prompts([12])[0][None], cache).logits
    assert out.shape[1] == 12 and cache.get_seq_length() == 12


def test_offloading_is_refused_clearly(tiny):
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    with pytest.raises(NotImplementedError, match="offloading"):
        cache.layers[0].offload()


def test_mask_sizes_and_length(tiny):
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    assert cache.get_seq_length() == 0 and cache.get_mask_sizes(5, 0) == (5, 0)
    forward(tiny, prompts([30])[0][None], cache)
    assert cache.get_seq_length() == 30 and cache.get_mask_sizes(1, 0) == (31, 0)


def test_prefix_reuse_by_deep_copy(tiny):
    prefix, (a, b) = prompts([30])[0][None], prompts([5, 5], seed=1)
    prefilled = OscarCache(tiny, "quarot-int2", **SMALL)
    forward(tiny, prefix, prefilled)
    runs = []
    for suffix in (a, b, a):
        cache = copy.deepcopy(prefilled)
        runs.append(generate(tiny, torch.cat([prefix, suffix[None]], dim=1), cache, max_new_tokens=8))
    assert prefilled.get_seq_length() == 30
    assert torch.equal(runs[0], runs[2]) and not torch.equal(runs[0], runs[1])
    # the copies follow the model's attention setting, they do not snapshot it
    assert cache.text_config is tiny.config


def test_prefix_reuse_and_multi_turn_match_a_fresh_run_with_none(tiny):
    turn1 = prompts([20])[0][None]
    cache = OscarCache(tiny, "none")
    out1 = generate(tiny, turn1, cache, max_new_tokens=6)
    turn2 = torch.cat([out1, prompts([7], seed=3)[0][None]], dim=1)
    out2 = generate(tiny, turn2, cache, max_new_tokens=6)
    assert torch.equal(out2, reference(tiny, turn2, max_new_tokens=6))


def test_multi_turn_continues_the_same_quantized_cache(tiny):
    cache = OscarCache(tiny, "naive-int2", **SMALL)
    out1 = generate(tiny, prompts([20])[0][None], cache, max_new_tokens=6)
    history = cache.layers[0].history_length
    turn2 = torch.cat([out1, prompts([7], seed=3)[0][None]], dim=1)
    out2 = generate(tiny, turn2, cache, max_new_tokens=6)
    assert cache.get_seq_length() == out2.shape[1] - 1
    assert cache.layers[0].history_length > history


def test_window_dynamics_follow_the_reference():
    """Long prompt: recent oscillates in [256, 263]; P=100 first flushes at S=327, demoting positions 64-71."""
    layer = OscarLayer(OscarConfig(), None, None)
    for prompt, first_flush in ((100, 327), (1000, None)):
        layer.reset()
        layer.update(*[torch.randn(1, 1, prompt, 16)] * 2)
        seen = []
        for _ in range(240):
            before = layer.get_seq_length()
            history = layer.history_length
            layer.update(*[torch.randn(1, 1, 1, 16)] * 2)
            if layer.history_length != history:
                seen.append((before, history, layer.history_length))
            if layer.history_length:
                assert 256 <= layer.recent_keys.length <= 263
        if first_flush:
            assert (layer.sink_keys.length, seen[0]) == (64, (first_flush, 0, 8))
        else:
            assert all(after - before == 8 for _, before, after in seen)


def test_other_attention_implementations_still_work_and_log_once(tiny, caplog):
    ids = prompts([30])[0][None]
    oscar = forward(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL))
    tiny.set_attn_implementation("sdpa")
    with caplog.at_level(logging.WARNING, logger="oscar_hf"):
        cache = OscarCache(tiny, "quarot-int2", **SMALL)
        eager = forward(tiny, ids, cache)
        forward(tiny, prompts([3])[0][None], cache)
    messages = [r.message for r in caplog.records if "set_attn_implementation('oscar')" in r.message]
    assert len(messages) <= 1  # once per process
    torch.testing.assert_close(eager.logits, oscar.logits, atol=1e-4, rtol=1e-4)
    assert cache.layers[0].history_length > 0


def test_no_history_sized_dense_tensor_outlives_a_step(tiny):
    import gc

    cache = OscarCache(tiny, "oscar-int2", rotations=RotationSet.hadamard(16, [0, 1]), **SMALL)
    generate(tiny, prompts([200])[0][None], cache, max_new_tokens=5)
    history = cache.layers[0].history_length
    assert history > 150
    gc.collect()
    dense = [
        t
        for t in gc.get_objects()
        if type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.is_floating_point()
        and t.dim() >= 3
        and t.shape[-1] == 16
        and t.shape[-2] >= history
    ]
    assert dense == []


def test_sliding_window_layers_stay_bf16_and_work():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    model = Gemma3ForCausalLM(config).eval()
    ids = prompts([40])[0][None]
    model.set_attn_implementation("sdpa")
    expected = generate(model, ids, DynamicCache(config=config), max_new_tokens=10)
    model.set_attn_implementation("oscar")
    none = OscarCache(model, "none")
    assert torch.equal(generate(model, ids, none, max_new_tokens=10), expected)
    cache = OscarCache(model, "quarot-int2", **SMALL)
    generate(model, ids, cache, max_new_tokens=10)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer) and isinstance(cache.layers[1], OscarLayer)
    assert cache.layers[1].history_length > 0
    assert {m.kind for m in cache.memory_report().layers} == {"oscar", "dense"}


def test_layer_keys_and_values_as_transformers_layers_expose_them(tiny):
    """``none`` layers give their stored K/V as DynamicLayer does; quantized ones say what to use instead."""
    ids = torch.randint(3, 200, (1, 30))
    dynamic, none = DynamicCache(config=tiny.config), OscarCache(tiny, "none", sink=4, recent=8, block=2)
    forward(tiny, ids, dynamic)
    forward(tiny, ids, none)
    for ours, theirs in zip(none.layers, dynamic.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=0, atol=0)
        torch.testing.assert_close(ours.values, theirs.values, rtol=0, atol=0)
    with pytest.raises(TypeError, match="update"):
        none.layers[0].keys = dynamic.layers[0].keys
    quantized = OscarCache(tiny, "quarot-int2", sink=4, recent=8, block=2)
    assert quantized.layers[0].keys is None  # empty, as an empty DynamicLayer
    forward(tiny, ids, quantized)
    with pytest.raises(TypeError, match="dequantized"):
        quantized.layers[0].keys
    keys, values = quantized.layers[0].dequantized()
    assert keys.shape == values.shape == dynamic.layers[0].keys.shape
    # the sink and the window are stored exactly; the history is within INT2 error
    torch.testing.assert_close(keys[:, :, :4], dynamic.layers[0].keys[:, :, :4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys[:, :, -8:], dynamic.layers[0].keys[:, :, -8:], rtol=1e-5, atol=1e-5)
    assert (keys - dynamic.layers[0].keys).abs().max() < dynamic.layers[0].keys.abs().max()
