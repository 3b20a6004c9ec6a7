"""Rotating a decode step's few rows, ``out = rows @ R``, up to three jobs in one launch.

An eager decode step rotates q and the new K by R_K and the new V by R_V, and maps the attention
output back by R_V^T. As cuBLAS calls these four small products cost far more host time than GPU
time (aten::mm ~60 us of host time each on the H200's host, against ~20 us for the model's own
GEMMs: ``kernels/measurements/profile_decode.json``), and two more copies put the new K/V into the recent
window. :func:`rotate_rows` does q, K and V in one launch and writes each result where it belongs,
the new K/V straight into the window's next row.

Rows are ``[B, H, D]`` or ``[B, H, 1, D]``: row ``(b, h)`` starts at ``b * stride(0) + h * stride(1)``
and its dims are contiguous, so transposed projections and slices of the cache's buffers are read and
written in place. Products accumulate in float32 and are rounded once to the output's dtype, as
torch's 16-bit matmuls are; the sums may run in another order, so a result can differ from torch's
in its last bit. The rotation may be any strided ``[D, D]`` view (``R.T`` included), shared by all
rows, or ``[H_r, D, D]``, one per KV head: row ``(b, h)`` then uses ``R[h // (H / H_r)]`` (contiguous
GQA groups, so the query rows of a KV head use its R_K). Row blocks never straddle two rotations,
so each program still loads one ``[D, BLOCK_COLUMNS]`` tile of R. A job may also subtract a row
``center`` (``[D]``, or ``[H, D]`` one per head of its rows) from its products, ``out = rows @ R - center``,
in float32 before the one rounding: a layer's key centering then costs no launch of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton import (
    INTERPRET,
    cdiv,
    dot,
    is_power_of_two,
    launch_kernel,
    programmatic_launch,
    runs_triton,
    tl,
    to_dtype,
    triton,
)

# (rows, rotation [D, D] or [H_r, D, D], out[, center [D] or [H, D]])
RotateJob = tuple[torch.Tensor, ...]

_BLOCK_ROWS = 16  # the smallest M of an MMA
_BLOCK_COLUMNS = 64  # output dims a program: R's [D, 64] tile stays small at D = 256
_MAX_JOBS = 3


@triton.jit
def _rotate_block(
    X,
    x_strides,
    Y,
    y_strides,
    R,
    r_strides,
    shape,
    C,
    c_stride,
    block,
    column,
    D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLUMNS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    CENTERED: tl.constexpr,
):
    """``BLOCK_ROWS`` rows of one job, output dims ``column * BLOCK_COLUMNS ...``; ``CENTERED``: minus
    the head's row of ``C`` (``c_stride`` apart, 0 for one row shared by all heads).

    ``shape`` = (group, rows, blocks): each rotation serves ``group`` consecutive heads, whose
    ``rows`` = batch x group rows take ``blocks`` row blocks, one rotation's blocks after another's
    (a shared rotation: group = all heads, and its stride over rotations is 0)."""
    group, rows, blocks = shape
    rotation_index = block // blocks
    row = (block % blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = row < rows
    batch, head = row // group, rotation_index * group + row % group
    dims = tl.arange(0, D)
    x = tl.load(X + (batch * x_strides[0] + head * x_strides[1])[:, None] + dims[None, :], mask=valid[:, None])
    columns = column * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    R += rotation_index * r_strides[0]
    rotation = tl.load(R + dims[:, None] * r_strides[1] + columns[None, :] * r_strides[2])
    out = dot(x, rotation, INTERPRETED)
    if CENTERED:
        out -= tl.load(C + head[:, None] * c_stride + columns[None, :], mask=valid[:, None]).to(tl.float32)
    pointers = Y + (batch * y_strides[0] + head * y_strides[1])[:, None] + columns[None, :]
    tl.store(pointers, to_dtype(out, Y.dtype.element_ty, INTERPRETED), mask=valid[:, None])


@triton.jit
def _rotate_kernel(
    X0,
    x0_strides,
    Y0,
    y0_strides,
    R0,
    r0_strides,
    shape0,
    C0,
    c0_stride,
    blocks0,
    X1,
    x1_strides,
    Y1,
    y1_strides,
    R1,
    r1_strides,
    shape1,
    C1,
    c1_stride,
    blocks1,
    X2,
    x2_strides,
    Y2,
    y2_strides,
    R2,
    r2_strides,
    shape2,
    C2,
    c2_stride,
    D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLUMNS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    CENTERED: tl.constexpr,
):
    """Program ``(row block, column block)``; the row blocks of job 0 come first, then job 1's, then job 2's.
    ``LAUNCH_DEPENDENTS`` (Hopper): a next kernel launched programmatically (decode attention's history
    span) may start now; it waits for this grid before it reads what this one writes. ``CENTERED``: bit
    ``i`` set where job ``i`` subtracts its center."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    block, column = tl.program_id(0), tl.program_id(1)
    if block < blocks0:
        _rotate_block(
            X0,
            x0_strides,
            Y0,
            y0_strides,
            R0,
            r0_strides,
            shape0,
            C0,
            c0_stride,
            block,
            column,
            D,
            BLOCK_ROWS,
            BLOCK_COLUMNS,
            INTERPRETED,
            (CENTERED >> 0) & 1,
        )
    elif block < blocks0 + blocks1:
        _rotate_block(
            X1,
            x1_strides,
            Y1,
            y1_strides,
            R1,
            r1_strides,
            shape1,
            C1,
            c1_stride,
            block - blocks0,
            column,
            D,
            BLOCK_ROWS,
            BLOCK_COLUMNS,
            INTERPRETED,
            (CENTERED >> 1) & 1,
        )
    else:
        _rotate_block(
            X2,
            x2_strides,
            Y2,
            y2_strides,
            R2,
            r2_strides,
            shape2,
            C2,
            c2_stride,
            block - blocks0 - blocks1,
            column,
            D,
            BLOCK_ROWS,
            BLOCK_COLUMNS,
            INTERPRETED,
            (CENTERED >> 2) & 1,
        )


def rotate_rows(jobs: Sequence[RotateJob]) -> None:
    """``out = rows @ rotation`` for each of 1 to 3 jobs: one Triton launch on a GPU (and under
    ``TRITON_INTERPRET=1``), :func:`rotate_rows_reference` elsewhere and for head dims the kernel does
    not cover (not a power of two, or below 16).

    Raises:
        ValueError: more than three jobs, or rows, rotations and outputs that do not fit together.
    """
    if not 1 <= len(jobs) <= _MAX_JOBS:
        raise ValueError(f"rotate_rows takes 1 to {_MAX_JOBS} jobs, got {len(jobs)}")
    arguments, blocks, centered = [], 0, 0
    for index, (rows, rotation, out, *center) in enumerate(jobs):  # one pass: host time counts here
        rows_strides, out_strides = rows.stride(), out.stride()
        _check_job(rows, rotation, out, rows_strides[-1], out_strides[-1])
        center = center[0] if center else None
        batch, heads = rows.shape[0], rows.shape[1]
        if rotation.ndim == 2:
            rotations, rotation_strides = 1, (0, *rotation.stride())
        else:
            rotations, rotation_strides = rotation.shape[0], rotation.stride()
        group = heads // rotations
        if center is not None:
            _check_center(center, rows)
            centered |= 1 << index
        rotation_blocks = cdiv(batch * group, _BLOCK_ROWS)
        job_blocks = rotations * rotation_blocks
        arguments += [
            rows,
            rows_strides[:2],
            out,
            out_strides[:2],
            rotation,
            rotation_strides,
            (group, batch * group, rotation_blocks),
            rows if center is None else center,
            0 if center is None or center.ndim == 1 else center.stride(0),
            job_blocks,
        ]
        blocks += job_blocks
    head_dim = jobs[0][0].shape[-1]
    if not (runs_triton(jobs[0][0]) and is_power_of_two(head_dim) and head_dim >= 16):
        rotate_rows_reference(jobs)
        return
    unused = arguments[:9] + [0]  # jobs beyond the given ones: job 0's tensors, no row blocks
    arguments += unused * (_MAX_JOBS - len(jobs))
    del arguments[-1]  # the last job's block count is implied
    columns = min(head_dim, _BLOCK_COLUMNS)
    launch_kernel(
        _rotate_kernel,
        (blocks, head_dim // columns),
        *arguments,
        D=head_dim,
        BLOCK_ROWS=_BLOCK_ROWS,
        BLOCK_COLUMNS=columns,
        INTERPRETED=INTERPRET,
        LAUNCH_DEPENDENTS=programmatic_launch(jobs[0][0].device),
        CENTERED=centered,
    )


def rotate_rows_reference(jobs: Sequence[RotateJob]) -> None:
    """The torch reference of :func:`rotate_rows`: one matmul (and subtraction) and one copy a job."""
    for rows, rotation, out, *center in jobs:
        heads = rows.shape[1]
        if rotation.ndim == 3:  # [B, H, D] rows as [B, H, 1, D], each head times its KV head's R
            rotation = rotation.repeat_interleave(heads // rotation.shape[0], dim=0)
            rows = rows.reshape(rows.shape[0], heads, 1, rows.shape[-1])
        if not center:
            out.copy_((rows @ rotation).view(out.shape))
            continue
        # the kernel subtracts in float32 and rounds once
        product = (rows.float() @ rotation.float()).reshape(rows.shape[0], heads, -1) - center[0].float()
        out.copy_(product.to(out.dtype).view(out.shape))


def _check_job(rows: torch.Tensor, rotation: torch.Tensor, out: torch.Tensor, rows_step: int, out_step: int) -> None:
    batch, heads, head_dim = rows.shape[0], rows.shape[1], rows.shape[-1]
    if (
        rows.numel() != batch * heads * head_dim
        or out.numel() != rows.numel()
        or out.shape[:2] != rows.shape[:2]
        or out.shape[-1] != head_dim
    ):
        raise ValueError(
            f"rows {tuple(rows.shape)} and out {tuple(out.shape)} must both be [B, H, D] or "
            "[B, H, 1, D] of the same B, H, D"
        )
    shape_ok = rotation.shape[-2:] == (head_dim, head_dim) and (
        rotation.ndim == 2 or (rotation.ndim == 3 and heads % rotation.shape[0] == 0)
    )
    if not shape_ok or rotation.dtype != rows.dtype or rotation.device != rows.device:
        raise ValueError(
            f"rotation {tuple(rotation.shape)} {rotation.dtype} on {rotation.device} does not "
            f"match rows of {heads} heads of {head_dim} dims, {rows.dtype} on {rows.device} (a rotation "
            "is [D, D] or [H_r, D, D] with H_r dividing the heads)"
        )
    if rows_step != 1 or out_step != 1 or out.dtype != rows.dtype:
        raise ValueError("rows and out need contiguous dims and one dtype")


def _check_center(center: torch.Tensor, rows: torch.Tensor) -> None:
    heads, head_dim = rows.shape[1], rows.shape[-1]
    if center.shape not in ((head_dim,), (heads, head_dim)) or center.stride(-1) != 1:
        raise ValueError(
            f"center {tuple(center.shape)} must be [D] or [H, D] with contiguous dims, for rows of {heads} "
            f"heads of {head_dim} dims"
        )
    if center.dtype != rows.dtype or center.device != rows.device:
        raise ValueError(f"center {center.dtype} on {center.device} must match rows ({rows.dtype} on {rows.device})")
