"""Per-KV-head rotations ``[H_kv, D, D]`` in the cache: every place that rotates uses head h's R.

Heads that all hold one R must give the shared R's results; distinct heads are checked against a
direct torch computation (KV head h's rows times R[h], query head i times R[i // g]).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import oscar_hf
from oscar_hf import OscarCache, RotationSet
from oscar_hf.calibration.absorption import absorb_value_rotations
from oscar_hf.calibration.teacher_forcing import teacher_forced_logits
from oscar_hf.config import OscarConfig
from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.quantize_jobs import roundtrip_rows
from tests.conftest import TINY, forward, generate, tiny_model

SMALL = dict(sink=4, recent=8, block=2)
HEAD_DIM, KV_HEADS, LAYERS = TINY["head_dim"], TINY["num_key_value_heads"], [0, 1]
GROUP = TINY["num_attention_heads"] // KV_HEADS


def orthogonal(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def per_head(seed: int = 0) -> RotationSet:
    """Distinct random R_K and R_V for every KV head of every layer."""

    def stack(offset: int) -> torch.Tensor:
        return torch.stack([orthogonal(seed + offset + h) for h in range(KV_HEADS)])

    return RotationSet(HEAD_DIM, {i: stack(10 * i) for i in LAYERS}, {i: stack(100 + 10 * i) for i in LAYERS}, "heads")


def shared(seed: int = 0) -> RotationSet:
    return RotationSet(
        HEAD_DIM, {i: orthogonal(seed + i) for i in LAYERS}, {i: orthogonal(seed + 50 + i) for i in LAYERS}
    )


def ids(batch: int = 2, length: int = 40, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def chunked_then_greedy(model, cache, prompt: torch.Tensor, steps: int = 12) -> torch.Tensor:
    """Logits of a prefill in two chunks (the second attends over rotated tiers) and greedy decode steps."""
    half = prompt.shape[1] // 2
    logits = [forward(model, prompt[:, :half], cache).logits, forward(model, prompt[:, half:], cache).logits]
    for _ in range(steps):
        logits.append(forward(model, logits[-1][:, -1:].argmax(-1), cache).logits)
    return torch.cat(logits, dim=1)


# ------------------------------------------------------------------------ equal heads = shared
def test_equal_heads_give_the_shared_rotations_results(tiny):
    """Chunked prefill, eager decode steps (rotate kernel's torch path) and teacher forcing."""
    rotations = shared()
    expanded = rotations.as_per_head(KV_HEADS)
    want = chunked_then_greedy(tiny, OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL), ids())
    got = chunked_then_greedy(tiny, OscarCache(tiny, "oscar-int2", rotations=expanded, **SMALL), ids())
    # a decode step's per-head product is a batched one-row GEMM on CPU, which float32 BLAS may round
    # differently in the last bit from the shared R's single GEMM over all rows
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    prompt = ids(1, 48)
    tf_want = teacher_forced_logits(tiny, prompt, OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL))
    tf_got = teacher_forced_logits(tiny, prompt, OscarCache(tiny, "oscar-int2", rotations=expanded, **SMALL))
    assert torch.equal(tf_got, tf_want)


def test_equal_heads_give_the_shared_tokens_through_generate_and_static_decoding(tiny):
    rotations, prompt = shared(), ids(2, 30)
    expanded = rotations.as_per_head(KV_HEADS)
    options = dict(max_new_tokens=30, output_scores=True, return_dict_in_generate=True)
    runs = {}
    for name, r in (("shared", rotations), ("heads", expanded)):
        runs[name, "plain"] = generate(tiny, prompt, OscarCache(tiny, "oscar-int2", rotations=r, **SMALL), **options)
        frozen = OscarCache(tiny, "oscar-int2", rotations=r, decode_graphs=True, **SMALL)
        runs[name, "frozen"] = generate(tiny, prompt, frozen, **options)
        assert frozen.static is not None  # plain generate froze it (on CPU: the static steps without graphs)
    for kind in ("plain", "frozen"):
        assert torch.equal(runs["heads", kind].sequences, runs["shared", kind].sequences)
        torch.testing.assert_close(
            torch.stack(runs["heads", kind].scores), torch.stack(runs["shared", kind].scores), atol=1e-5, rtol=1e-5
        )


# ------------------------------------------------------------------ distinct heads vs torch
def rotate_by_head(states: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` states, head h times ``rotation[h // (H / H_kv)]``, one head at a time."""
    group = states.shape[1] // rotation.shape[0]
    return torch.stack([states[:, h] @ rotation[h // group] for h in range(states.shape[1])], dim=1)


def test_stored_rows_are_each_kv_heads_rows_times_its_own_rotation(tiny):
    rotations, prompt = per_head(), ids()
    dynamic = DynamicCache(config=tiny.config)
    forward(tiny, prompt, dynamic)
    cache = OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL)
    forward(tiny, prompt, cache)
    for layer_id in LAYERS:
        layer, stock = cache.layers[layer_id], dynamic.layers[layer_id]
        keys = rotate_by_head(stock.keys, rotations.key[layer_id])
        values = rotate_by_head(stock.values, rotations.value[layer_id])
        sink, history = SMALL["sink"], layer.history_length
        torch.testing.assert_close(layer.sink_keys.view(), keys[:, :, :sink], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(layer.recent_values.view(), values[:, :, sink + history :], atol=1e-6, rtol=1e-5)
        middle = slice(sink, sink + history)
        torch.testing.assert_close(
            layer.history_keys.dequantize(torch.float32),
            roundtrip_rows(keys[:, :, middle], layer.config.key, layer.config.metadata_dtype),
            atol=1e-5,
            rtol=1e-5,
        )
        torch.testing.assert_close(
            layer.history_values.dequantize(torch.float32),
            roundtrip_rows(values[:, :, middle], layer.config.value, layer.config.metadata_dtype),
            atol=1e-5,
            rtol=1e-5,
        )


def test_unquantized_attention_in_each_heads_basis_is_the_models_attention(tiny):
    """With nothing quantized, q·R_K[i // g] against K·R_K[h] and o·R_V[h]^T give the model's logits:
    a query head rotated by another head's R_K, or an output by another R_V, would change them."""
    prompt = ids()
    want = chunked_then_greedy(tiny, DynamicCache(config=tiny.config), prompt)
    wide = dict(sink=4, recent=128, block=2)
    got = chunked_then_greedy(tiny, OscarCache(tiny, "oscar-int2", rotations=per_head(), **wide), prompt)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    one_pass = teacher_forced_logits(tiny, prompt[:1], OscarCache(tiny, "oscar-int2", rotations=per_head(), **wide))
    torch.testing.assert_close(
        one_pass, forward(tiny, prompt[:1], DynamicCache(config=tiny.config)).logits, atol=1e-4, rtol=1e-4
    )


def test_teacher_forcing_matches_decoding_with_per_head_rotations(tiny):
    prompt = ids(1, 48)
    cache = OscarCache(tiny, "oscar-int2", rotations=per_head(), **SMALL)
    stepwise = torch.cat([forward(tiny, prompt[:, i : i + 1], cache).logits for i in range(prompt.shape[1])], dim=1)
    one_pass = teacher_forced_logits(tiny, prompt, OscarCache(tiny, "oscar-int2", rotations=per_head(), **SMALL))
    torch.testing.assert_close(one_pass, stepwise, atol=2e-4, rtol=2e-4)
    other = teacher_forced_logits(tiny, prompt, OscarCache(tiny, "oscar-int2", rotations=per_head(7), **SMALL))
    assert (other - one_pass).abs().max() > 1e-3  # the rotations matter once keys are quantized


def test_static_decoding_keeps_the_eager_tokens_with_per_head_rotations(tiny):
    prompt, rotations = ids(2, 30), per_head()
    want = generate(tiny, prompt, OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL), max_new_tokens=30)
    cache = OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL)
    with torch.no_grad():
        static = oscar_hf.generate(
            tiny,
            prompt,
            capture=False,
            do_sample=False,
            max_new_tokens=30,
            min_new_tokens=30,
            **{cache_keyword(tiny): cache},
        )
    frozen = OscarCache(tiny, "oscar-int2", rotations=rotations, decode_graphs=True, **SMALL)
    assert torch.equal(static, want)
    assert torch.equal(generate(tiny, prompt, frozen, max_new_tokens=30), want) and frozen.static is not None


# --------------------------------------------------------------------------------- absorption
def test_absorbing_per_head_value_rotations_keeps_the_models_outputs():
    model = tiny_model("qwen3", attn="oscar")
    rotations, prompt = per_head(), ids()
    folded = copy.deepcopy(model)
    absorb_value_rotations(folded, rotations)
    plain = forward(model, prompt, DynamicCache(config=model.config)).logits
    torch.testing.assert_close(
        forward(folded, prompt, DynamicCache(config=folded.config)).logits, plain, atol=1e-4, rtol=1e-4
    )
    heads = TINY["num_attention_heads"]
    for layer_id in LAYERS:  # KV head h's V rows get R_V[h]; query head i's o_proj columns R_V[i // g]
        before, after = model.model.layers[layer_id].self_attn, folded.model.layers[layer_id].self_attn
        x = torch.randn(3, TINY["hidden_size"])
        with torch.no_grad():
            emitted = after.v_proj(x).view(3, KV_HEADS, HEAD_DIM)
            expected = before.v_proj(x).view(3, KV_HEADS, HEAD_DIM)
        expected = torch.stack([expected[:, h] @ rotations.value[layer_id][h] for h in range(KV_HEADS)], dim=1)
        torch.testing.assert_close(emitted, expected, atol=1e-5, rtol=1e-5)
        columns = after.o_proj.weight.view(-1, heads, HEAD_DIM)
        original = before.o_proj.weight.view(-1, heads, HEAD_DIM)
        for i in range(heads):
            torch.testing.assert_close(columns[:, i], original[:, i] @ rotations.value[layer_id][i // GROUP])
    want = chunked_then_greedy(model, OscarCache(model, "oscar-int2", rotations=rotations, **SMALL), prompt)
    got = chunked_then_greedy(folded, OscarCache(folded, "oscar-int2", rotations=rotations, **SMALL), prompt)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ------------------------------------------------------------------------- shapes and slices
def test_head_counts_are_checked(tiny):
    with pytest.raises(ValueError, match="3 KV heads but the model has 2"):
        OscarCache(tiny, "oscar-int2", rotations=shared().as_per_head(3))
    layer = OscarLayer(OscarConfig(**SMALL), per_head().key[0], None)  # e.g. a TP rank handed every head
    with pytest.raises(ValueError, match="hold 2 KV heads but this layer receives 1.*select_kv_heads"):
        layer.update(torch.randn(1, 1, 3, HEAD_DIM), torch.randn(1, 1, 3, HEAD_DIM))


def test_a_slice_of_heads_serves_a_layer_of_those_heads():
    """What a tensor-parallel rank holding KV head 1 computes: its rows times R[1], its queries too."""
    rotations = per_head()
    layer = OscarLayer(OscarConfig(**SMALL), *rotations.select_kv_heads(1, 2).for_layer(0))
    keys, query = torch.randn(2, 1, 5, HEAD_DIM), torch.randn(2, GROUP, 5, HEAD_DIM)
    torch.testing.assert_close(layer.rotate_keys(keys), keys @ rotations.key[0][1])
    torch.testing.assert_close(layer.rotate_keys(query), query @ rotations.key[0][1])
