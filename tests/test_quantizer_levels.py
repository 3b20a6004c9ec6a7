"""eval/quantizer_levels.py: the level placements it compares, and the seam that puts them in a cache."""

from __future__ import annotations

from dataclasses import replace

import torch

from eval import quantizer_levels as levels
from oscar_hf import OscarCache
from oscar_hf.calibration.teacher_forcing import teacher_forced_logits
from oscar_hf.quant import dequantize, quantize
from oscar_hf.rotations.rotation_set import RotationSet
from tests.conftest import TINY, tiny_model

HEAD_DIM = TINY["head_dim"]


def _mse(placed: torch.Tensor, rows: torch.Tensor) -> float:
    return float((placed - rows).pow(2).mean())


def _placements() -> dict:
    return {name: p.place for name, p in levels.PLACEMENTS.items() if p.place is not None}


def test_on_gaussian_rows_lloyd_max_levels_beat_the_min_max_grid():
    rows = torch.randn(4000, 64, generator=torch.Generator().manual_seed(0))
    errors = {name: _mse(place(rows), rows) for name, place in _placements().items()}
    errors["min-max"] = _mse(dequantize(quantize(rows, 2, 64, metadata_dtype=torch.float32), 2, 64, rows.dtype), rows)
    assert errors["Gaussian Lloyd-Max"] < 0.8 * errors["min-max"]  # 0.118 against ~0.17 sigma^2 at 64 samples
    assert errors["per-row Lloyd-Max"] <= errors["Gaussian Lloyd-Max"] * 1.01  # fitted to each row
    assert abs(errors["Gaussian Lloyd-Max"] - 0.1175) < 0.01  # the Gaussian 4-level Lloyd-Max distortion


def test_placements_use_four_levels_a_row_and_the_reference_grid_is_uniform():
    rows = torch.randn(50, 64, generator=torch.Generator().manual_seed(1)) * 3 + 1
    for name, place in _placements().items():
        assert all(len(torch.unique(row)) <= 4 for row in place(rows)), name
    steps = torch.tensor(levels.REFERENCE_LEVELS).diff()
    assert torch.allclose(steps, steps[0].expand(3), atol=1e-4)


def _logits(model, ids, placement: levels.Placement) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    rotation = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=generator, dtype=torch.float64))[0].float()
    means = {i: torch.randn(TINY["num_key_value_heads"], HEAD_DIM, generator=generator) for i in (0, 1)}
    rotations = RotationSet(HEAD_DIM, {0: rotation, 1: rotation}, {0: rotation, 1: rotation}, key_mean=means)
    cache = OscarCache(model, "oscar-int2", rotations=rotations, sink=4, recent=8)
    return teacher_forced_logits(model, ids, levels.with_placement(cache, placement))


def test_a_placement_replaces_exactly_the_two_bit_rows_round_trip():
    """The library's own grid through the seam gives the cache's logits; exact rows give the unquantized ones."""
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(0))
    library = _logits(model, ids, levels.PLACEMENTS["min-max"])
    grid = levels.Placement(lambda rows: dequantize(quantize(rows, 2, HEAD_DIM), 2, HEAD_DIM, rows.dtype))
    torch.testing.assert_close(_logits(model, ids, grid), library, atol=1e-5, rtol=1e-5)
    exact = _logits(model, ids, levels.Placement(lambda rows: rows, clipped=False))
    unquantized = teacher_forced_logits(model, ids, OscarCache(model, "none"))
    torch.testing.assert_close(exact, unquantized, atol=1e-4, rtol=1e-4)
    assert (exact - library).abs().max() > 1e-3  # the rows were quantized before
    values_only = _logits(model, ids, replace(levels.PLACEMENTS["Gaussian Lloyd-Max"], parts=("value",)))
    assert not torch.allclose(values_only, library) and not torch.allclose(values_only, exact)
