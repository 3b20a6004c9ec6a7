"""Fused write path: clip, quantize and pack rotated K/V rows into the cache layout in one kernel.

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

from oscar_hf.quant import SCALE_FLOOR, SIGMA_STRETCH, QuantizedRows, check_bits, check_symmetric, clip_index, quantize

from ._triton import (
    HAS_TRITON,
    INTERPRET,
    cdiv,
    define_op,
    is_power_of_two,
    launch_kernel,
    op_or_launcher,
    runs_triton,
    tl,
    to_dtype,
    triton,
)

# ------------------------------------------------------------------------------------------ kernel

_STRETCH = tl.constexpr(SIGMA_STRETCH)
_FLOOR = tl.constexpr(SCALE_FLOOR)


@triton.jit
def _tree_sum(x, BLOCK_N: tl.constexpr, NG: tl.constexpr, G: tl.constexpr):
    """Sums over the last dim of ``[BLOCK_N, NG, G]`` (G a power of two) by halving, in the order of
    :func:`oscar_hf.quant.tree_sum`: each step adds column ``c`` and ``c + width/2`` (a sum of two
    floats, exact whatever the reduction's order)."""
    for step in tl.static_range(1, 16):  # groups of up to 2^15 channels
        if (G >> step) > 0:
            x = tl.sum(tl.reshape(x, (BLOCK_N, NG, 2, G >> step)), axis=2)
    return tl.reshape(x, (BLOCK_N, NG))


@triton.jit
def _sigma_levels(groups, BLOCK_N: tl.constexpr, NG: tl.constexpr, G: tl.constexpr):
    """1-bit ``(codes, scale, zero)`` of ``[BLOCK_N, NG, G]`` float32 groups, as :func:`oscar_hf.quant.sigma_levels`."""
    mu = tl.math.div_rn(_tree_sum(groups, BLOCK_N, NG, G), G * 1.0)
    deviation = groups - mu[:, :, None]
    sigma = tl.math.sqrt_rn(tl.math.div_rn(_tree_sum(deviation * deviation, BLOCK_N, NG, G), G * 1.0))
    scale = tl.maximum(sigma * _STRETCH, _FLOOR)
    zero = 0.5 - tl.math.div_rn(mu, scale)
    codes = (groups >= mu[:, :, None]).to(tl.int32)
    return codes, scale, zero


@triton.jit
def _order_statistic(magnitudes, index):
    """Per row, the ``index``-th smallest of non-negative floats ``[BLOCK_N, D]``, exactly.

    Non-negative floats order like their bit patterns, so a binary search over the int32 pattern
    finds the smallest ``v`` with ``#{x <= v} > index``, which is ``sort(row)[index]``. 31 steps of
    compare-and-count: cheaper than ``tl.sort`` (a bitonic network) and much faster in the interpreter.
    """
    bits = magnitudes.to(tl.int32, bitcast=True)
    low = tl.zeros((magnitudes.shape[0],), dtype=tl.int32)
    high = tl.max(bits, axis=1)
    for _ in tl.static_range(31):
        mid = low + (high - low) // 2
        enough = tl.sum((bits <= mid[:, None]).to(tl.int32), axis=1) > index
        high = tl.where(enough, mid, high)
        low = tl.where(enough, low, mid + 1)
    return high.to(tl.float32, bitcast=True)


@triton.jit
def _peel_order_statistic(magnitudes, above):
    """Per row, the value with ``above`` elements after it in ``sort(row)``, by peeling off maxima.

    Each step takes the largest magnitude below the previous one and counts its copies (ties); the
    answer is the value whose copies reach past ``above``. At most ``above + 1`` steps.
    """
    current = tl.full((magnitudes.shape[0],), float("inf"), tl.float32)
    result = tl.zeros((magnitudes.shape[0],), tl.float32)
    remaining = tl.zeros((magnitudes.shape[0],), tl.int32) + above
    for _ in range(above + 1):
        peak = tl.max(tl.where(magnitudes < current[:, None], magnitudes, -1.0), axis=1)
        copies = tl.sum((magnitudes == peak[:, None]).to(tl.int32), axis=1)
        result = tl.where((remaining >= 0) & (copies > remaining), peak, result)
        remaining -= copies
        current = peak
    return result


@triton.jit
def _quantize_tile(
    x,
    clip_index,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """Float32 rows ``[BLOCK_N, D]`` -> (packed ``uint8 [BLOCK_N, D*BITS/8]`` as two planes, scale, zero ``[BLOCK_N, D/G]``).

    The planes are ``[BLOCK_N, D/4]`` low bits and ``[BLOCK_N, D/8]`` high bits for 3-bit codes; for
    1, 2 and 4 bits the first holds all the bytes and the second repeats it (unused).
    ``clip_index`` < 0 disables clipping (a constexpr or a runtime value).
    """
    NG: tl.constexpr = D // G
    LEVELS: tl.constexpr = (1 << BITS) - 1

    if clip_index >= 0:
        # The threshold is the clip_index-th smallest |x| of the whole row (not per group).
        above = D - 1 - clip_index
        # Peeling costs two reductions per magnitude above the threshold, bisection one per bit (31).
        if above < 15:
            threshold = _peel_order_statistic(tl.abs(x), above)[:, None]
        else:
            threshold = _order_statistic(tl.abs(x), clip_index)[:, None]
        x = tl.minimum(tl.maximum(x, -threshold), threshold)

    groups = tl.reshape(x, (BLOCK_N, NG, G))
    if BITS == 1:
        codes, scale, zero = _sigma_levels(groups, BLOCK_N, NG, G)
    else:
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

    if BITS == 3:
        packed = _pack_plane(codes & 3, BLOCK_N, D, 2)
        high = _pack_plane(codes >> 2, BLOCK_N, D, 1)
    else:
        packed = _pack_plane(codes, BLOCK_N, D, BITS)
        high = packed
    return packed, high, scale, zero


@triton.jit
def _pack_plane(codes, BLOCK_N: tl.constexpr, D: tl.constexpr, WIDTH: tl.constexpr):
    """``WIDTH``-bit codes ``[BLOCK_N, D]`` (int32) packed ``8 / WIDTH`` to a byte ``[BLOCK_N, D*WIDTH/8]``."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    # Row-major reshape puts dim j * DP + c at [j, c]: summing the shifted parts over j packs byte c.
    parts = tl.reshape(codes, (BLOCK_N, PER_BYTE, D // PER_BYTE))
    shifts = tl.arange(0, PER_BYTE) * WIDTH
    return tl.sum(parts << shifts[None, :, None], axis=1).to(tl.uint8)


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
    packed, high, scale, zero = _quantize_tile(x.to(tl.float32), CLIP_INDEX, BLOCK_N, D, G, BITS, SYMMETRIC, RECIPROCAL)
    _store_tile(
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


@triton.jit
def _store_tile(
    packed,
    high,
    scale,
    zero,
    CODES,
    SCALE,
    ZERO,
    valid,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Store a tile's codes (``high``: 3-bit codes' 1-bit plane, after the rest) and metadata;
    ``CODES``/``SCALE``/``ZERO`` point at each row's start ``[BLOCK_N, 1]``."""
    if BITS == 3:
        tl.store(CODES + tl.arange(0, D // 4)[None, :], packed, mask=valid[:, None])
        tl.store(CODES + D // 4 + tl.arange(0, D // 8)[None, :], high, mask=valid[:, None])
    else:
        tl.store(CODES + tl.arange(0, D * BITS // 8)[None, :], packed, mask=valid[:, None])
    groups = tl.arange(0, D // G)[None, :]
    tl.store(SCALE + groups, to_dtype(scale, SCALE.dtype.element_ty, INTERPRETED), mask=valid[:, None])
    tl.store(ZERO + groups, to_dtype(zero, ZERO.dtype.element_ty, INTERPRETED), mask=valid[:, None])


# Columns of the int64 job table of _quantize_pack_many_kernel, one row per (source, destination) pair:
# base addresses, and the batch / head / row strides of [B, H, n, *] views (in elements).
_JOB_COLUMNS = (
    "src",
    "src_b",
    "src_h",
    "src_n",
    "codes",
    "codes_b",
    "codes_h",
    "codes_n",
    "scale",
    "zero",
    "meta_b",
    "meta_h",
    "meta_n",
    "clip_index",
)


@triton.jit
def _quantize_pack_many_kernel(
    JOBS,
    heads,
    rows_per_head,
    n_rows,
    WINDOW,
    JOB_WIDTH: tl.constexpr,
    SRC_DTYPE: tl.constexpr,
    META_DTYPE: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    DEVICE_WINDOW: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program ``(tile, job)``: quantize rows of job ``job``'s ``[B, H, n, D]`` source into its destination.

    All jobs share shape and format; addresses, strides and the clip index come from the job table,
    so one launch serves every layer's K and V (the reference's pointer-table flush). With
    ``DEVICE_WINDOW`` the rows are ``n`` rows from offsets read in ``WINDOW`` (active, first source
    row, first destination row) when the launch runs, and nothing happens unless it is active.
    """
    job = JOBS + tl.program_id(1) * JOB_WIDTH
    index = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = index < n_rows
    b, h, t = index // (heads * rows_per_head), (index // rows_per_head) % heads, index % rows_per_head
    if DEVICE_WINDOW:
        if tl.load(WINDOW) != 0:
            _quantize_job(
                job,
                b,
                h,
                t + tl.load(WINDOW + 1),
                t + tl.load(WINDOW + 2),
                valid,
                SRC_DTYPE,
                META_DTYPE,
                D,
                G,
                BITS,
                SYMMETRIC,
                BLOCK_N,
                RECIPROCAL,
                INTERPRETED,
            )
    else:
        _quantize_job(
            job, b, h, t, t, valid, SRC_DTYPE, META_DTYPE, D, G, BITS, SYMMETRIC, BLOCK_N, RECIPROCAL, INTERPRETED
        )


@triton.jit
def _quantize_job(
    job,
    b,
    h,
    source_row,
    target_row,
    valid,
    SRC_DTYPE: tl.constexpr,
    META_DTYPE: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Quantize rows ``(b, h, source_row)`` of a job's source into rows ``(b, h, target_row)`` of its destination."""
    src = tl.load(job).to(tl.pointer_type(SRC_DTYPE))
    offsets = b * tl.load(job + 1) + h * tl.load(job + 2) + source_row * tl.load(job + 3)
    x = tl.load(src + offsets[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    clip_index = tl.load(job + 13).to(tl.int32)
    packed, high, scale, zero = _quantize_tile(x, clip_index, BLOCK_N, D, G, BITS, SYMMETRIC, RECIPROCAL)

    codes = tl.load(job + 4).to(tl.pointer_type(tl.uint8))
    codes_rows = b * tl.load(job + 5) + h * tl.load(job + 6) + target_row * tl.load(job + 7)
    meta_rows = b * tl.load(job + 10) + h * tl.load(job + 11) + target_row * tl.load(job + 12)
    scale_base = tl.load(job + 8).to(tl.pointer_type(META_DTYPE))
    zero_base = tl.load(job + 9).to(tl.pointer_type(META_DTYPE))
    _store_tile(
        packed,
        high,
        scale,
        zero,
        codes + codes_rows[:, None],
        scale_base + meta_rows[:, None],
        zero_base + meta_rows[:, None],
        valid,
        D,
        G,
        BITS,
        INTERPRETED,
    )


def _block_rows(head_dim: int) -> int:
    # About 1K values per single-warp program: on an H200, 8 rows of 128 in one warp quantized a 32K
    # prefill layer 4x faster than 16 rows in 4 warps (no cross-warp reductions in the clip search;
    # kernels/measurements/quantize_kernel_tuning.md).
    return max(1, min(16, 1024 // head_dim))


_NUM_WARPS = 1


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
        num_warps=_NUM_WARPS,
        **_exact(bits),
    )
    return codes, scale, zero


def _exact(bits: int) -> dict:
    """Launch options that keep the kernel's float32 operations those of the torch reference: no FMA
    contraction of the 1-bit sum of squares (the other widths multiply nothing into a sum)."""
    return {"enable_fp_fusion": False} if bits == 1 else {}


# -------------------------------------------------------------------------------- torch reference


# The torch reference and CPU fallback is the library's quantizer itself, same signature and results.
quantize_pack_reference = quantize

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32} if HAS_TRITON else {}


def quantize_pack_many_triton(
    sources: list[torch.Tensor],
    destinations: list[QuantizedRows],
    bits: int,
    group_size: int,
    symmetric: bool,
    clip_ratios: list[float],
    metadata_dtype: torch.dtype,
    block_rows: int = 0,
    num_warps: int = 0,
) -> None:
    """One launch for all jobs (arguments as :func:`quantize_pack_into`): a table row per job.

    ``block_rows`` (rows per program) and ``num_warps`` are tuning knobs, 0 meaning the defaults
    (``kernels/tools/tune_quantize.py``).
    """
    table = _job_table(sources, destinations, clip_ratios)
    _launch_many(
        table, sources[0], sources[0].shape[2], bits, group_size, symmetric, metadata_dtype, None, block_rows, num_warps
    )


def _job_table(
    sources: list[torch.Tensor], destinations: list[QuantizedRows], clip_ratios: list[float]
) -> torch.Tensor:
    """The device table of :func:`_quantize_pack_many_kernel`: addresses, strides, clip index per job."""
    head_dim, jobs = sources[0].shape[-1], []
    for source, target, ratio in zip(sources, destinations, clip_ratios):
        clip = clip_index(ratio, head_dim) if ratio > 0 else -1
        jobs.append(
            [
                source.data_ptr(),
                *source.stride()[:3],
                target.codes.data_ptr(),
                *target.codes.stride()[:3],
                target.scale.data_ptr(),
                target.zero.data_ptr(),
                *target.scale.stride()[:3],
                clip,
            ]
        )
    return torch.tensor(jobs, dtype=torch.int64).to(sources[0].device, non_blocking=True)


def _launch_many(
    table: torch.Tensor,
    like: torch.Tensor,
    rows_per_head: int,
    bits: int,
    group_size: int,
    symmetric: bool,
    metadata_dtype: torch.dtype,
    window: torch.Tensor | None,
    block_rows: int = 0,
    num_warps: int = 0,
) -> None:
    batch, heads, _, head_dim = like.shape
    n_rows = batch * heads * rows_per_head
    block = block_rows or _block_rows(head_dim)
    launch_kernel(
        _quantize_pack_many_kernel,
        (cdiv(n_rows, block), table.shape[0]),
        table,
        heads,
        rows_per_head,
        n_rows,
        table if window is None else window,
        len(_JOB_COLUMNS),
        SRC_DTYPE=_TL_DTYPES[like.dtype],
        META_DTYPE=_TL_DTYPES[metadata_dtype],
        D=head_dim,
        G=group_size,
        BITS=bits,
        SYMMETRIC=symmetric,
        BLOCK_N=block,
        RECIPROCAL=like.is_cuda and not INTERPRET,
        DEVICE_WINDOW=window is not None,
        INTERPRETED=INTERPRET,
        num_warps=num_warps or _NUM_WARPS,
        **_exact(bits),
    )


def quantize_pack_many_reference(
    sources: list[torch.Tensor],
    destinations: list[QuantizedRows],
    bits: int,
    group_size: int,
    symmetric: bool,
    clip_ratios: list[float],
    metadata_dtype: torch.dtype,
) -> None:
    """The torch reference of :func:`quantize_pack_into`: one :func:`oscar_hf.quant.quantize` per job."""
    for source, target, ratio in zip(sources, destinations, clip_ratios):
        rows = quantize(source, bits, group_size, symmetric=symmetric, clip_ratio=ratio, metadata_dtype=metadata_dtype)
        target.codes.copy_(rows.codes)
        target.scale.copy_(rows.scale)
        target.zero.copy_(rows.zero)


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
    check_symmetric(bits, symmetric)
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


def quantize_pack_into(
    sources: list[torch.Tensor],
    destinations: list[QuantizedRows],
    bits: int,
    group_size: int,
    *,
    symmetric: bool = False,
    clip_ratios: list[float],
    metadata_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Quantize each ``sources[i]`` ``[B, H, n, D]`` into the preallocated views ``destinations[i]``.

    Every layer's demoted K and V rows in one launch: all jobs share shape, dtype and format, each
    has its own clip ratio (``clip_ratios[i]``, 0 disables) and may be any strided view whose last
    dim is contiguous. Codes and metadata are identical to :func:`quantize_pack` job by job.
    """
    if not _check_jobs(sources, destinations, bits, group_size, clip_ratios, metadata_dtype):
        return
    fits = _kernel_fits(sources, destinations, group_size)
    launch = quantize_pack_many_triton if runs_triton(sources[0]) and fits else quantize_pack_many_reference
    launch(sources, destinations, bits, group_size, symmetric, clip_ratios, metadata_dtype)


def _check_jobs(sources, destinations, bits, group_size, clip_ratios, metadata_dtype) -> bool:
    """Validate jobs of :func:`quantize_pack_into`; False when there are none."""
    check_bits(bits)
    if not (len(sources) == len(destinations) == len(clip_ratios)):
        raise ValueError("sources, destinations and clip_ratios must have one entry per job")
    if not sources:
        return False
    shape, head_dim = sources[0].shape, sources[0].shape[-1]
    for source, target in zip(sources, destinations):
        if source.shape != shape or source.dtype != sources[0].dtype or source.device != sources[0].device:
            raise ValueError(
                f"all sources must share shape, dtype and device; got {tuple(source.shape)} "
                f"{source.dtype} and {tuple(shape)} {sources[0].dtype}"
            )
        if (
            target.codes.shape != (*shape[:3], head_dim * bits // 8)
            or target.scale.shape != (*shape[:3], head_dim // group_size)
            or target.zero.shape != target.scale.shape
            or target.zero.stride() != target.scale.stride()
            or target.scale.dtype != metadata_dtype
        ):
            raise ValueError(
                f"destination {tuple(target.codes.shape)} / {tuple(target.scale.shape)} does not fit "
                f"{bits}-bit rows of {tuple(shape)} with groups of {group_size}"
            )
    return True


def _kernel_fits(sources: list[torch.Tensor], destinations: list[QuantizedRows], group_size: int) -> bool:
    tensors = [
        t for source, target in zip(sources, destinations) for t in (source, target.codes, target.scale, target.zero)
    ]
    contiguous_rows = all(t.stride(-1) == 1 for t in tensors)
    return kernel_supports_quantize(sources[0].shape[-1], group_size) and contiguous_rows and sources[0].shape[2] > 0


class WindowQuantizer:
    """``count`` rows of each source quantized into its destination at row offsets read on the device.

    Static decoding demotes every layer's oldest ``block`` recent rows, from a ring position into the
    end of the history, whenever the window fills; both positions live on the device. Built once
    (the job table is uploaded here), each call is one launch that a CUDA graph can capture, and
    ``window`` (int64 ``[active, first source row, first destination row]``) is read when it runs.

    Args:
        sources: whole buffers ``[B, H, N, D]`` (e.g. every layer's recent-window rings of K and V).
        destinations: whole history buffers, one per source.
        count: rows per job.
        window: the device tensor described above; the caller updates it in place.
        bits, group_size, symmetric, clip_ratios, metadata_dtype: as :func:`quantize_pack_into`.
    """

    def __init__(
        self,
        sources: list[torch.Tensor],
        destinations: list[QuantizedRows],
        count: int,
        window: torch.Tensor,
        bits: int,
        group_size: int,
        *,
        symmetric: bool = False,
        clip_ratios: list[float],
        metadata_dtype: torch.dtype = torch.bfloat16,
    ):
        _check_jobs(
            [s[:, :, :count] for s in sources],
            [_rows_of(d, count) for d in destinations],
            bits,
            group_size,
            clip_ratios,
            metadata_dtype,
        )
        if window.shape != (3,) or window.dtype != torch.int64 or window.device != sources[0].device:
            raise ValueError(
                f"window must be int64 [3] on {sources[0].device}, got {tuple(window.shape)} {window.dtype}"
            )
        self.sources, self.destinations, self.count, self.window = sources, destinations, count, window
        self.format = dict(bits=bits, group_size=group_size, symmetric=symmetric, metadata_dtype=metadata_dtype)
        self.clip_ratios = clip_ratios
        fits = _kernel_fits(sources, destinations, group_size)
        self.table = _job_table(sources, destinations, clip_ratios) if runs_triton(sources[0]) and fits else None

    def __call__(self) -> None:
        f = self.format
        if self.table is not None:
            _launch_many(
                self.table,
                self.sources[0],
                self.count,
                f["bits"],
                f["group_size"],
                f["symmetric"],
                f["metadata_dtype"],
                self.window,
            )
            return
        active, source_row, target_row = (int(v) for v in self.window.tolist())  # reference: a host sync
        if active:
            sources = [s[:, :, source_row : source_row + self.count] for s in self.sources]
            targets = [_rows_of(d, self.count, target_row) for d in self.destinations]
            quantize_pack_many_reference(
                sources, targets, f["bits"], f["group_size"], f["symmetric"], self.clip_ratios, f["metadata_dtype"]
            )


def _rows_of(rows: QuantizedRows, count: int, start: int = 0) -> QuantizedRows:
    return QuantizedRows(*(t[:, :, start : start + count] for t in (rows.codes, rows.scale, rows.zero)))
