"""Orthogonal rotations of the head dimension: R = U·H·P, applied as ``x_rot = x @ R``.

U are eigenvectors of an attention-aware covariance (ascending ``eigh`` order), H the normalised
Sylvester Walsh-Hadamard matrix and P the eigenvalue-driven bit-reversal permutation, exactly as
the reference builds them (oscar-reference.md sections 1.3-1.6). One R per layer is shared by
all heads of that layer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

ORTHOGONALITY_TOLERANCE = 1e-3
FACTOR_CHOICES = ("UHP", "UH", "UP", "HP", "H", "U", "")
# The reference script's names for the same compositions (compute_kv_rotation.py --composition).
COMPOSITION_NAMES = {"UHP": "r_h_pbr", "UH": "r_h", "UP": "br", "HP": "h_pbr", "H": "hadamard", "U": "plain", "": "identity"}


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def require_power_of_two(head_dim: int, what: str) -> None:
    """Raise a clear error when a Hadamard-based ``what`` meets a head_dim that is not 2^k."""
    if not is_power_of_two(head_dim):
        raise ValueError(
            f"{what} needs a Walsh-Hadamard matrix, which exists only for a power-of-two head_dim; "
            f"this model has head_dim={head_dim}. Use an identity-based method (none, naive-int2) instead."
        )


def hadamard(dim: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix in natural order: H[i, j] = (-1)^popcount(i & j) / sqrt(dim)."""
    require_power_of_two(dim, "hadamard()")
    idx = torch.arange(dim)
    signs = torch.zeros(dim, dim, dtype=torch.int64)
    and_bits = idx[:, None] & idx[None, :]
    while bool(and_bits.any()):
        signs ^= and_bits & 1
        and_bits = and_bits >> 1
    return (1 - 2 * signs).to(dtype) / dim**0.5


def bit_reversal(dim: int) -> torch.Tensor:
    """``br[i]`` is ``i`` with its log2(dim) bits reversed."""
    require_power_of_two(dim, "bit_reversal()")
    bits = dim.bit_length() - 1
    return torch.tensor([int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(dim)])


def eigen_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Column order of P: output channel ``br[i]`` receives the i-th largest eigen-direction.

    ``P = I[:, perm]``, so ``(X @ P)[:, j] = X[:, perm[j]]``.
    """
    dim = eigenvalues.numel()
    order_desc = torch.argsort(eigenvalues, descending=True, stable=True)
    perm = torch.empty(dim, dtype=torch.long)
    perm[bit_reversal(dim)] = order_desc
    return perm


def compose_rotation(eigenvectors: torch.Tensor, eigenvalues: torch.Tensor, factors: str = "UHP") -> torch.Tensor:
    """Product of the chosen factors, in the order U, H, P (``UHP`` is the validated OSCAR composition)."""
    if factors not in FACTOR_CHOICES:
        raise ValueError(f"factors must be one of {FACTOR_CHOICES}, got {factors!r}")
    dim = eigenvectors.shape[0]
    rotation = torch.eye(dim, dtype=torch.float64)
    if "U" in factors:
        rotation = eigenvectors.to(torch.float64)
    if "H" in factors:
        rotation = rotation @ hadamard(dim)
    if "P" in factors:
        rotation = rotation[:, eigen_permutation(eigenvalues)]
    return rotation


def rotation_from_covariance(covariance: torch.Tensor, factors: str = "UHP") -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecompose a symmetric covariance in float64 and compose R; returns (R fp32, ascending eigenvalues fp32)."""
    if covariance.ndim != 2 or covariance.shape[0] != covariance.shape[1]:
        raise ValueError(f"covariance must be square, got shape {tuple(covariance.shape)}")
    cov = covariance.to(torch.float64)
    eigenvalues, eigenvectors = torch.linalg.eigh((cov + cov.T) / 2)
    rotation = compose_rotation(eigenvectors, eigenvalues, factors)
    return rotation.to(torch.float32), eigenvalues.to(torch.float32)


def check_orthogonal(rotation: torch.Tensor, name: str, tolerance: float = ORTHOGONALITY_TOLERANCE) -> None:
    """Raise ``ValueError`` unless ``rotation`` is a square orthogonal matrix (max |R^T R - I| <= tolerance)."""
    if rotation.ndim != 2 or rotation.shape[0] != rotation.shape[1]:
        raise ValueError(f"{name}: a rotation must be a square [head_dim, head_dim] matrix, got {tuple(rotation.shape)}")
    r = rotation.to(torch.float64)
    error = (r.T @ r - torch.eye(r.shape[0], dtype=torch.float64)).abs().max().item()
    if not error <= tolerance:
        raise ValueError(f"{name} is not orthogonal: max |R^T R - I| = {error:.3g} > {tolerance:g}")


@dataclass
class RotationSet:
    """Per-layer key and value rotations (R_K, R_V), float32 ``[head_dim, head_dim]``, keyed by global layer id.

    A layer missing from ``key`` or ``value`` uses the identity. The ascending eigenvalues of the
    calibration covariances are kept for inspection only; they are not needed at run time.
    """

    head_dim: int
    key: dict[int, torch.Tensor] = field(default_factory=dict)
    value: dict[int, torch.Tensor] = field(default_factory=dict)
    description: str = ""
    key_eigenvalues: dict[int, torch.Tensor] = field(default_factory=dict)
    value_eigenvalues: dict[int, torch.Tensor] = field(default_factory=dict)
    key_clip: dict[int, float] = field(default_factory=dict)
    value_clip: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind, table in (("key_clip", self.key_clip), ("value_clip", self.value_clip)):
            for layer_id, ratio in table.items():
                if not 0.0 <= float(ratio) <= 1.0:
                    raise ValueError(f"{kind} of layer {layer_id} must be in [0, 1], got {ratio}")
        for kind, table in (("R_K", self.key), ("R_V", self.value)):
            for layer_id, rotation in table.items():
                if tuple(rotation.shape) != (self.head_dim, self.head_dim):
                    raise ValueError(
                        f"{kind} of layer {layer_id} has shape {tuple(rotation.shape)}, "
                        f"expected ({self.head_dim}, {self.head_dim}) for head_dim={self.head_dim}"
                    )
                check_orthogonal(rotation, f"{kind} of layer {layer_id}")
                table[layer_id] = rotation.to(torch.float32)

    @classmethod
    def hadamard(cls, head_dim: int, layer_ids: list[int]) -> "RotationSet":
        """The data-free QuaRot-style rotation: R_K = R_V = H for every layer."""
        h = hadamard(head_dim).to(torch.float32)
        return cls(head_dim, {i: h for i in layer_ids}, {i: h for i in layer_ids}, "hadamard")

    @classmethod
    def identity(cls, head_dim: int) -> "RotationSet":
        return cls(head_dim, {}, {}, "identity")

    def for_layer(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(R_K, R_V) of a layer; ``None`` stands for the identity."""
        return self.key.get(layer_id), self.value.get(layer_id)

    def value_fingerprint(self) -> str:
        """A short hash of all R_V, to recognise the rotations a model's weights were folded with."""
        digest = hashlib.sha256()
        for layer_id in sorted(self.value):
            digest.update(str(layer_id).encode())
            digest.update(self.value[layer_id].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def check_model(self, head_dim: int, layer_ids: list[int]) -> None:
        """Raise a clear error if these rotations were made for another model shape."""
        if head_dim != self.head_dim:
            raise ValueError(f"rotations are for head_dim={self.head_dim} but the model has head_dim={head_dim}")
        extra = sorted((set(self.key) | set(self.value)) - set(layer_ids))
        if extra:
            raise ValueError(
                f"rotations name layers {extra} that are not quantized full-attention layers of this model "
                f"(those are {layer_ids[:8]}{'...' if len(layer_ids) > 8 else ''})"
            )
