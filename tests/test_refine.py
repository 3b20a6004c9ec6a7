"""Rotation refinement on the orthogonal group: orthogonal results, never worse on its rows, per-head ready."""

from __future__ import annotations

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.calibration.clip_search import search_layers
from oscar_hf.calibration.covariances import collect_covariances
from oscar_hf.calibration.refine import (
    RefineSettings,
    capture_rows,
    cayley,
    fake_quantize,
    refine_matrix,
    refine_rotations,
)
from oscar_hf.config import METHODS
from oscar_hf.core.quantize_jobs import roundtrip_rows
from oscar_hf.rotations.rotation_set import check_orthogonal
from tests.conftest import calibration_text, run_calibrate, tiny_model

SMALL = METHODS["oscar-int2"].with_overrides(sink=4, recent=8, block=2)
QUICK = RefineSettings(steps=15, lr=5e-3, queries=16, max_queries=32, clip_offsets=(0.04, -0.04))


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    torch.manual_seed(0)
    batches = [torch.randint(3, 256, (1, 64)) for _ in range(3)]
    covariances = collect_covariances(model, batches, progress=False)
    rotations, _ = search_layers(model, batches[:2], covariances, SMALL, max_queries=32, progress=False)
    return model, batches, rotations


def test_fake_quantize_matches_the_cache_quantizer_and_passes_gradients_straight_through():
    torch.manual_seed(0)
    rows = torch.randn(5, 3, 16) * 3
    spec = SMALL.key
    expected = roundtrip_rows(rows, spec.__class__(2, clip_ratio=0.9), torch.float32)
    rows.requires_grad_(True)
    fake = fake_quantize(rows, spec, 0.9)
    torch.testing.assert_close(fake, expected, atol=1e-5, rtol=1e-5)
    fake.sum().backward()
    assert rows.grad is not None and rows.grad.abs().sum() > 0


def test_cayley_is_orthogonal_and_the_identity_at_zero():
    torch.testing.assert_close(cayley(torch.zeros(8, 8)), torch.eye(8))
    check_orthogonal(cayley(torch.randn(8, 8, generator=torch.Generator().manual_seed(1))), "cayley", 1e-5)


def test_refinement_lowers_the_hard_error_and_keeps_rotations_orthogonal(setup):
    model, batches, rotations = setup
    refined, fits = refine_rotations(model, batches[:2], rotations, SMALL, QUICK, progress=False)
    assert sorted(fits) == sorted(rotations.key)
    for layer_id, layer in fits.items():
        for kind in ("key", "value"):
            assert layer[kind].error_after <= layer[kind].error_before
        check_orthogonal(refined.key[layer_id], "refined R_K")
        check_orthogonal(refined.value[layer_id], "refined R_V")
        assert refined.key_clip[layer_id] == layer["key"].clip_ratio
    assert any(f[k].error_after < f[k].error_before for f in fits.values() for k in ("key", "value"))
    OscarCache(model, "oscar-int2", rotations=refined)  # the cache accepts the refined set


def test_a_fit_that_does_not_help_keeps_the_start(setup):
    model, batches, rotations = setup
    rows = capture_rows(model, batches[:2], SMALL, 32, progress=False)[0]
    still = refine_matrix("key", rows, rotations.key[0], 0.9, SMALL, RefineSettings(steps=0, clip_offsets=()))
    assert still.error_after == still.error_before and torch.equal(still.rotation, rotations.key[0].float())


def test_one_kv_head_is_fitted_with_the_same_code(setup):
    model, batches, rotations = setup
    rows = capture_rows(model, batches[:2], SMALL, 32, progress=False)[1]
    head = rows.head(1)
    assert head.query.shape[1] == head.key.shape[1] == 1 and head.query.shape[2] == rows.query.shape[2]
    fit = refine_matrix("key", head, rotations.key[1], rotations.key_clip[1], SMALL, QUICK)
    assert fit.error_after <= fit.error_before
    check_orthogonal(fit.rotation, "per-head R_K")


def test_bad_kind_is_refused(setup):
    model, batches, rotations = setup
    rows = capture_rows(model, batches[:2], SMALL, 32, progress=False)[0]
    with pytest.raises(ValueError, match="kind must be"):
        refine_matrix("query", rows, rotations.key[0], 0.9, SMALL, QUICK)


def test_calibrate_refuses_refine_without_the_clip_search(tmp_path):
    from oscar_hf.cli.main import main

    with pytest.raises(SystemExit, match="drop --no-clip-search"):
        main(
            [
                "calibrate",
                "--data",
                str(tmp_path / "text.txt"),
                "--out",
                str(tmp_path / "out"),
                "--refine",
                "--no-clip-search",
            ]
        )


@pytest.mark.slow
def test_calibrate_refine_on_the_default_model(tmp_path, capsys):
    import json

    from oscar_hf.rotations.files import load_rotation_config
    from oscar_hf.rotations.hub import load_rotations

    out = tmp_path / "rotations"
    run_calibrate(
        "default", calibration_text(tmp_path / "text.txt"), 1200, 600, out, "--clip-search", "--refine", "--json"
    )
    summary = json.loads(capsys.readouterr().out)
    rotations = load_rotations(out)
    config = load_rotation_config(out)
    assert summary["layers"] == 30 and "refined" in config["composition"]
    for row in summary["per_layer"]:
        assert row["key"].endswith(f"clip {rotations.key_clip[row['layer']]}")


def test_rows_of_different_lengths_are_refused():
    model = tiny_model("llama")
    batches = [torch.randint(3, 256, (1, 64)), torch.randint(3, 256, (1, 48))]
    with pytest.raises(ValueError, match="same length"):
        capture_rows(model, batches, SMALL, 16, progress=False)
