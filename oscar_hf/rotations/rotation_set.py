"""Orthogonal rotations of the head dimension: R = U·H·P, applied as ``x_rot = x @ R``.

U are eigenvectors of an attention-aware covariance (ascending ``eigh`` order), H the normalised
Sylvester Walsh-Hadamard matrix and P the eigenvalue-driven bit-reversal permutation, exactly as
the reference builds them (``rotation/`` in github.com/FutureMLS-Lab/OSCAR). A layer's R is either shared by
all of its heads (``[D, D]``, the paper's setting) or one per KV head (``[H_kv, D, D]``, the
reference's later format 2); query head ``i`` uses the R of its KV head
``i // g`` (contiguous GQA groups of ``g`` query heads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from transformers import PretrainedConfig, PreTrainedModel

from oscar_hf.model_info import full_attention_layer_ids, head_dim_of, kv_heads_of, tensor_parallel_rank
from oscar_hf.quant import SUPPORTED_BITS

ORTHOGONALITY_TOLERANCE = 1e-3
FACTOR_CHOICES = ("UHP", "UH", "UP", "HP", "H", "U", "")
# The reference script's names for the same compositions (compute_kv_rotation.py --composition).
COMPOSITION_NAMES = {
    "UHP": "r_h_pbr",
    "UH": "r_h",
    "UP": "br",
    "HP": "h_pbr",
    "H": "hadamard",
    "U": "plain",
    "": "identity",
}


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
    cov = covariance.to("cpu", torch.float64)  # eigh in float64 on the host, whatever device collected it
    eigenvalues, eigenvectors = torch.linalg.eigh((cov + cov.T) / 2)
    rotation = compose_rotation(eigenvectors, eigenvalues, factors)
    return rotation.to(torch.float32), eigenvalues.to(torch.float32)


def check_orthogonal(rotation: torch.Tensor, name: str, tolerance: float = ORTHOGONALITY_TOLERANCE) -> None:
    """Raise ``ValueError`` unless ``rotation`` is a square orthogonal matrix (max |R^T R - I| <= tolerance)."""
    if rotation.ndim != 2 or rotation.shape[0] != rotation.shape[1]:
        raise ValueError(
            f"{name}: a rotation must be a square [head_dim, head_dim] matrix, got {tuple(rotation.shape)}"
        )
    r = rotation.to(torch.float64)
    error = (r.T @ r - torch.eye(r.shape[0], dtype=torch.float64)).abs().max().item()
    if not error <= tolerance:
        raise ValueError(f"{name} is not orthogonal: max |R^T R - I| = {error:.3g} > {tolerance:g}")


def heads_of(rotation: torch.Tensor) -> list[torch.Tensor]:
    """The ``[D, D]`` matrices of a shared ``[D, D]`` or per-KV-head ``[H_kv, D, D]`` rotation."""
    return [rotation] if rotation.ndim == 2 else list(rotation.unbind(0))


def per_query_head(rotation: torch.Tensor, heads: int) -> torch.Tensor:
    """A rotation for ``heads`` rows of heads: ``[D, D]`` as it is, ``[H_kv, D, D]`` repeated over each GQA group.

    ``heads`` is the KV head count (the rotation itself) or a multiple of it (the query heads).
    """
    if rotation.ndim == 2 or rotation.shape[0] == heads:
        return rotation
    if heads % rotation.shape[0]:
        raise ValueError(f"{heads} heads cannot be grouped onto a rotation of {rotation.shape[0]} KV heads")
    return rotation.repeat_interleave(heads // rotation.shape[0], dim=0)


@dataclass
class RotationSet:
    """Per-layer key and value rotations (R_K, R_V), float32, keyed by global layer id.

    Each rotation is shared by the layer's heads (``[head_dim, head_dim]``) or one per KV head
    (``[H_kv, head_dim, head_dim]``, the same ``H_kv`` throughout the set); eigenvalues follow the
    same layout (``[head_dim]`` or ``[H_kv, head_dim]``). A layer missing from ``key`` or ``value``
    uses the identity. The ascending eigenvalues of the calibration covariances are kept for
    inspection only; they are not needed at run time. ``key_clip`` / ``value_clip`` and ``key_bits`` /
    ``value_bits`` are optional per-layer clip ratios and history bit widths that calibrated methods
    apply (:meth:`oscar_hf.config.OscarConfig.for_layer`); ``base_bits`` are the (K, V) widths the
    clip ratios were searched at and the per-layer widths allocated against (``oscar-int2``'s (2, 2)
    unless set): clip ratios apply to tensors at those widths, and only a method at them takes the widths. ``windows`` are the (sink, recent) token windows the set
    was calibrated for, if it records them: a cache made with the set uses them unless its caller
    passes its own. ``key_mean`` holds a layer's mean key (``[D]``, or ``[H_kv, D]`` one per KV head)
    in the model's basis, as the attention receives keys (after RoPE): a layer with one stores every
    key centered, ``(k - mean) @ R_K``. Each query's scores then all shift by ``q . mean``, which
    softmax ignores, while the quantizer no longer spends its range on the offset. ``key_feedback``
    holds a layer's key feedback factor (``[D, D]`` or ``[H_kv, D, D]``, upper triangular with a unit
    diagonal, in the rotated basis): stored keys feed each channel's quantization error forward into
    the later channels so that it cancels in the scores (:func:`oscar_hf.quant.quantize`).
    """

    head_dim: int
    key: dict[int, torch.Tensor] = field(default_factory=dict)
    value: dict[int, torch.Tensor] = field(default_factory=dict)
    description: str = ""
    key_eigenvalues: dict[int, torch.Tensor] = field(default_factory=dict)
    value_eigenvalues: dict[int, torch.Tensor] = field(default_factory=dict)
    key_clip: dict[int, float] = field(default_factory=dict)
    value_clip: dict[int, float] = field(default_factory=dict)
    key_bits: dict[int, int] = field(default_factory=dict)
    value_bits: dict[int, int] = field(default_factory=dict)
    base_bits: tuple[int, int] = (2, 2)
    windows: tuple[int, int] | None = None
    key_mean: dict[int, torch.Tensor] = field(default_factory=dict)
    key_feedback: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, table in vars(self).items():  # each set owns its tables (copies share none)
            if isinstance(table, dict):
                setattr(self, name, dict(table))
        if self.windows is not None:
            sink, recent = self.windows
            if isinstance(sink, bool) or isinstance(recent, bool) or int(sink) != sink or int(recent) != recent:
                raise ValueError(f"windows must be (sink, recent) token counts, got {self.windows!r}")
            if sink < 0 or recent < 1:
                raise ValueError(f"windows must have sink >= 0 and recent >= 1 tokens, got {self.windows!r}")
            self.windows = (int(sink), int(recent))
        if len(self.base_bits) != 2 or any(b not in SUPPORTED_BITS or isinstance(b, bool) for b in self.base_bits):
            raise ValueError(
                f"base_bits must be (key bits, value bits), each one of {SUPPORTED_BITS}, got {self.base_bits!r}"
            )
        self.base_bits = (int(self.base_bits[0]), int(self.base_bits[1]))
        for kind, table in (("key_clip", self.key_clip), ("value_clip", self.value_clip)):
            for layer_id, ratio in table.items():
                if not 0.0 <= float(ratio) <= 1.0:
                    raise ValueError(f"{kind} of layer {layer_id} must be in [0, 1], got {ratio}")
        for kind, table in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            for layer_id, bits in table.items():
                if bits not in SUPPORTED_BITS or isinstance(bits, bool):
                    raise ValueError(f"{kind} of layer {layer_id} must be one of {SUPPORTED_BITS}, got {bits!r}")
                table[layer_id] = int(bits)
        dim = self.head_dim
        for kind, table in (("R_K", self.key), ("R_V", self.value)):
            for layer_id, rotation in table.items():
                if rotation.ndim not in (2, 3) or tuple(rotation.shape[-2:]) != (dim, dim):
                    raise ValueError(
                        f"{kind} of layer {layer_id} has shape {tuple(rotation.shape)}, expected ({dim}, {dim}) "
                        f"(shared) or (kv_heads, {dim}, {dim}) (per KV head) for head_dim={dim}"
                    )
                for head, matrix in enumerate(heads_of(rotation)):
                    where = f", KV head {head}" if rotation.ndim == 3 else ""
                    check_orthogonal(matrix, f"{kind} of layer {layer_id}{where}")
                table[layer_id] = rotation.to(torch.float32)
        for layer_id, mean in self.key_mean.items():
            if mean.ndim not in (1, 2) or mean.shape[-1] != dim or not torch.isfinite(mean).all():
                raise ValueError(
                    f"key_mean of layer {layer_id} has shape {tuple(mean.shape)}, expected finite ({dim},) or "
                    f"(kv_heads, {dim}) for head_dim={dim}"
                )
            self.key_mean[layer_id] = mean.to(torch.float32)
        for layer_id, factor in self.key_feedback.items():
            self.key_feedback[layer_id] = check_feedback_factor(factor, dim, f"key_feedback of layer {layer_id}")
        counts = set(self._head_counts())
        if len(counts) > 1:
            raise ValueError(f"per-head tensors of one set must have one KV head count, got {sorted(counts)}")

    @classmethod
    def hadamard(cls, head_dim: int, layer_ids: list[int]) -> "RotationSet":
        """The data-free QuaRot-style rotation: R_K = R_V = H for every layer."""
        h = hadamard(head_dim).to(torch.float32)
        return cls(head_dim, {i: h for i in layer_ids}, {i: h for i in layer_ids}, "hadamard")

    @classmethod
    def identity(cls, head_dim: int) -> "RotationSet":
        return cls(head_dim, {}, {}, "identity")

    def _head_counts(self) -> list[int]:
        """The KV head count of every per-head tensor."""
        matrices = [*self.key.values(), *self.value.values(), *self.key_feedback.values()]
        return [t.shape[0] for t in matrices if t.ndim == 3] + [
            m.shape[0] for m in self.key_mean.values() if m.ndim == 2
        ]

    @property
    def kv_heads(self) -> int | None:
        """The KV head count of the per-head rotations (or key means, or feedback factors), or None when every
        one is shared."""
        counts = self._head_counts()
        return counts[0] if counts else None

    @property
    def per_head(self) -> bool:
        """Whether some rotation of the set is one per KV head (per-head key means alone do not make it so)."""
        return any(r.ndim == 3 for r in [*self.key.values(), *self.value.values()])

    def for_layer(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(R_K, R_V) of a layer, ``[D, D]`` or ``[H_kv, D, D]``; ``None`` stands for the identity."""
        return self.key.get(layer_id), self.value.get(layer_id)

    def select_kv_heads(self, start: int, stop: int) -> "RotationSet":
        """The rotations of KV heads ``start .. stop - 1`` (a tensor-parallel rank's own heads).

        Shared rotations serve any heads and are kept as they are.
        """
        heads = self.kv_heads
        if heads is None:
            return self
        if not 0 <= start < stop <= heads:
            raise ValueError(f"KV heads {start}..{stop - 1} are not within the set's {heads} KV heads")

        def pick(table: dict[int, torch.Tensor], per_head_ndim: int) -> dict[int, torch.Tensor]:
            return {i: t[start:stop] if t.ndim == per_head_ndim else t for i, t in table.items()}

        return replace(
            self,
            key=pick(self.key, 3),
            value=pick(self.value, 3),
            key_eigenvalues=pick(self.key_eigenvalues, 2),
            value_eigenvalues=pick(self.value_eigenvalues, 2),
            key_mean=pick(self.key_mean, 2),
            key_feedback=pick(self.key_feedback, 3),
        )

    def as_per_head(self, kv_heads: int) -> "RotationSet":
        """The same rotations with every shared ``[D, D]`` repeated into ``[kv_heads, D, D]``."""
        if self.kv_heads not in (None, kv_heads):
            raise ValueError(f"the set already has per-head rotations for {self.kv_heads} KV heads, not {kv_heads}")

        def expand(table: dict[int, torch.Tensor], shared_ndim: int) -> dict[int, torch.Tensor]:
            return {i: t.expand(kv_heads, *t.shape).clone() if t.ndim == shared_ndim else t for i, t in table.items()}

        return replace(
            self,
            key=expand(self.key, 2),
            value=expand(self.value, 2),
            key_eigenvalues=expand(self.key_eigenvalues, 1),
            value_eigenvalues=expand(self.value_eigenvalues, 1),
            key_feedback=expand(self.key_feedback, 2),
        )

    def value_fingerprint(self) -> str:
        """A short hash of all R_V (every head's), to recognise the rotations a model's weights were folded with."""
        digest = hashlib.sha256()
        for layer_id in sorted(self.value):
            digest.update(str(layer_id).encode())
            digest.update(self.value[layer_id].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def check_model(
        self,
        head_dim: int,
        layer_ids: list[int],
        kv_heads: int | None = None,
        model: str = "the model",
        source: str = "the rotations",
    ) -> None:
        """Raise a clear error unless this set fits a model: its ``head_dim``, its ``kv_heads`` (per-head
        rotations) and an R_K and an R_V for exactly its quantized full-attention ``layer_ids``. The one
        check wherever a set meets a model (:meth:`check_fits` reads the three from its config)."""
        if head_dim != self.head_dim:
            raise ValueError(f"{source} are for head_dim={self.head_dim} but {model} has head_dim={head_dim}")
        if kv_heads is not None and self.kv_heads not in (None, kv_heads):
            raise ValueError(
                f"{source} hold one R per KV head for {self.kv_heads} KV heads but {model} has {kv_heads} KV heads "
                "(under tensor parallelism each rank takes its own heads: RotationSet.select_kv_heads)"
            )
        present, expected = sorted(set(self.key) | set(self.value)), sorted(layer_ids)
        gaps = [
            (what, ids)
            for what, ids in (
                ("missing", sorted(set(expected) - set(present))),
                ("extra", sorted(set(present) - set(expected))),
                ("without R_K", sorted(set(self.value) - set(self.key))),
                ("without R_V", sorted(set(self.key) - set(self.value))),
            )
            if ids
        ]
        if gaps:
            raise ValueError(
                f"{source} cover layers {format_layer_ids(present)} but the full-attention layers of {model} are "
                f"{format_layer_ids(expected)} ({', '.join(f'{what} {format_layer_ids(ids)}' for what, ids in gaps)})"
            )

    def check_fits(self, config: PretrainedConfig, source: str = "the rotations") -> None:
        """:meth:`check_model` against the model of ``config`` (a model's or its text config's)."""
        text = config.get_text_config(decoder=True)
        name = str(getattr(config, "_name_or_path", "") or "") or "this model"
        self.check_model(head_dim_of(text), full_attention_layer_ids(config), kv_heads_of(text), name, source)


def check_feedback_factor(factor: torch.Tensor, head_dim: int, what: str) -> torch.Tensor:
    """``factor`` as float32 if it is a feedback factor for ``head_dim`` (``[D, D]`` or ``[H_kv, D, D]``, finite,
    upper triangular with a unit diagonal, as :func:`oscar_hf.quant.feedback_factor` makes them); else raise."""
    if factor.ndim not in (2, 3) or tuple(factor.shape[-2:]) != (head_dim, head_dim):
        raise ValueError(
            f"{what} has shape {tuple(factor.shape)}, expected ({head_dim}, {head_dim}) or "
            f"(kv_heads, {head_dim}, {head_dim})"
        )
    factor = factor.to(torch.float32)
    unit = bool((factor.diagonal(dim1=-2, dim2=-1) == 1).all()) and not factor.tril(-1).any()
    if not (torch.isfinite(factor).all() and unit):
        raise ValueError(f"{what} must be finite and upper triangular with ones on its diagonal")
    return factor


def format_layer_ids(ids: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"[0-3, 7]"``: readable for 36- or 92-layer models."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "[" + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs) + "]"


def own_kv_heads(rotations: RotationSet, model: PretrainedConfig | PreTrainedModel, kv_heads: int) -> RotationSet:
    """Under tensor parallelism, the per-head rotations and key means of this rank's KV heads (transformers' colwise
    k_proj/v_proj give rank r the contiguous heads ``r * H / W .. (r + 1) * H / W - 1``)."""
    parallel = tensor_parallel_rank(model) if isinstance(model, PreTrainedModel) else None
    if parallel is None or rotations.kv_heads is None:
        return rotations
    rank, size = parallel
    if kv_heads % size:
        raise ValueError(f"per-head rotations need the {kv_heads} KV heads split evenly over {size} ranks")
    local = kv_heads // size
    return rotations.select_kv_heads(rank * local, (rank + 1) * local)


# What an evaluation of several methods takes: one set for every method, or each method's own set
# (the bundled sets differ by recipe), or None for methods without calibrated rotations.
MethodRotations = RotationSet | Mapping[str, RotationSet] | None


def rotations_for(rotations: MethodRotations, method: str) -> RotationSet | None:
    """``rotations`` itself, or its entry for ``method`` where it maps methods to their sets."""
    if isinstance(rotations, Mapping):
        return rotations.get(method)
    return rotations
