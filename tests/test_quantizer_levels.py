"""eval/quantizer_levels.py: the level placements it compares, on rows whose best placement is known."""

from __future__ import annotations

import torch

from eval import quantizer_levels as levels


def _mse(placed: torch.Tensor, rows: torch.Tensor) -> float:
    return float((placed - rows).pow(2).mean())


def test_on_gaussian_rows_lloyd_max_levels_beat_the_min_max_grid():
    rows = torch.randn(4000, 64, generator=torch.Generator().manual_seed(0))
    errors = {name: _mse(place(rows), rows) for name, (place, _) in levels.PLACEMENTS.items()}
    assert errors["Gaussian Lloyd-Max"] < 0.8 * errors["min-max"]  # 0.118 against ~0.17 sigma^2 at 64 samples
    assert errors["per-row Lloyd-Max"] <= errors["Gaussian Lloyd-Max"] * 1.01  # fitted to each row
    assert abs(errors["Gaussian Lloyd-Max"] - 0.1175) < 0.01  # the Gaussian 4-level Lloyd-Max distortion


def test_placements_use_four_levels_a_row_and_the_reference_grid_is_uniform():
    rows = torch.randn(50, 64, generator=torch.Generator().manual_seed(1)) * 3 + 1
    for name, (place, _) in levels.PLACEMENTS.items():
        assert all(len(torch.unique(row)) <= 4 for row in place(rows)), name
    steps = torch.tensor(levels.REFERENCE_LEVELS).diff()
    assert torch.allclose(steps, steps[0].expand(3), atol=1e-4)


def test_the_sink_stays_exact_and_exact_rows_give_no_error():
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 100, 64), torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    identity = torch.eye(64)
    errors = levels.layer_errors(query, key, value, identity, identity, 0.0, 0.0)
    assert set(errors) == set(levels.PLACEMENTS) and all(0 < e["output"] < 1 for e in errors.values())
    short = levels.layer_errors(query[:, :, :60], key[:, :, :60], value[:, :, :60], identity, identity, 0.0, 0.0)
    assert all(e["output"] == 0 for e in short.values())  # 60 rows: all in the sink
