"""The register-tile work of the fused write path (:mod:`.quantize`, :mod:`.quantize_many`): clip, quantize, feed
errors back, pack and store ``[BLOCK_N, D]`` rows, in the float32 operations of :func:`oscar_hf.quant.quantize`;
and the tile's launch: the shapes it supports, rows a program, warps and the options that keep those operations."""

from __future__ import annotations

from oscar_hf.quant import SCALE_FLOOR, SIGMA_STRETCH

from ._triton import is_power_of_two, tl, to_dtype, triton

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
def quantize_tile(
    x,
    clip_index,
    factor,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    FEEDBACK: tl.constexpr,
    META_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Float32 rows ``[BLOCK_N, D]`` -> (packed ``uint8 [BLOCK_N, D*BITS/8]`` as two planes, scale, zero ``[BLOCK_N, D/G]``).

    The planes are ``[BLOCK_N, D/4]`` low bits and ``[BLOCK_N, D/8]`` high bits for 3-bit codes; for
    1, 2 and 4 bits the first holds all the bytes and the second repeats it (unused).
    ``clip_index`` < 0 disables clipping (a constexpr or a runtime value). With ``FEEDBACK``, ``factor``
    points at each row's ``[D, D]`` feedback factor (:func:`_feedback_codes`).
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

        if FEEDBACK:
            codes = _feedback_codes(x, scale, zero, factor, BLOCK_N, D, G, LEVELS, META_DTYPE, INTERPRETED)
        else:
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
def _feedback_codes(
    x,
    scale,
    zero,
    factor,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    LEVELS: tl.constexpr,
    META_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Codes ``[BLOCK_N, D]`` of rows ``x`` on the stored grid (``scale``/``zero`` rounded to ``META_DTYPE``),
    one channel at a time, each channel's error fed forward with row ``j`` of the factor at ``factor``
    (``[BLOCK_N]`` pointers): the operations of :func:`oscar_hf.quant._feedback_codes`. Channel ``j``
    is picked out of a tile by a masked sum (adding zeros is exact); channels up to ``j`` are updated
    too, by zeros below the factor's diagonal, which leaves the codes as torch makes them."""
    NG: tl.constexpr = D // G
    stored_scale = to_dtype(scale, META_DTYPE, INTERPRETED).to(tl.float32)
    stored_zero = to_dtype(zero, META_DTYPE, INTERPRETED).to(tl.float32)
    scales = tl.reshape(tl.broadcast_to(stored_scale[:, :, None], (BLOCK_N, NG, G)), (BLOCK_N, D))
    zeros = tl.reshape(tl.broadcast_to(stored_zero[:, :, None], (BLOCK_N, NG, G)), (BLOCK_N, D))
    columns = tl.arange(0, D)[None, :]
    codes = tl.zeros((BLOCK_N, D), tl.int32)
    for j in range(D):
        pick = columns == j
        x_j = tl.sum(tl.where(pick, x, 0.0), axis=1)
        s_j = tl.sum(tl.where(pick, scales, 0.0), axis=1)
        z_j = tl.sum(tl.where(pick, zeros, 0.0), axis=1)
        code = tl.floor(tl.math.div_rn(x_j, s_j) + z_j + 0.5)
        code = tl.minimum(tl.maximum(code, 0.0), LEVELS * 1.0)
        codes = tl.where(pick, code.to(tl.int32)[:, None], codes)
        error = x_j - (code - z_j) * s_j
        x = x - error[:, None] * tl.load(factor[:, None] + j * D + columns)
    return codes


@triton.jit
def _pack_plane(codes, BLOCK_N: tl.constexpr, D: tl.constexpr, WIDTH: tl.constexpr):
    """``WIDTH``-bit codes ``[BLOCK_N, D]`` (int32) packed ``8 / WIDTH`` to a byte ``[BLOCK_N, D*WIDTH/8]``."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    # Row-major reshape puts dim j * DP + c at [j, c]: summing the shifted parts over j packs byte c.
    parts = tl.reshape(codes, (BLOCK_N, PER_BYTE, D // PER_BYTE))
    shifts = tl.arange(0, PER_BYTE) * WIDTH
    return tl.sum(parts << shifts[None, :, None], axis=1).to(tl.uint8)


@triton.jit
def store_tile(
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


# -------------------------------------------------------------------------------------- launch


def kernel_supports_quantize(head_dim: int, group_size: int) -> bool:
    """The kernel reshapes register tiles, which Triton allows for power-of-two sizes only."""
    return is_power_of_two(head_dim) and head_dim >= 16 and is_power_of_two(group_size)


def rows_per_program(head_dim: int) -> int:
    # About 1K values per single-warp program: on an H200, 8 rows of 128 in one warp quantized a 32K
    # prefill layer 4x faster than 16 rows in 4 warps (no cross-warp reductions in the clip search;
    # kernels/measurements/quantize_kernel_tuning.md).
    return max(1, min(16, 1024 // head_dim))


NUM_WARPS = 1


def exact_launch(bits: int, feedback: bool = False) -> dict:
    """Launch options that keep the kernel's float32 operations those of the torch reference: no FMA
    contraction of the 1-bit sum of squares or of the feedback's updates (without them, nothing
    multiplied is added)."""
    return {"enable_fp_fusion": False} if bits == 1 or feedback else {}
