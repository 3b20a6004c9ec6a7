"""Folding R_V into v_proj/o_proj: same model function, same OscarCache results, clear refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from oscar_hf import OscarCache, RotationSet
from oscar_hf.calibration.absorption import absorb_value_rotations, absorbed_fingerprint
from oscar_hf.core.cache import ABSORBED_ATTRIBUTE
from tests.conftest import TINY, forward, generate, tiny_model

WINDOWS = dict(sink=4, recent=8, block=2)  # small, so a 40-token prompt fills the INT2 history
ARCHS = ("llama", "llama-bias", "qwen3")


def build(arch: str, seed: int = 0, attn: str = "sdpa"):
    if arch != "llama-bias":
        return tiny_model(arch, seed, attn)
    model = tiny_model("llama", seed, attn, attention_bias=True)
    with torch.no_grad():  # biases start at zero: make them matter
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
    return model


def random_orthogonal(dim: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32)


def random_rotations(layer_ids, head_dim: int = TINY["head_dim"], seed: int = 1) -> RotationSet:
    generator = torch.Generator().manual_seed(seed)
    key = {i: random_orthogonal(head_dim, generator) for i in layer_ids}
    value = {i: random_orthogonal(head_dim, generator) for i in layer_ids}
    return RotationSet(head_dim, key, value, "random")


def all_layers(model) -> list[int]:
    return list(range(model.config.num_hidden_layers))


def absorbed(model, rotations: RotationSet):
    clone = copy.deepcopy(model)
    absorb_value_rotations(clone, rotations)
    return clone


def prompt(length: int = 40, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY["vocab_size"], (1, length), generator=generator)


# ------------------------------------------------------------------------------- the folds
@pytest.mark.parametrize("arch", ARCHS)
def test_value_projection_emits_rotated_values(arch):
    model = build(arch)
    rotations = random_rotations(all_layers(model))
    folded = absorbed(model, rotations)
    x = torch.randn(3, TINY["hidden_size"])
    heads, dim = TINY["num_key_value_heads"], TINY["head_dim"]
    for layer_id, (before, after) in enumerate(zip(model.model.layers, folded.model.layers)):
        with torch.no_grad():
            expected = before.self_attn.v_proj(x).view(3, heads, dim) @ rotations.value[layer_id]
            got = after.self_attn.v_proj(x).view(3, heads, dim)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(after.self_attn.o_proj.weight, before.self_attn.o_proj.weight)


@pytest.mark.parametrize("arch", ARCHS)
def test_absorbed_model_is_unchanged_with_a_plain_cache(arch):
    model = build(arch)
    folded = absorbed(model, random_rotations(all_layers(model)))
    ids = prompt()
    reference = forward(model, ids, DynamicCache(config=model.config)).logits
    got = forward(folded, ids, DynamicCache(config=folded.config)).logits
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


def test_absorption_keeps_the_weight_dtype():
    model = build("llama").to(torch.bfloat16)
    folded = absorbed(model, random_rotations(all_layers(model)))
    attention = folded.model.layers[0].self_attn
    assert attention.v_proj.weight.dtype == attention.o_proj.weight.dtype == torch.bfloat16
    ids = prompt()
    reference = forward(model, ids, DynamicCache(config=model.config)).logits.float()
    got = forward(folded, ids, DynamicCache(config=folded.config)).logits.float()
    torch.testing.assert_close(got, reference, atol=0.1, rtol=0.05)  # one bf16 rounding of the weights


# --------------------------------------------------------------------- with an OscarCache
@pytest.mark.parametrize("attn", ["oscar", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_oscar_cache_matches_the_unabsorbed_model(arch, attn):
    model = build(arch, attn=attn)
    rotations = random_rotations(all_layers(model))
    folded = absorbed(model, rotations)
    ids = prompt()

    cache, folded_cache = (OscarCache(m, "oscar-int2", rotations=rotations, **WINDOWS) for m in (model, folded))
    assert folded_cache.values_prerotated and not cache.values_prerotated
    reference = forward(model, ids, cache).logits
    got = forward(folded, ids, folded_cache).logits
    assert folded_cache.layers[0].history_length > 0  # the INT2 history is in play
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    # Decode: demotions quantize the stored rotated rows; the two models must keep agreeing.
    for _ in range(6):
        step = reference[:, -1:].argmax(-1)
        assert torch.equal(got[:, -1:].argmax(-1), step)
        reference = forward(model, step, cache).logits
        got = forward(folded, step, folded_cache).logits
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_the_unabsorbed_model(arch):
    model = build(arch, attn="oscar")
    rotations = random_rotations(all_layers(model))
    folded = absorbed(model, rotations)
    ids = prompt()
    expected = generate(model, ids, OscarCache(model, "oscar-int2", rotations=rotations, **WINDOWS), max_new_tokens=16)
    got = generate(folded, ids, OscarCache(folded, "oscar-int2", rotations=rotations, **WINDOWS), max_new_tokens=16)
    assert torch.equal(got, expected)


def test_same_value_rotations_with_other_key_rotations_are_accepted():
    model = build("llama")
    rotations = random_rotations(all_layers(model))
    folded = absorbed(model, rotations)
    other_keys = RotationSet(rotations.head_dim, random_rotations(all_layers(model), seed=9).key, rotations.value)
    OscarCache(folded, "oscar-int2", rotations=other_keys, **WINDOWS)


# --------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("method", ["none", "quarot-int2", "naive-int2"])
def test_absorbed_model_refuses_uncalibrated_methods(method):
    model = build("llama")
    rotations = random_rotations(all_layers(model))
    folded = absorbed(model, rotations)
    with pytest.raises(ValueError, match="folded"):
        OscarCache(folded, method, rotations=rotations)


def test_absorbed_model_refuses_other_or_missing_rotations():
    model = build("qwen3")
    folded = absorbed(model, random_rotations(all_layers(model)))
    with pytest.raises(ValueError, match="folded"):
        OscarCache(folded, "oscar-int2", rotations=random_rotations(all_layers(model), seed=5))
    with pytest.raises(ValueError, match="folded"):
        OscarCache(folded, "oscar-int2")


def test_absorbing_twice_is_refused():
    model = build("llama")
    rotations = random_rotations(all_layers(model))
    absorb_value_rotations(model, rotations)
    weight = model.model.layers[0].self_attn.v_proj.weight.clone()
    with pytest.raises(ValueError, match="already"):
        absorb_value_rotations(model, rotations)
    assert torch.equal(model.model.layers[0].self_attn.v_proj.weight, weight)


def test_rotations_must_cover_every_full_attention_layer():
    model = build("llama")
    before = copy.deepcopy(model.state_dict())
    partial = random_rotations([0])
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        absorb_value_rotations(model, partial)
    with pytest.raises(ValueError, match="extra \\[5\\]"):
        absorb_value_rotations(model, random_rotations([0, 1, 5]))
    with pytest.raises(ValueError, match="head_dim"):
        absorb_value_rotations(model, random_rotations([0, 1], head_dim=8))
    # a refusal leaves the model untouched and unmarked
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert absorbed_fingerprint(model) is None


def test_sliding_window_layers_are_left_alone():
    torch.manual_seed(0)
    config = Qwen3Config(
        **TINY,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"],
    )
    model = Qwen3ForCausalLM(config).eval()
    model.set_attn_implementation("oscar")
    with pytest.raises(ValueError, match="extra \\["):
        absorb_value_rotations(copy.deepcopy(model), random_rotations([0, 1]))
    rotations = random_rotations([0])
    folded = absorbed(model, rotations)
    sliding_before, sliding_after = model.model.layers[1].self_attn, folded.model.layers[1].self_attn
    assert torch.equal(sliding_after.v_proj.weight, sliding_before.v_proj.weight)
    assert torch.equal(sliding_after.o_proj.weight, sliding_before.o_proj.weight)
    ids = prompt(24)
    reference = forward(model, ids, OscarCache(model, "oscar-int2", rotations=rotations, **WINDOWS)).logits
    got = forward(folded, ids, OscarCache(folded, "oscar-int2", rotations=rotations, **WINDOWS)).logits
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)


def test_fused_qkv_is_refused():
    torch.manual_seed(0)
    config = Phi3Config(**{k: v for k, v in TINY.items() if k != "head_dim"})
    model = Phi3ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="fused projection \\(qkv_proj\\)"):
        absorb_value_rotations(model, random_rotations(all_layers(model)))
    assert absorbed_fingerprint(model) is None


def test_wrapped_or_quantized_projections_are_refused():
    model = build("llama")
    rotations = random_rotations(all_layers(model))
    attention = model.model.layers[1].self_attn
    original = attention.v_proj
    attention.v_proj = nn.Sequential(original)  # stands for an adapter wrapper
    with pytest.raises(ValueError, match="plain nn.Linear"):
        absorb_value_rotations(model, rotations)
    attention.v_proj = original
    original.weight_scale = torch.ones(1)  # what FP8 linears carry
    with pytest.raises(ValueError, match="plain nn.Linear"):
        absorb_value_rotations(model, rotations)
    del original.weight_scale
    del attention.v_proj
    with pytest.raises(ValueError, match="no v_proj"):
        absorb_value_rotations(model, rotations)
    assert absorbed_fingerprint(model) is None


# ---------------------------------------------------------------------------- persistence
@pytest.mark.parametrize("arch", ["llama-bias", "qwen3"])
def test_fingerprint_survives_save_and_load(arch, tmp_path):
    model = build(arch)
    rotations = random_rotations(all_layers(model))
    folded = absorbed(model, rotations)
    assert absorbed_fingerprint(folded) == rotations.value_fingerprint()
    assert getattr(folded.config.get_text_config(decoder=True), ABSORBED_ATTRIBUTE) == rotations.value_fingerprint()
    assert absorbed_fingerprint(model) is None

    folded.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert absorbed_fingerprint(loaded) == rotations.value_fingerprint()
    ids = prompt()
    torch.testing.assert_close(
        forward(loaded, ids, DynamicCache(config=loaded.config)).logits,
        forward(folded, ids, DynamicCache(config=folded.config)).logits,
    )
    assert OscarCache(loaded, "oscar-int2", rotations=rotations, **WINDOWS).values_prerotated
    with pytest.raises(ValueError, match="folded"):
        OscarCache(loaded, "quarot-int2")
    with pytest.raises(ValueError, match="already"):
        absorb_value_rotations(loaded, rotations)
