"""Fused write path: clip, quantize and pack rotated K/V rows into the cache layout in one kernel (many
tensors in one launch: :mod:`.quantize_many`).

One program loads ``BLOCK_N`` rows ``[BLOCK_N, D]`` in float32 and does, in registers, exactly what
:func:`oscar_hf.quant.quantize` does in torch:

1. clip each row at the order statistic ``sort(|row|)[floor(ratio * D)]``, found exactly (by peeling
   off the largest magnitudes when few lie above it, as with the usual ratios 0.92-0.96, else by
   bisection);
2. per group of ``G`` channels, min/max (or max|x| when symmetric) -> float scale and zero-point;
3. ``code = floor(x / scale + zero + 0.5)`` clamped to ``[0, 2^bits - 1]``; 1-bit rows instead take
   the group's mean and deviation as pairwise sums in the reference's order (:func:`_tree_sum`),
   ``scale = 1.596 sigma``, ``zero = 0.5 - mu / scale`` and ``code = x >= mu``;
4. pack ``8 / bits`` codes per byte, byte ``c`` holding dims ``c, c + D/k, ...`` from the low bits up
   (3-bit codes: their low two bits so, then their high bits as a 1-bit plane, see :func:`oscar_hf.quant.pack`);
5. store the codes and the scale/zero cast to the metadata dtype.

Codes are bit-exact against the torch reference on the same device: the kernel uses the same float32
operations in the same order. Tensor-by-tensor divisions are ``div_rn`` (IEEE round-to-nearest, what
torch computes; a plain ``/`` in compiled Triton is an approximate division on NVIDIA GPUs), and the
division of the range by ``2^bits - 1`` follows torch's device-dependent rule (see the kernel).
There is no multiply followed by an add, so no FMA contraction can change a rounding either, except
in the 1-bit deviation's sum of squares: those launches turn FMA contraction off (``enable_fp_fusion``),
and the square root is the correctly rounded ``sqrt_rn``.
"""

from __future__ import annotations

import sys

import torch

from oscar_hf.quant import (
    QuantizedRows,
    check_bits,
    check_feedback,
    check_symmetric,
    clip_index,
    quantize,
)

from ._triton import (
    INTERPRET,
    cdiv,
    define_op,
    launch_kernel,
    op_or_launcher,
    runs_triton,
    tl,
    triton,
)
from .quantize_many import quantize_pack_into
from .quantize_tile import (
    NUM_WARPS,
    exact_launch,
    kernel_supports_quantize,
    quantize_tile,
    rows_per_program,
    store_tile,
)

# ------------------------------------------------------------------------------------------ kernel


@triton.jit
def _quantize_pack_kernel(
    X,
    CODES,
    SCALE,
    ZERO,
    n_rows,
    stride_x,
    stride_codes,
    stride_meta,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < n_rows
    x = tl.load(X + rows[:, None] * stride_x + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    packed, high, scale, zero = quantize_tile(
        x.to(tl.float32),
        CLIP_INDEX,
        X,
        BLOCK_N,
        D,
        G,
        BITS,
        SYMMETRIC,
        RECIPROCAL,
        False,
        SCALE.dtype.element_ty,
        INTERPRETED,
    )
    store_tile(
        packed,
        high,
        scale,
        zero,
        CODES + rows[:, None] * stride_codes,
        SCALE + rows[:, None] * stride_meta,
        ZERO + rows[:, None] * stride_meta,
        valid,
        D,
        G,
        BITS,
        INTERPRETED,
    )


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
    block = rows_per_program(head_dim)
    launch_kernel(
        _quantize_pack_kernel,
        (cdiv(n_rows, block),),
        rows,
        codes,
        scale,
        zero,
        n_rows,
        rows.stride(0),
        codes.stride(0),
        scale.stride(0),
        D=head_dim,
        G=group_size,
        BITS=bits,
        SYMMETRIC=symmetric,
        CLIP_INDEX=clip_index(clip_ratio, head_dim) if clip_ratio > 0 else -1,
        BLOCK_N=block,
        RECIPROCAL=rows.is_cuda and not INTERPRET,
        INTERPRETED=INTERPRET,
        num_warps=NUM_WARPS,
        **exact_launch(bits),
    )
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


def quantize_pack(
    rows: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    symmetric: bool = False,
    clip_ratio: float = 0.0,
    metadata_dtype: torch.dtype = torch.bfloat16,
    feedback: torch.Tensor | None = None,
) -> QuantizedRows:
    """Clip, quantize and pack ``rows [..., D]``: a drop-in for :func:`oscar_hf.quant.quantize`.

    Runs the Triton kernel when :func:`~._triton.runs_triton` says so and the shape is supported,
    else the torch reference; both give identical codes and scale/zero.
    """
    check_bits(bits)
    check_symmetric(bits, symmetric)
    head_dim = rows.shape[-1]
    if head_dim % group_size:
        raise ValueError(f"group_size {group_size} must divide head_dim {head_dim}")
    if clip_ratio > 1:  # as oscar_hf.quant.clip_rows: a ratio <= 0 disables clipping
        raise ValueError(f"clip ratio must be in [0, 1], got {clip_ratio}")
    if not (runs_triton(rows) and kernel_supports_quantize(head_dim, group_size)):
        return quantize_pack_reference(
            rows,
            bits,
            group_size,
            symmetric=symmetric,
            clip_ratio=clip_ratio,
            metadata_dtype=metadata_dtype,
            feedback=feedback,
        )
    if feedback is not None:
        return _quantize_pack_with_feedback(rows, bits, group_size, symmetric, clip_ratio, metadata_dtype, feedback)
    lead = rows.shape[:-1]
    launch = op_or_launcher(torch.ops.oscar.quantize_pack, quantize_pack_triton)
    codes, scale, zero = launch(
        rows.reshape(-1, head_dim), bits, group_size, symmetric, float(clip_ratio), metadata_dtype
    )
    return QuantizedRows(*(t.view(*lead, t.shape[-1]) for t in (codes, scale, zero)))


def _quantize_pack_with_feedback(
    rows: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    clip_ratio: float,
    metadata_dtype: torch.dtype,
    feedback: torch.Tensor,
) -> QuantizedRows:
    """:func:`quantize_pack` with a feedback factor: one job of :func:`quantize_pack_into` over ``rows [..., H, n, D]``
    seen as ``[B, H, n, D]`` (per-head factor) or ``[1, 1, N, D]`` (shared)."""
    check_feedback(feedback, rows, bits)
    head_dim = rows.shape[-1]
    batched = rows.reshape(-1, *rows.shape[-3:]) if feedback.ndim == 3 else rows.reshape(1, 1, -1, head_dim)
    target = QuantizedRows(
        batched.new_empty(*batched.shape[:3], head_dim * bits // 8, dtype=torch.uint8),
        batched.new_empty(*batched.shape[:3], head_dim // group_size, dtype=metadata_dtype),
        batched.new_empty(*batched.shape[:3], head_dim // group_size, dtype=metadata_dtype),
    )
    quantize_pack_into(
        [batched.contiguous()],
        [target],
        bits,
        group_size,
        symmetric=symmetric,
        clip_ratios=[clip_ratio],
        metadata_dtype=metadata_dtype,
        feedback=[feedback],
    )
    lead = rows.shape[:-1]
    return QuantizedRows(*(t.view(*lead, t.shape[-1]) for t in (target.codes, target.scale, target.zero)))
