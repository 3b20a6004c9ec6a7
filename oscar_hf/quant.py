"""Quantization math for rotated K/V rows: clipping, per-token asymmetric/symmetric quantization, packing.

A *row* is one token of one KV head, ``head_dim`` values. Each row is split into groups of
``group_size`` channels with one (scale, zero) pair per group, as in the reference
implementation (github.com/FutureMLS-Lab/OSCAR, its INT2 flush kernel):

    scale = max(max - min, 1e-8) / (2^bits - 1)
    zero  = -min / scale                      # a float zero-point, never rounded
    code  = floor(x / scale + zero + 0.5)     # round half up
    x_hat = (code - zero) * scale

Codes are computed with float32 scale/zero and stored with 16-bit metadata by default, as the
reference's decode kernel reads them.

1-bit rows use two levels ``mu +- sqrt(2/pi) sigma`` per group (the 1-bit Lloyd-Max quantizer of a
Gaussian; min-max levels at 1 bit would sit at the extremes), stored as the same affine metadata so
that ``(code - zero) * scale`` still dequantizes them:

    scale = max(SIGMA_STRETCH * sigma, 1e-8)  # SIGMA_STRETCH = 2 sqrt(2/pi) ~ 1.596
    zero  = 0.5 - mu / scale
    code  = x >= mu

``mu`` and ``sigma`` (population) come from pairwise sums in a fixed order (:func:`tree_sum`) and a
correctly rounded square root, so the Triton write kernel reproduces them bit for bit.

With a *feedback factor* ``W`` (:func:`feedback_factor`), codes are chosen one channel at a time on the
stored grid (the scale and zero-point rounded to the metadata dtype) and each channel's error is fed
forward into the channels after it, ``x[j+1:] -= (x_j - x_hat_j) W[j, j+1:]``: GPTQ's update (Frantar
et al., 2023, arXiv:2210.17323) with the rotated query covariance as its Hessian, so that errors cancel
in the scores ``q . k`` rather than in ``k`` itself. The grid is the one the rows would take without it.

1-, 2- and 4-bit codes pack ``8 / bits`` to a byte. 3-bit codes are stored as two bit planes, so that
kernels unpack them with the same column blocks as 2-bit codes: the low two bits in the 2-bit
layout (``D/4`` bytes), then the high bit in a 1-bit plane (``D/8`` bytes), ``3D/8`` bytes a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (1, 2, 3, 4)
SCALE_FLOOR = 1e-8
SIGMA_STRETCH = 1.596  # 2 sqrt(2/pi): 1-bit levels at mu +- 0.798 sigma


@dataclass
class QuantizedRows:
    """Packed codes ``uint8 [..., head_dim * bits / 8]`` with ``scale``/``zero`` ``[..., head_dim / group_size]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}: the cache quantizes to {SUPPORTED_BITS} bits")


def check_symmetric(bits: int, symmetric: bool) -> None:
    if symmetric and bits == 1:
        raise ValueError(
            "1-bit rows take levels around their mean (mu +- 0.798 sigma); symmetric quantization needs 2 bits or more"
        )


def pack_unit(bits: int) -> int:
    """Dims a packed row (and a quantization group) must be a multiple of: the codes of one byte,
    8 for 3-bit codes (one byte of their 1-bit plane)."""
    check_bits(bits)
    return 8 if bits == 3 else 8 // bits


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by halving: ``x[:n/2] + x[n/2:]`` until one column is left (any odd
    remainder summed last). A fixed order of float32 additions that a kernel can repeat exactly."""
    while x.shape[-1] > 1 and x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x.sum(-1) if x.shape[-1] > 1 else x[..., 0]


def sigma_levels(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-bit ``(codes, scale, zero)`` of float32 ``groups [..., G]``: levels ``mu +- scale / 2``."""
    size = groups.shape[-1]
    mu = tree_sum(groups) / size
    deviation = groups - mu[..., None]
    # The correctly rounded float32 root (what a kernel's sqrt_rn gives): torch's float32 sqrt on CPU is
    # not, one ulp off for some inputs; the float64 root rounded to float32 is.
    sigma = torch.sqrt((tree_sum(deviation * deviation) / size).double()).float()
    scale = torch.clamp(sigma * SIGMA_STRETCH, min=SCALE_FLOOR)
    zero = 0.5 - mu / scale
    return (groups >= mu[..., None]).float(), scale, zero


def clip_index(ratio: float, head_dim: int) -> int:
    """Index of the order statistic used as the clip threshold: floor(ratio * D), clamped to [0, D-1]."""
    return min(max(math.floor(ratio * head_dim), 0), head_dim - 1)


def clip_rows(rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp each row symmetrically at ``sort(|row|)[floor(ratio * D)]``; a ratio <= 0 disables clipping.

    The threshold is an order statistic over the whole row (not per group, no interpolation), which
    is what the reference's prefill kernel and its unit test use.
    """
    if ratio <= 0:
        return rows
    if ratio > 1:
        raise ValueError(f"clip ratio must be in [0, 1], got {ratio}")
    k = clip_index(ratio, rows.shape[-1]) + 1  # kthvalue is 1-based
    threshold = rows.abs().kthvalue(k, dim=-1, keepdim=True).values
    return torch.minimum(torch.maximum(rows, -threshold), threshold)


def feedback_factor(hessian: torch.Tensor, damping: float = 0.01) -> torch.Tensor:
    """The feedback factor of a quantizer whose error ``e`` costs ``e H e^T`` (``hessian [..., D, D]``,
    symmetric positive semi-definite): the upper Cholesky factor ``U`` of ``(H + lambda I)^-1`` with each
    row divided by its diagonal, so ``W[j, j] = 1`` (``lambda`` is ``damping`` times the mean diagonal)."""
    if hessian.shape[-1] != hessian.shape[-2]:
        raise ValueError(f"a Hessian is square, got {tuple(hessian.shape)}")
    hessian = hessian.double()
    eye = torch.eye(hessian.shape[-1], dtype=torch.float64, device=hessian.device)
    scale = hessian.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    damped = hessian + damping * scale * eye
    upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    return (upper / upper.diagonal(dim1=-2, dim2=-1)[..., None]).float().contiguous()  # the kernels read it row-major


def check_feedback(feedback: torch.Tensor, rows: torch.Tensor, bits: int) -> None:
    """Raise unless ``feedback`` (``[D, D]`` or ``[H, D, D]`` for rows ``[..., H, n, D]``) fits ``bits``-bit rows."""
    if bits == 1:
        raise ValueError("1-bit rows take their levels from each group's mean and spread: they take no key feedback")
    dim = rows.shape[-1]
    heads = rows.shape[-3] if rows.ndim >= 3 else None
    if tuple(feedback.shape) not in ((dim, dim), (heads, dim, dim)):
        raise ValueError(
            f"a feedback factor of shape {tuple(feedback.shape)} does not fit rows {tuple(rows.shape)}: "
            f"it is ({dim}, {dim}) or (heads, {dim}, {dim}) for rows (..., heads, tokens, {dim})"
        )


def quantize(
    rows: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    symmetric: bool = False,
    clip_ratio: float = 0.0,
    metadata_dtype: torch.dtype = torch.bfloat16,
    feedback: torch.Tensor | None = None,
) -> QuantizedRows:
    """Clip, quantize per token and group, and pack ``rows [..., D]``.

    ``symmetric`` is the naive baseline: the grid is centred on zero (zero-point fixed at
    (2^bits - 1) / 2) and spans [-max|x|, max|x|]. 1-bit rows take the sigma levels (module docstring).
    ``feedback`` (``[D, D]``, or ``[H, D, D]`` for rows ``[..., H, n, D]``) feeds each channel's error
    forward (module docstring).
    """
    check_bits(bits)
    check_symmetric(bits, symmetric)
    head_dim = rows.shape[-1]
    if head_dim % group_size:
        raise ValueError(f"group_size {group_size} must divide head_dim {head_dim}")
    if feedback is not None:
        check_feedback(feedback, rows, bits)
    levels = 2**bits - 1
    groups = clip_rows(rows.float(), clip_ratio).unflatten(-1, (head_dim // group_size, group_size))
    if bits == 1:
        codes, scale, zero = sigma_levels(groups)
        packed = pack(codes.flatten(-2).to(torch.uint8), bits)
        return QuantizedRows(packed, scale.to(metadata_dtype), zero.to(metadata_dtype))
    if symmetric:
        amax = groups.abs().amax(dim=-1)
        scale = torch.clamp(2 * amax, min=SCALE_FLOOR) / levels
        zero = torch.full_like(scale, levels / 2)
    else:
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = torch.clamp(high - low, min=SCALE_FLOOR) / levels
        zero = -low / scale
    stored_scale, stored_zero = scale.to(metadata_dtype), zero.to(metadata_dtype)
    if feedback is None:
        codes = torch.floor(groups / scale[..., None] + zero[..., None] + 0.5).clamp_(0, levels).flatten(-2)
    else:
        codes = _feedback_codes(groups.flatten(-2), stored_scale.float(), stored_zero.float(), levels, feedback)
    return QuantizedRows(pack(codes.to(torch.uint8), bits), stored_scale, stored_zero)


def _feedback_codes(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int, feedback: torch.Tensor
) -> torch.Tensor:
    """Codes of float32 rows ``x [..., D]`` on the grid ``scale``/``zero`` ``[..., D/G]``, channel by channel,
    each channel's error fed forward with ``feedback``'s row (the write kernel repeats these operations)."""
    head_dim, group = x.shape[-1], x.shape[-1] // scale.shape[-1]
    factor = feedback.float() if feedback.ndim == 2 else feedback.float()[:, None]  # [H, 1, D, D]: rows [.., H, n, D]
    x, codes = x.clone(), torch.empty_like(x)
    for j in range(head_dim):
        s, z = scale[..., j // group], zero[..., j // group]
        code = torch.floor(x[..., j] / s + z + 0.5).clamp_(0, levels)
        codes[..., j] = code
        error = x[..., j] - (code - z) * s
        x[..., j + 1 :] -= error[..., None] * factor[..., j, j + 1 :]
    return codes


def dequantize(quantized: QuantizedRows, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize` (up to the rounding error): ``(code - zero) * scale``."""
    codes = unpack(quantized.codes, bits).float()
    groups = codes.unflatten(-1, (codes.shape[-1] // group_size, group_size))
    values = (groups - quantized.zero.float()[..., None]) * quantized.scale.float()[..., None]
    return values.flatten(-2).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes ``[..., D]`` into ``[..., D * bits / 8]`` bytes.

    For 1, 2 and 4 bits, byte ``c`` holds dims ``c, c + D/k, c + 2D/k, ...`` (k = 8 / bits codes per
    byte) from the low bits up: for INT2 that is the reference's "quartered" layout, which lets a
    kernel unpack k contiguous ``[N, D/k]`` tiles. 3-bit codes are the 2-bit plane of their low bits
    in that layout followed by the 1-bit plane of their high bits (byte ``c`` holding dims ``c,
    c + D/8, ..., c + 7D/8``): ``code = low + 4 * high``.
    """
    unit = pack_unit(bits)
    if codes.shape[-1] % unit:
        raise ValueError(f"head_dim {codes.shape[-1]} is not a multiple of {unit}")
    if bits == 3:
        return torch.cat([_pack_plane(codes & 3, 2), _pack_plane(codes >> 2, 1)], dim=-1)
    return _pack_plane(codes, bits)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., D * bits / 8]`` bytes to ``uint8`` codes ``[..., D]``."""
    check_bits(bits)
    if bits == 3:
        low, high = packed.split([packed.shape[-1] * 2 // 3, packed.shape[-1] // 3], dim=-1)
        return _unpack_plane(low, 2) | (_unpack_plane(high, 1) << 2)
    return _unpack_plane(packed, bits)


def _pack_plane(codes: torch.Tensor, width: int) -> torch.Tensor:
    """``width``-bit codes ``[..., D]``, ``8 / width`` to a byte: byte ``c`` holds dims ``c, c + D/k, ...``."""
    per_byte = 8 // width
    parts = codes.unflatten(-1, (per_byte, codes.shape[-1] // per_byte))
    packed = parts[..., 0, :].clone()
    for j in range(1, per_byte):
        packed |= parts[..., j, :] << (width * j)
    return packed


def _unpack_plane(packed: torch.Tensor, width: int) -> torch.Tensor:
    mask = 2**width - 1
    return torch.cat([(packed >> (width * j)) & mask for j in range(8 // width)], dim=-1)
