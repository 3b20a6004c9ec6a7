"""Rotations R = U·H·P exactly as the reference composes them (``rotation/`` in github.com/FutureMLS-Lab/OSCAR)."""

from __future__ import annotations

import pytest
import torch

from oscar_hf.rotations.rotation_set import (
    RotationSet,
    bit_reversal,
    check_orthogonal,
    compose_rotation,
    eigen_permutation,
    hadamard,
    rotation_from_covariance,
)


@pytest.mark.parametrize("dim", [1, 2, 8, 64, 128, 256])
def test_hadamard_is_sylvester_and_orthonormal(dim):
    h = hadamard(dim)
    torch.testing.assert_close(h @ h, torch.eye(dim, dtype=torch.float64))
    torch.testing.assert_close(h, h.T)
    i, j = 3 % dim, 5 % dim
    assert h[i, j] == (-1) ** bin(i & j).count("1") / dim**0.5


def test_bit_reversal_matches_the_reference_prefix():
    assert bit_reversal(128)[:16].tolist() == [0, 64, 32, 96, 16, 80, 48, 112, 8, 72, 40, 104, 24, 88, 56, 120]


def test_permutation_puts_the_largest_eigen_direction_at_channel_zero_and_the_second_at_half():
    eig = torch.arange(64, dtype=torch.float64)  # ascending, as eigh returns them
    perm = eigen_permutation(eig)
    assert perm[0] == 63 and perm[32] == 62 and perm[16] == 61
    assert sorted(perm.tolist()) == list(range(64))


def test_compose_is_u_then_h_then_column_permutation():
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    eig = torch.rand(16, dtype=torch.float64).sort().values
    r = compose_rotation(u, eig, "UHP")
    p = torch.eye(16, dtype=torch.float64)[:, eigen_permutation(eig)]
    torch.testing.assert_close(r, u @ hadamard(16) @ p)
    torch.testing.assert_close(compose_rotation(u, eig, "UH"), u @ hadamard(16))
    torch.testing.assert_close(compose_rotation(u, eig, "HP"), hadamard(16) @ p)
    torch.testing.assert_close(compose_rotation(u, eig, ""), torch.eye(16, dtype=torch.float64))


def test_rotation_from_covariance_uses_ascending_eigh_and_is_orthogonal():
    torch.manual_seed(1)
    a = torch.randn(200, 32, dtype=torch.float64) * torch.linspace(0.1, 5, 32, dtype=torch.float64)
    cov = a.T @ a / 200
    r, eig = rotation_from_covariance(cov)
    assert r.dtype == torch.float32 and bool((eig[1:] >= eig[:-1]).all())
    check_orthogonal(r, "R")
    values, vectors = torch.linalg.eigh(cov)
    torch.testing.assert_close(r.double(), compose_rotation(vectors, values), atol=1e-6, rtol=0)


def test_rotation_preserves_dot_products():
    torch.manual_seed(2)
    r, _ = rotation_from_covariance(torch.eye(64, dtype=torch.float64) + 0.1)
    q, k = torch.randn(5, 64), torch.randn(7, 64)
    torch.testing.assert_close((q @ r) @ (k @ r).T, q @ k.T, atol=1e-4, rtol=1e-4)


def test_non_power_of_two_head_dim_is_refused_for_hadamard():
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        hadamard(96)
    with pytest.raises(ValueError, match="head_dim=80"):
        RotationSet.hadamard(80, [0])


def test_rotation_set_checks_shape_and_orthogonality_on_load():
    with pytest.raises(ValueError, match="expected \\(16, 16\\)"):
        RotationSet(16, key={0: torch.eye(8)})
    with pytest.raises(ValueError, match="not orthogonal"):
        RotationSet(16, key={0: torch.eye(16) * 1.1})
    rotations = RotationSet.hadamard(16, [0, 1])
    with pytest.raises(ValueError, match="head_dim=16 but the model has head_dim=32"):
        rotations.check_model(32, [0, 1])
    with pytest.raises(ValueError, match="extra \\[1\\]"):
        rotations.check_model(16, [0])
    with pytest.raises(ValueError, match="missing \\[2\\]"):
        rotations.check_model(16, [0, 1, 2])
    with pytest.raises(ValueError, match="without R_V \\[1\\]"):
        RotationSet(16, key=rotations.key, value={0: rotations.value[0]}).check_model(16, [0, 1])


def _orthogonal(dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))[0].float()


def _per_head_set(kv_heads: int = 4, dim: int = 16) -> RotationSet:
    key = {i: torch.stack([_orthogonal(dim, 10 * i + h) for h in range(kv_heads)]) for i in (0, 2)}
    value = {i: torch.stack([_orthogonal(dim, 100 + 10 * i + h) for h in range(kv_heads)]) for i in (0, 2)}
    eigenvalues = {i: torch.rand(kv_heads, dim).sort().values for i in (0, 2)}
    return RotationSet(
        dim,
        key,
        value,
        "per head",
        eigenvalues,
        dict(eigenvalues),
        key_clip={0: 0.9},
        key_bits={0: 4},
        value_bits={2: 1},
    )


def test_per_head_rotation_set_validates_every_head():
    rotations = _per_head_set()
    assert rotations.per_head and rotations.kv_heads == 4
    assert not RotationSet.hadamard(16, [0]).per_head and RotationSet.hadamard(16, [0]).kv_heads is None
    bad = rotations.key[0].clone()
    bad[2] *= 1.1
    with pytest.raises(ValueError, match="R_K of layer 0, KV head 2 is not orthogonal"):
        RotationSet(16, key={0: bad})
    with pytest.raises(ValueError, match="expected \\(16, 16\\) \\(shared\\) or \\(kv_heads, 16, 16\\)"):
        RotationSet(16, key={0: torch.eye(16).expand(2, 2, 16, 16)})
    with pytest.raises(ValueError, match="one KV head count, got \\[2, 4\\]"):
        RotationSet(16, key={0: rotations.key[0]}, value={0: rotations.value[0][:2]})
    # shared and per-head layers may mix (e.g. a per-head R_K file beside a shared R_V file)
    mixed = RotationSet(16, key={0: rotations.key[0]}, value={0: _orthogonal(16, 1)})
    assert mixed.kv_heads == 4
    rotations.check_model(16, [0, 2], kv_heads=4)
    with pytest.raises(ValueError, match="4 KV heads but the model has 2 KV heads"):
        rotations.check_model(16, [0, 2], kv_heads=2)
    RotationSet.hadamard(16, [0]).check_model(16, [0], kv_heads=2)  # a shared R serves any head count


def test_select_kv_heads_and_as_per_head():
    rotations = _per_head_set()
    part = rotations.select_kv_heads(2, 4)
    assert part.kv_heads == 2 and part.key_clip == {0: 0.9}
    assert part.key_bits == {0: 4} and part.value_bits == {2: 1}
    for i in (0, 2):
        assert torch.equal(part.key[i], rotations.key[i][2:4]) and torch.equal(part.value[i], rotations.value[i][2:])
        assert torch.equal(part.key_eigenvalues[i], rotations.key_eigenvalues[i][2:4])
    with pytest.raises(ValueError, match="not within the set's 4 KV heads"):
        rotations.select_kv_heads(3, 5)
    shared = RotationSet.hadamard(16, [0, 1])
    shared.value_bits.update({1: 1})
    assert shared.select_kv_heads(0, 1) is shared
    expanded = shared.as_per_head(3)
    assert expanded.value_bits == {1: 1}
    assert expanded.kv_heads == 3 and all(
        torch.equal(expanded.key[i][h], shared.key[i]) for i in (0, 1) for h in range(3)
    )
    with pytest.raises(ValueError, match="already has per-head rotations for 4"):
        rotations.as_per_head(3)


def test_value_fingerprint_covers_every_head():
    rotations = _per_head_set()
    other = _per_head_set()
    assert rotations.value_fingerprint() == other.value_fingerprint()
    other.value[2] = other.value[2][[0, 1, 3, 2]]  # two heads swapped
    assert rotations.value_fingerprint() != other.value_fingerprint()
    shared = RotationSet.hadamard(16, [0])
    assert shared.value_fingerprint() != shared.as_per_head(2).value_fingerprint()
