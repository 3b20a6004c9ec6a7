"""Key feedback: keys quantized channel by channel, each channel's error fed forward with a factor of the
rotated query covariance, so that errors cancel in the scores ``q . k`` (GPTQ's update)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oscar_hf import METHODS, OscarCache
from oscar_hf.calibration.covariances import collect_query_covariances
from oscar_hf.calibration.key_feedback import key_feedback_factors
from oscar_hf.calibration.recipe import Recipe
from oscar_hf.core.layer import OscarLayer
from oscar_hf.quant import dequantize, feedback_factor, quantize
from oscar_hf.rotations.files import load_ours, save_rotations
from oscar_hf.rotations.rotation_set import RotationSet
from tests.conftest import TINY, tiny_model

HEAD_DIM, KV_HEADS, LAYERS = TINY["head_dim"], TINY["num_key_value_heads"], [0, 1]


def query_like_covariance(seed: int, dim: int, heads: int | None = None) -> torch.Tensor:
    """A covariance with a few strong directions, not along the channels, as rotated queries have."""
    generator = torch.Generator().manual_seed(seed)
    samples = torch.randn(heads or 1, 4 * dim, dim, generator=generator) * torch.linspace(5, 0.1, dim)
    samples = samples @ torch.linalg.qr(torch.randn(dim, dim, generator=generator))[0]
    covariance = samples.mT @ samples / (4 * dim)
    return covariance if heads else covariance[0]


def score_error(rows: torch.Tensor, covariance: torch.Tensor, **kwargs) -> float:
    """Mean ``e C e^T`` of the quantization error ``e`` of ``rows``: the squared error a query of
    covariance ``C`` sees in its scores."""
    error = dequantize(quantize(rows, 2, rows.shape[-1], **kwargs), 2, rows.shape[-1], torch.float32) - rows
    return float(torch.einsum("...i,...ij,...j->...", error, covariance, error).mean())


def test_the_factor_is_unit_upper_triangular_and_inverts_the_damped_hessian():
    hessian = query_like_covariance(0, 16).double()
    stored = feedback_factor(hessian, damping=0.01)
    assert stored.is_contiguous() and stored.dtype == torch.float32  # as the kernels read it
    factor = stored.double()
    assert torch.equal(factor.diagonal(), torch.ones(16, dtype=torch.float64)) and not factor.tril(-1).any()
    # U^T U = (H + lambda I)^-1 up to the rows' scaling by the diagonal of U
    damped = hessian + 0.01 * hessian.diagonal().mean() * torch.eye(16, dtype=torch.float64)
    upper = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    torch.testing.assert_close(factor, upper / upper.diagonal()[:, None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip_ratio", [0.0, 0.96])
def test_feedback_cuts_the_score_error(clip_ratio):
    """At 2 bits the error a query sees in its scores falls well below round-to-nearest's."""
    covariance = query_like_covariance(1, 64)
    rows = torch.randn(400, 64, generator=torch.Generator().manual_seed(2))
    plain = score_error(rows, covariance, clip_ratio=clip_ratio)
    fed = score_error(rows, covariance, clip_ratio=clip_ratio, feedback=feedback_factor(covariance))
    assert fed < 0.7 * plain, (fed, plain)


def test_feedback_keeps_the_grid_and_the_identity_factor_rounds_to_nearest():
    """The grid (scale, zero) is the one the rows take without feedback; with the identity factor no error is
    fed forward, so the codes are round-to-nearest on the stored grid."""
    rows = torch.randn(3, 50, 32, generator=torch.Generator().manual_seed(3)) * 2
    plain = quantize(rows, 2, 16, metadata_dtype=torch.float32)
    fed = quantize(rows, 2, 16, metadata_dtype=torch.float32, feedback=torch.eye(32))
    assert torch.equal(fed.scale, plain.scale) and torch.equal(fed.zero, plain.zero)
    assert torch.equal(fed.codes, plain.codes)


def test_per_head_factors_apply_to_their_heads():
    covariances = query_like_covariance(4, 32, heads=3)
    factors = feedback_factor(covariances)
    rows = torch.randn(2, 3, 20, 32, generator=torch.Generator().manual_seed(5))
    together = quantize(rows, 3, 32, feedback=factors)
    for head in range(3):
        alone = quantize(rows[:, head], 3, 32, feedback=factors[head])
        assert torch.equal(together.codes[:, head], alone.codes)


def test_feedback_refuses_1bit_rows_and_wrong_shapes():
    rows = torch.randn(2, 3, 5, 32)
    with pytest.raises(ValueError, match="1-bit rows"):
        quantize(rows, 1, 32, feedback=torch.eye(32))
    with pytest.raises(ValueError, match="does not fit rows"):
        quantize(rows, 2, 32, feedback=torch.eye(32).expand(2, 32, 32))
    with pytest.raises(ValueError, match="does not fit rows"):
        quantize(rows, 2, 32, feedback=torch.eye(16))


def random_set(seed: int, feedback: bool = True) -> RotationSet:
    generator = torch.Generator().manual_seed(seed)

    def orthogonal() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=generator, dtype=torch.float64))[0].float()

    factors = {i: feedback_factor(query_like_covariance(seed + i, HEAD_DIM, KV_HEADS)) for i in LAYERS}
    return RotationSet(
        HEAD_DIM,
        {i: orthogonal() for i in LAYERS},
        {i: orthogonal() for i in LAYERS},
        key_feedback=factors if feedback else {},
    )


def test_a_set_keeps_its_factors_and_refuses_bad_ones(tmp_path):
    rotations = random_set(0)
    loaded = load_ours(save_rotations(rotations, tmp_path / "set"))
    assert all(torch.equal(loaded.key_feedback[i], rotations.key_feedback[i]) for i in LAYERS)
    assert loaded.kv_heads == KV_HEADS
    assert torch.equal(loaded.select_kv_heads(1, 2).key_feedback[0], rotations.key_feedback[0][1:2])
    with pytest.raises(ValueError, match="upper triangular with ones on its diagonal"):
        RotationSet(HEAD_DIM, key_feedback={0: torch.ones(HEAD_DIM, HEAD_DIM)})
    with pytest.raises(ValueError, match="expected"):
        RotationSet(HEAD_DIM, key_feedback={0: torch.eye(HEAD_DIM + 1)})


def test_the_cache_stores_keys_with_their_layers_factor():
    """A layer's history holds exactly what the quantizer makes of its rotated keys with the layer's factor
    (and of its values without one); the paper's method, which rounds to nearest, takes no factors."""
    rotations = random_set(7)
    config = METHODS["oscar-int2"].with_overrides(sink=0, recent=8)
    rotation, factor = rotations.key[1], rotations.key_feedback[1]
    layer = OscarLayer(config, rotation, rotations.value[1], key_feedback=factor)
    generator = torch.Generator().manual_seed(6)
    keys, values = (torch.randn(2, KV_HEADS, 40, HEAD_DIM, generator=generator) for _ in range(2))
    layer.update(keys, values)
    count = layer.history_length
    stored = layer.history_keys.whole()
    want = quantize((keys @ rotation)[:, :, :count], 2, HEAD_DIM, clip_ratio=config.key.clip_ratio, feedback=factor)
    assert count > 0 and torch.equal(stored.codes[:, :, :count], want.codes)
    plain = quantize((values @ rotations.value[1])[:, :, :count], 2, HEAD_DIM, clip_ratio=config.value.clip_ratio)
    assert torch.equal(layer.history_values.whole().codes[:, :, :count], plain.codes)
    model = tiny_model("llama")
    assert all(layer.key_feedback is not None for layer in OscarCache(model, "oscar-int2", rotations=rotations).layers)
    paper = OscarCache(model, "oscar-int2-paper", rotations=rotations)
    assert all(layer.key_feedback is None for layer in paper.layers)


def test_factors_come_from_the_rotated_query_covariance():
    """A layer's factor is that of its KV heads' query covariance in its R_K's basis (shared or per head)."""
    model = tiny_model("llama")
    batches = [torch.randint(3, 250, (1, 128), generator=torch.Generator().manual_seed(8))]
    covariances = collect_query_covariances(model, batches, "queries", progress=False)
    rotations = random_set(9, feedback=False)
    per_head = rotations.as_per_head(KV_HEADS)
    for rotated in (rotations, per_head):
        factors = key_feedback_factors(model, batches, rotated, progress=False)
        for i in LAYERS:
            rotation = rotated.key[i].double()
            want = feedback_factor(rotation.mT @ covariances[i] @ rotation)
            assert factors[i].shape == (KV_HEADS, HEAD_DIM, HEAD_DIM)
            torch.testing.assert_close(factors[i], want)


def test_query_covariances_group_query_heads_by_kv_head():
    model = tiny_model("llama")
    batches = [torch.randint(3, 250, (1, 64), generator=torch.Generator().manual_seed(9))]
    covariances = collect_query_covariances(model, batches, "queries", progress=False)
    assert sorted(covariances) == LAYERS
    assert covariances[0].shape == (KV_HEADS, HEAD_DIM, HEAD_DIM) and covariances[0].dtype == torch.float64
    torch.testing.assert_close(covariances[0], covariances[0].mT)


def test_the_recipe_feeds_keys_back_with_the_clip_search_only():
    assert Recipe().key_feedback and not Recipe(clip_search=False).key_feedback
    assert Recipe(from_rotations="set", key_feedback=True).key_feedback  # adding factors to a saved set
    with pytest.raises(ValueError, match="feedback_seq_len"):
        Recipe(feedback_seq_len=0)
    with pytest.raises(ValueError, match="add key feedback"):
        Recipe(from_rotations="set", key_feedback=False)


def test_the_allocation_runs_after_the_factors(monkeypatch):
    """``finish`` adds factors of the set's rotations and chooses its key clips under them, then allocates widths
    on that set (scored with the factors and clips it will carry) and keeps both."""
    import oscar_hf.calibration.recipe as recipe_module

    seen = []

    def allocate(recipe, model, batches, rotations, progress=True):
        seen.append((sorted(rotations.key_feedback), dict(rotations.key_clip)))
        return dataclasses.replace(rotations, key_bits={LAYERS[0]: 4}), None

    monkeypatch.setattr(recipe_module, "allocate", allocate)
    model = tiny_model("llama")
    rows = [torch.randint(3, 250, (1, 64), generator=torch.Generator().manual_seed(10))]
    small = METHODS["oscar-int2"].with_overrides(sink=4, recent=8, block=2)
    rotations, _, made = recipe_module.finish(
        Recipe(allocate_bits=1), model, rows, random_set(11), rows, progress=False, config=small
    )
    assert seen == [(LAYERS, rotations.key_clip)] and sorted(rotations.key_feedback) == LAYERS
    assert rotations.key_bits == {LAYERS[0]: 4}
    assert made["seq_len"] == 64 and made["rows"] == 1
    assert made["key_clip"] == {str(i): rotations.key_clip[i] for i in LAYERS}  # chosen under the factors
    with pytest.raises(ValueError, match="needs its rows"):
        recipe_module.finish(Recipe(), model, rows, random_set(11), None, progress=False)


def test_key_clips_are_chosen_again_under_the_factors():
    """Without factors the key clip search reproduces the clip search's key errors of the chosen variant;
    with them it measures the keys as the cache stores them, and changes only the key clip ratios."""
    from oscar_hf.calibration.clip_search import CLIP_GRID, search_key_clips, search_layers
    from oscar_hf.calibration.covariances import collect_covariances

    small = METHODS["oscar-int2"].with_overrides(sink=4, recent=8, block=2)
    model = tiny_model("llama")
    batches = [torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(s)) for s in (12, 13)]
    covariances = collect_covariances(model, batches, progress=False)
    searched, choices = search_layers(
        model, batches, covariances, small, max_queries=32, progress=False, center_keys=True
    )
    same, errors = search_key_clips(model, batches, searched, small, max_queries=32, progress=False)
    for i, choice in choices.items():
        assert same.key_clip[i] == choice.key_clip and len(errors[i]) == len(CLIP_GRID)
        for ratio in CLIP_GRID:
            assert errors[i][str(ratio)] == pytest.approx(choice.key_errors[f"{choice.key_factors}@{ratio}"], rel=1e-5)
    fed = key_feedback_factors(model, batches, searched, progress=False)
    with_factors = dataclasses.replace(searched, key_feedback=fed, key_bits={1: 4})
    chosen, fed_errors = search_key_clips(model, batches, with_factors, small, max_queries=32, progress=False)
    assert sorted(fed_errors) == [0]  # layer 1's 4-bit keys are not clipped by the set
    assert chosen.key_clip[0] == float(min(fed_errors[0], key=fed_errors[0].get))
    assert fed_errors[0] != pytest.approx(errors[0], rel=1e-3)  # measured with the factors
    assert chosen.key_clip[1] == searched.key_clip[1]
    k3 = METHODS["oscar-k3v2"].with_overrides(sink=4, recent=8, block=2)
    assert search_key_clips(model, batches, with_factors, k3, progress=False) == (with_factors, {})
    for field in ("key", "value", "key_mean", "key_feedback"):
        assert all(torch.equal(getattr(chosen, field)[i], getattr(with_factors, field)[i]) for i in LAYERS)
    assert chosen.value_clip == with_factors.value_clip and chosen.key_bits == with_factors.key_bits


def test_clip_ratios_apply_at_the_widths_they_were_searched_at(tmp_path):
    """A set searched under K3 V2 (base_bits (3, 2)) clips 3-bit keys by its ratios; a set searched at 2 bits
    leaves 3-bit keys at the method's fixed ratio; both clip 2-bit values by theirs. The width is saved."""
    model = tiny_model("llama")
    clips = {"key_clip": {0: 0.84, 1: 0.88}, "value_clip": {0: 0.8, 1: 0.75}}
    k3_searched = dataclasses.replace(random_set(14, feedback=False), **clips, base_bits=(3, 2))
    k2_searched = dataclasses.replace(k3_searched, base_bits=(2, 2))
    for rotations, key_clips in (
        (k3_searched, [0.84, 0.88]),
        (k2_searched, [METHODS["oscar-k3v2"].key.clip_ratio] * 2),
    ):
        layers = OscarCache(model, "oscar-k3v2", rotations=rotations).layers
        assert [layer.config.key.clip_ratio for layer in layers] == key_clips
        assert [layer.config.value.clip_ratio for layer in layers] == [0.8, 0.75]
    int2 = OscarCache(model, "oscar-int2", rotations=k3_searched).layers
    assert [layer.config.key.clip_ratio for layer in int2] == [METHODS["oscar-int2"].key.clip_ratio] * 2
    assert load_ours(save_rotations(k3_searched, tmp_path / "set")).base_bits == (3, 2)
