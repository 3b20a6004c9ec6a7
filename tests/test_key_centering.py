"""Key centering: a layer with a key mean stores ``(k - mu) @ R_K``; softmax ignores the common shift of
each query's scores, so attention is unchanged before quantization, and the quantizer's range no
longer spans the mean."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oscar_hf import METHODS, OscarCache
from oscar_hf.calibration.recipe import Recipe
from oscar_hf.core.layer import OscarLayer
from oscar_hf.rotations.files import load_ours, save_rotations
from oscar_hf.rotations.rotation_set import RotationSet
from tests.conftest import TINY, forward, tiny_model

HEAD_DIM, KV_HEADS, LAYERS = TINY["head_dim"], TINY["num_key_value_heads"], [0, 1]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_set(seed: int, centered: bool, per_head_mean: bool = True) -> RotationSet:
    generator = torch.Generator().manual_seed(seed)

    def orthogonal() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=generator, dtype=torch.float64))[0].float()

    shape = (KV_HEADS, HEAD_DIM) if per_head_mean else (HEAD_DIM,)
    means = {i: torch.randn(shape, generator=generator) * 3 for i in LAYERS} if centered else {}
    return RotationSet(HEAD_DIM, {i: orthogonal() for i in LAYERS}, {i: orthogonal() for i in LAYERS}, key_mean=means)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_head_mean", [True, False])
def test_centering_leaves_attention_unchanged_before_quantization(device, per_head_mean):
    """Every token in the windows (nothing quantized): two prefill chunks and decode steps give the same
    logits with and without a key mean, and the stored keys read back as the model's keys (the torch
    path here; tests/test_kernels.py runs the same through the kernels)."""
    assert_centering_invariant(device, per_head_mean)


def assert_centering_invariant(device: str, per_head_mean: bool) -> None:
    model = tiny_model("llama").to(device)
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0)).to(device)
    logits, stored = {}, {}
    for centered in (False, True):
        rotations = random_set(1, centered, per_head_mean)
        cache = OscarCache(model, "oscar-int2", rotations=rotations, sink=4, recent=64)
        out = [forward(model, ids[:, :20], cache).logits, forward(model, ids[:, 20:30], cache).logits]
        out += [forward(model, ids[:, t : t + 1], cache).logits for t in range(30, 40)]
        assert all(layer.history_length == 0 for layer in cache.layers)
        logits[centered] = torch.cat(out, dim=1)
        stored[centered] = cache.layers[0].dequantized()[0]
    torch.testing.assert_close(logits[True], logits[False], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(stored[True], stored[False], atol=2e-5, rtol=2e-5)


def test_centering_shrinks_the_key_error_of_an_offset():
    """Keys with a large per-channel offset: quantized centered on it, they come back several times closer."""
    generator = torch.Generator().manual_seed(2)
    offset = torch.randn(KV_HEADS, HEAD_DIM, generator=generator) * 8
    keys = torch.randn(1, KV_HEADS, 300, HEAD_DIM, generator=generator) + offset[None, :, None, :]
    values = torch.randn(1, KV_HEADS, 300, HEAD_DIM, generator=generator)
    config = METHODS["oscar-int2"].with_overrides(sink=0, recent=8)
    errors = {}
    for mean in (None, offset):
        layer = OscarLayer(config, None, None, key_mean=mean)
        layer.update(keys, values)
        errors[mean is not None] = (layer.dequantized()[0] - keys).norm() / keys.norm()
    assert errors[True] * 3 < errors[False], errors


def test_a_set_keeps_its_key_means(tmp_path):
    rotations = random_set(3, True)
    loaded = load_ours(save_rotations(rotations, tmp_path / "set"))
    assert all(torch.equal(loaded.key_mean[i], rotations.key_mean[i]) for i in LAYERS)
    assert loaded.kv_heads == KV_HEADS and loaded.select_kv_heads(1, 2).key_mean[0].shape == (1, HEAD_DIM)
    # per-head means with shared rotations: still a shared set, which the paper's method takes
    assert not loaded.per_head and load_ours(tmp_path / "set", per_head=False).kv_heads == KV_HEADS
    OscarCache(tiny_model("llama"), "oscar-int2-paper", rotations=loaded)
    with pytest.raises(ValueError, match="key_mean of layer 0"):
        dataclasses.replace(rotations, key_mean={0: torch.zeros(HEAD_DIM + 1)})
    with pytest.raises(ValueError, match="one KV head count"):
        dataclasses.replace(rotations, key_mean={0: torch.zeros(3, HEAD_DIM), 1: torch.zeros(2, HEAD_DIM)})
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="KV head"):
        OscarCache(
            model, "oscar-int2", rotations=dataclasses.replace(rotations, key_mean={0: torch.zeros(4, HEAD_DIM)})
        )


def test_the_recipe_refuses_what_does_not_center():
    for options in (dict(refine=True), dict(from_rotations="somewhere", allocate_bits=1)):
        with pytest.raises(ValueError, match="center"):
            Recipe(center_keys=True, **options)


def test_the_recipe_centers_keys_unless_told_or_it_cannot():
    assert Recipe().center_keys and Recipe(allocate_bits=6).to_dict()["center_keys"] is True
    assert not Recipe(center_keys=False).center_keys
    for options in (dict(clip_search=False), dict(refine=True), dict(from_rotations="somewhere", allocate_bits=1)):
        assert Recipe(**options).center_keys is False, options
