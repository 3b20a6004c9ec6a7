"""Fused write path: clip, quantize and pack rotated K/V rows into the cache layout in one kernel.

One program loads ``BLOCK_N`` rows ``[BLOCK_N, D]`` in float32 and does, in registers, exactly what
:func:`oscar_hf.quant.quantize` does in torch:

1. clip each row at the order statistic ``sort(|row|)[floor(ratio * D)]`` (an exact bisection);
2. per group of ``G`` channels, min/max (or max|x| when symmetric) -> float scale and zero-point;
3. ``code = floor(x / scale + zero + 0.5)`` clamped to ``[0, 2^bits - 1]``;
4. pack ``8 / bits`` codes per byte, byte ``c`` holding dims ``c, c + D/k, ...`` from the low bits up;
5. store the codes and the scale/zero cast to the metadata dtype.

Codes are bit-exact against the torch reference on the same device: the kernel uses the same float32
operations in the same order. Tensor-by-tensor divisions are ``div_rn`` (IEEE round-to-nearest, what
torch computes; a plain ``/`` in compiled Triton is an approximate division on NVIDIA GPUs), and the
division of the range by ``2^bits - 1`` follows torch's device-dependent rule (see the kernel).
There is no multiply followed by an add, so no FMA contraction can change a rounding either.
"""

from __future__ import annotations

import sys

import torch

from oscar_hf.quant import QuantizedRows, check_bits, clip_index, quantize

from ._triton import INTERPRET, define_op, is_power_of_two, op_or_launcher, runs_triton, tl, to_dtype, triton

# ------------------------------------------------------------------------------------------ kernel


@triton.jit
def _order_statistic(magnitudes, INDEX: tl.constexpr):
    """Per row, the ``INDEX``-th smallest of non-negative floats ``[BLOCK_N, D]``, exactly.

    Non-negative floats order like their bit patterns, so a binary search over the int32 pattern
    finds the smallest ``v`` with ``#{x <= v} > INDEX``, which is ``sort(row)[INDEX]``. 31 steps of
    compare-and-count: cheaper than ``tl.sort`` (a bitonic network) and much faster in the interpreter.
    """
    bits = magnitudes.to(tl.int32, bitcast=True)
    low = tl.zeros((magnitudes.shape[0],), dtype=tl.int32)
    high = tl.max(bits, axis=1)
    for _ in tl.static_range(31):
        mid = low + (high - low) // 2
        enough = tl.sum((bits <= mid[:, None]).to(tl.int32), axis=1) > INDEX
        high = tl.where(enough, mid, high)
        low = tl.where(enough, low, mid + 1)
    return high.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_pack_kernel(
    X, CODES, SCALE, ZERO,
    n_rows, stride_x, stride_codes, stride_meta,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
    CLIP_INDEX: tl.constexpr, BLOCK_N: tl.constexpr, RECIPROCAL: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    NG: tl.constexpr = D // G
    PER_BYTE: tl.constexpr = 8 // BITS
    DP: tl.constexpr = D // PER_BYTE
    LEVELS: tl.constexpr = (1 << BITS) - 1

    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < n_rows
    dims = tl.arange(0, D)
    x = tl.load(X + rows[:, None] * stride_x + dims[None, :], mask=valid[:, None], other=0.0).to(tl.float32)

    if CLIP_INDEX >= 0:
        # The threshold is the CLIP_INDEX-th smallest |x| of the whole row (not per group).
        threshold = _order_statistic(tl.abs(x), CLIP_INDEX)[:, None]
        x = tl.minimum(tl.maximum(x, -threshold), threshold)

    groups = tl.reshape(x, (BLOCK_N, NG, G))
    if SYMMETRIC:
        low = tl.zeros((BLOCK_N, NG), tl.float32)
        span = tl.maximum(2.0 * tl.max(tl.abs(groups), axis=2), 1e-8)
    else:
        low = tl.min(groups, axis=2)
        span = tl.maximum(tl.max(groups, axis=2) - low, 1e-8)
    # torch divides a tensor by a Python number as a true division on CPU but as a multiply by the
    # float32 reciprocal on CUDA (at times one ulp apart): do what torch does on the same device.
    if RECIPROCAL:
        scale = span * (1.0 / LEVELS)
    else:
        scale = tl.math.div_rn(span, LEVELS * 1.0)
    if SYMMETRIC:
        zero = tl.full((BLOCK_N, NG), LEVELS / 2, tl.float32)
    else:
        zero = tl.math.div_rn(-low, scale)

    # Three separately rounded float32 steps, as torch evaluates `groups / scale + zero + 0.5`.
    codes = tl.math.div_rn(groups, scale[:, :, None]) + zero[:, :, None]
    codes = tl.floor(codes + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS * 1.0).to(tl.int32)

    # Row-major reshape puts dim j * DP + c at [j, c]: summing the shifted parts over j packs byte c.
    parts = tl.reshape(codes, (BLOCK_N, PER_BYTE, DP))
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(parts << shifts[None, :, None], axis=1).to(tl.uint8)
    tl.store(CODES + rows[:, None] * stride_codes + tl.arange(0, DP)[None, :], packed, mask=valid[:, None])

    meta = rows[:, None] * stride_meta + tl.arange(0, NG)[None, :]
    tl.store(SCALE + meta, to_dtype(scale, SCALE.dtype.element_ty, INTERPRETED), mask=valid[:, None])
    tl.store(ZERO + meta, to_dtype(zero, ZERO.dtype.element_ty, INTERPRETED), mask=valid[:, None])


def _block_rows(head_dim: int) -> int:
    # About 2K float32 values per program (untuned): a few rows per program, few registers per thread.
    return max(1, min(16, 2048 // head_dim))


def quantize_pack_triton(
    rows: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    clip_ratio: float,
    metadata_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel on ``rows [N, D]``; returns ``(codes [N, D*bits/8], scale [N, D/G], zero [N, D/G])``."""
    n_rows, head_dim = rows.shape
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    codes = torch.empty(n_rows, head_dim * bits // 8, dtype=torch.uint8, device=rows.device)
    scale = torch.empty(n_rows, head_dim // group_size, dtype=metadata_dtype, device=rows.device)
    zero = torch.empty_like(scale)
    if n_rows == 0:
        return codes, scale, zero
    block = _block_rows(head_dim)
    _quantize_pack_kernel[(triton.cdiv(n_rows, block),)](
        rows, codes, scale, zero,
        n_rows, rows.stride(0), codes.stride(0), scale.stride(0),
        D=head_dim, G=group_size, BITS=bits, SYMMETRIC=symmetric,
        CLIP_INDEX=clip_index(clip_ratio, head_dim) if clip_ratio > 0 else -1, BLOCK_N=block,
        RECIPROCAL=rows.is_cuda and not INTERPRET, INTERPRETED=INTERPRET,
    )  # fmt: skip
    return codes, scale, zero


# -------------------------------------------------------------------------------- torch reference


# The torch reference and CPU fallback is the library's quantizer itself, same signature and results.
quantize_pack_reference = quantize


# ------------------------------------------------------------------------------------ custom op


def _quantize_pack_op(
    rows: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    clip_ratio: float,
    metadata_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Looked up through sys.modules: an op is defined once per process, and a re-import of this
    # module (the tests do one to switch to the interpreter) must reach the re-imported kernel.
    launch = sys.modules[__name__].quantize_pack_triton
    return launch(rows, bits, group_size, symmetric, clip_ratio, metadata_dtype)


def _quantize_pack_fake(rows, bits, group_size, symmetric, clip_ratio, metadata_dtype):
    n_rows, head_dim = rows.shape
    codes = rows.new_empty(n_rows, head_dim * bits // 8, dtype=torch.uint8)
    scale = rows.new_empty(n_rows, head_dim // group_size, dtype=metadata_dtype)
    return codes, scale, torch.empty_like(scale)


define_op("oscar::quantize_pack", _quantize_pack_op, _quantize_pack_fake)


# ----------------------------------------------------------------------------------- dispatcher


def kernel_supports_quantize(head_dim: int, group_size: int) -> bool:
    """The kernel reshapes register tiles, which Triton allows for power-of-two sizes only."""
    return is_power_of_two(head_dim) and head_dim >= 16 and is_power_of_two(group_size)


def quantize_pack(
    rows: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    symmetric: bool = False,
    clip_ratio: float = 0.0,
    metadata_dtype: torch.dtype = torch.bfloat16,
) -> QuantizedRows:
    """Clip, quantize and pack ``rows [..., D]``: a drop-in for :func:`oscar_hf.quant.quantize`.

    Runs the Triton kernel when :func:`~._triton.runs_triton` says so and the shape is supported,
    else the torch reference; both give identical codes and scale/zero.
    """
    check_bits(bits)
    head_dim = rows.shape[-1]
    if head_dim % group_size:
        raise ValueError(f"group_size {group_size} must divide head_dim {head_dim}")
    if clip_ratio > 1:  # as oscar_hf.quant.clip_rows: a ratio <= 0 disables clipping
        raise ValueError(f"clip ratio must be in [0, 1], got {clip_ratio}")
    if not (runs_triton(rows) and kernel_supports_quantize(head_dim, group_size)):
        return quantize_pack_reference(
            rows, bits, group_size, symmetric=symmetric, clip_ratio=clip_ratio, metadata_dtype=metadata_dtype
        )
    lead = rows.shape[:-1]
    launch = op_or_launcher(torch.ops.oscar.quantize_pack, quantize_pack_triton)
    codes, scale, zero = launch(
        rows.reshape(-1, head_dim), bits, group_size, symmetric, float(clip_ratio), metadata_dtype
    )
    return QuantizedRows(*(t.view(*lead, t.shape[-1]) for t in (codes, scale, zero)))
