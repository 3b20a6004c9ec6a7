"""Memory accounting: the paper's BPE formula and a real cache agree."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from oscar_hf import METHODS, OscarCache, RotationSet, bits_per_element
from oscar_hf.core.memory import mean_bits_per_element
from tests.conftest import TINY, forward, tiny_model


def test_paper_bits_per_element():
    assert bits_per_element(METHODS["oscar-int2"], 131072, 128) == pytest.approx(2.2836, abs=1e-4)
    assert bits_per_element(METHODS["oscar-int2"], 32768, 128) == pytest.approx(2.384, abs=1e-3)
    assert bits_per_element(METHODS["none"], 4096, 128) == 16
    assert bits_per_element(METHODS["oscar-k4v2"], 131072, 128) == pytest.approx(3.28, abs=1e-2)


def test_a_real_128k_cache_reports_the_paper_bpe():
    """One layer, one KV head, head_dim 128, BF16, 131072 tokens prefilled in chunks: BPE 2.28, ~7x smaller."""
    config = LlamaConfig(
        **{
            **TINY,
            "num_hidden_layers": 1,
            "num_key_value_heads": 1,
            "num_attention_heads": 1,
            "head_dim": 128,
            "hidden_size": 128,
        }
    )
    cache = OscarCache(config, "quarot-int2")
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        chunk = torch.randn(1, 1, 8192, 128, generator=g).bfloat16()
        layer.update(chunk, chunk)
    report = cache.memory_report()
    summary = report.summary()
    assert summary["tokens"] == 131072
    assert (layer.sink_keys.length, layer.recent_keys.length) == (64, 256)
    assert summary["bits_per_element"] == pytest.approx(bits_per_element(cache.oscar_config, 131072, 128), abs=1e-4)
    assert summary["bits_per_element"] == pytest.approx(2.2836, abs=1e-4)
    assert summary["compression_vs_bf16"] > 7.0
    # 72 bytes per token per head for K+V history: 2 x (32 code bytes + 2 x 2 metadata bytes)
    assert summary["code_bytes"] + summary["metadata_bytes"] == (131072 - 320) * 72
    assert summary["bf16_dynamic_cache_bytes"] == 131072 * 128 * 2 * 2


def test_a_k3v2_history_takes_three_bits_per_element_at_head_dim_64():
    """K at 3 + 32/64 bits, V at 2 + 32/64: 3.0 bits per history element, and a real cache stores that."""
    assert bits_per_element(METHODS["oscar-k3v2"].with_overrides(sink=0, recent=0), 4096, 64) == 3.0
    config = LlamaConfig(
        **{
            **TINY,
            "num_hidden_layers": 1,
            "num_key_value_heads": 1,
            "num_attention_heads": 1,
            "head_dim": 64,
            "hidden_size": 64,
        }
    )
    cache = OscarCache(config, METHODS["oscar-k3v2"].with_overrides(rotation="hadamard"))
    chunk = torch.randn(1, 1, 1000, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    cache.layers[0].update(chunk, chunk)
    summary, history = cache.memory_report().summary(), cache.layers[0].history_length
    assert history == 1000 - 320
    # per token: K 24 code bytes (16 for the low 2-bit plane, 8 for the high bit plane), V 16; 2 x 4 metadata bytes
    assert (summary["code_bytes"], summary["metadata_bytes"]) == (history * (24 + 16), history * 8)
    assert summary["bits_per_element"] == pytest.approx(bits_per_element(cache.oscar_config, 1000, 64), abs=1e-4)


def test_report_per_layer_and_markdown(tiny):
    cache = OscarCache(tiny, "naive-int2", sink=4, recent=8, block=2)
    forward(tiny, torch.randint(3, 200, (2, 40)), cache)
    report = cache.memory_report()
    assert [m.layer for m in report.layers] == [0, 1]
    m = report.layers[0]
    assert (m.sink_tokens, m.history_tokens, m.recent_tokens) == (4, 28, 8)
    # fp32 tiny model: windows take 4 bytes per element, the history 2 bits + 2 x 16 bits per 16 channels
    assert m.sink_bytes == 2 * 2 * 2 * 4 * 16 * 4
    assert m.code_bytes == 2 * 2 * 2 * 28 * 16 // 4 and m.metadata_bytes == 2 * 2 * 2 * 28 * 2 * 2
    assert "| **all** |" in report.to_markdown() and "bits per element" in report.to_markdown()
    assert report.to_dict()["layers"][0]["total_bytes"] == m.total_bytes


def test_buffer_growth_is_geometric_but_its_unused_tail_is_bounded():
    from oscar_hf.core.storage import MAX_SLACK_ROWS, RowBuffer

    buffer = RowBuffer(1, 1, (4,), torch.uint8, torch.device("cpu"))
    capacities = []
    for step in range(6000):
        buffer.append(torch.full((1, 1, 20, 4), step % 251, dtype=torch.uint8))
        capacities.append(buffer.data.shape[2])
    regrowths = len(set(capacities))
    assert regrowths < 6000 * 20 / MAX_SLACK_ROWS + 20  # amortised: not one copy per append
    assert buffer.length == 120_000 and buffer.data.shape[2] - buffer.length <= MAX_SLACK_ROWS
    expected = (torch.arange(6000) % 251).to(torch.uint8).repeat_interleave(20)  # regrowths kept every row
    assert torch.equal(buffer.view()[0, 0, :, 0], expected)


def _prefilled_report(model, ids, method="naive-int2"):
    cache = OscarCache(model, method, sink=4, recent=8, block=2)
    forward(model, ids, cache)
    return cache, cache.memory_report()


def test_a_float32_report_in_bf16_is_what_a_bf16_model_stores():
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (2, 40))
    _, fp32 = _prefilled_report(model, ids)
    _, bf16 = _prefilled_report(model.to(torch.bfloat16), ids)
    assert fp32.total_bytes > bf16.total_bytes  # float32 windows
    assert fp32.in_bf16() == bf16 and bf16.in_bf16() == bf16


@pytest.mark.parametrize("method", ["naive-int2", "none"])
def test_projected_bytes_predict_a_longer_prefill(method):
    model = tiny_model("llama").to(torch.bfloat16)
    ids = torch.randint(3, 200, (1, 100))
    cache, short = _prefilled_report(model, ids[:, :40], method)
    _, long = _prefilled_report(model, ids, method)
    for tokens, report in ((40, short), (100, long)):
        assert short.projected_bytes(cache.oscar_config, tokens, 16) == report.total_bytes
    if method == "none":
        assert long.total_bytes == long.bf16_bytes


def test_per_layer_widths_average_their_bits_per_element():
    """K4 in one layer and V1 in two keep oscar-int2's 2.5 history bits at head_dim 64; a real cache stores that."""
    base = METHODS["oscar-int2"].with_overrides(sink=0, recent=0)
    k4v1, v1 = base.for_layer(key_bits=4, value_bits=1), base.for_layer(value_bits=1)
    assert (k4v1.key.bits, k4v1.value.bits, v1.key.bits, v1.value.bits) == (4, 1, 2, 1)
    assert mean_bits_per_element([k4v1, v1], 4096, 64) == bits_per_element(base, 4096, 64) == 2.5
    config = LlamaConfig(
        **{
            **TINY,
            "num_hidden_layers": 2,
            "num_key_value_heads": 1,
            "num_attention_heads": 1,
            "head_dim": 64,
            "hidden_size": 64,
        }
    )
    rotations = RotationSet.hadamard(64, [0, 1])
    rotations.key_bits.update({0: 4})
    rotations.value_bits.update({0: 1, 1: 1})
    cache = OscarCache(config, "oscar-int2", rotations=rotations)
    chunk = torch.randn(1, 1, 1000, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    for layer in cache.layers:
        layer.update(chunk, chunk)
    history = cache.layers[0].history_length
    # per token: layer 0 K 32 + V 8 code bytes, layer 1 K 16 + V 8; 4 metadata bytes each for K and V
    summary = cache.memory_report().summary()
    assert (summary["code_bytes"], summary["metadata_bytes"]) == (history * (40 + 24), history * 16)
    configs = [layer.config for layer in cache.layers]
    assert summary["bits_per_element"] == pytest.approx(mean_bits_per_element(configs, 1000, 64), abs=1e-4)


def test_the_report_in_words_says_what_a_bf16_model_stores_and_why_short_prompts_compress_less():
    """A float32 model on CPU at a short prompt: the windows dominate and are float32; the words say so."""
    config = LlamaConfig(
        **{
            **TINY,
            "num_hidden_layers": 1,
            "num_key_value_heads": 1,
            "num_attention_heads": 1,
            "head_dim": 128,
            "hidden_size": 128,
        }
    )
    cache = OscarCache(config, "quarot-int2")
    chunk = torch.randn(1, 1, 400, 128, generator=torch.Generator().manual_seed(0))
    cache.layers[0].update(chunk, chunk)
    report = cache.memory_report()
    text = str(report)
    bf16 = report.in_bf16()
    assert report.compression < 1 < bf16.compression  # larger than BF16 as stored in float32, smaller in BF16
    assert "with the model's float32 windows" in text and f"{bf16.bits_per_element:.2f} bits/element" in text
    assert f"{bf16.compression:.1f}x smaller than a BF16 DynamicCache" in text
    assert "320 of the 400 tokens are the uncompressed sink and recent window" in text
    assert "history costs 2.25 bits/element" in text and "approaches 7.1x smaller" in text
    dense = OscarCache(config, "none")
    dense.layers[0].update(chunk.bfloat16(), chunk.bfloat16())
    assert str(dense.memory_report()) == "none: 400 tokens, 0.20 MiB: 16.00 bits/element, as a BF16 DynamicCache."
