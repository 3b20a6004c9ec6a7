"""One tile's work in the Triton stage 1 of decode attention (:mod:`.decode_stages`): the scores of
packed or dense keys, the value weights and the online softmax over a tier's rows.

Packed history tiles are never dequantized: with one (scale, zero) per row and group, dequantization is
affine, so it moves from the key tile to the scores (:func:`packed_span`); how codes enter the dots is
:mod:`.decode_unpack`'s. Dense tiers (sink, recent, new rows) take :func:`dense_span`.
"""

from __future__ import annotations

from ._triton import dot, tl, to_dtype, triton
from .decode_unpack import load_code_blocks, part_factor


@triton.jit
def _attend(
    q0,
    q1,
    q2,
    q3,
    k0,
    k1,
    k2,
    k3,
    v0,
    v1,
    v2,
    v3,
    valid,
    m_i,
    l_i,
    a0,
    a1,
    a2,
    a3,
    score_scale,
    K_PARTS: tl.constexpr,
    V_PARTS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One online-softmax step of ``BLOCK_H`` query heads over a ``BLOCK_N``-row K/V tile.

    Tiles come as column blocks (``q_j``, ``k_j``: dims ``[j*D/K_PARTS, (j+1)*D/K_PARTS)``; ``v_j`` and
    the accumulators ``a_j`` likewise with ``V_PARTS``), the shape in which packed codes unpack, so
    ``q·k`` is a sum of per-block dots. Blocks 2 and 3 are unused when there are 2 parts.
    """
    scores = dot(q0, tl.trans(k0), INTERPRETED) + dot(q1, tl.trans(k1), INTERPRETED)
    if K_PARTS == 4:
        scores += dot(q2, tl.trans(k2), INTERPRETED) + dot(q3, tl.trans(k3), INTERPRETED)
    m_new, l_i, alpha, p = _online_softmax(scores * score_scale, valid, m_i, l_i)
    p = to_dtype(p, v0.dtype, INTERPRETED)
    a0 = a0 * alpha[:, None] + dot(p, v0, INTERPRETED)
    a1 = a1 * alpha[:, None] + dot(p, v1, INTERPRETED)
    if V_PARTS == 4:
        a2 = a2 * alpha[:, None] + dot(p, v2, INTERPRETED)
        a3 = a3 * alpha[:, None] + dot(p, v3, INTERPRETED)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _key_valid(rows, end, MASK, position, HAS_MASK: tl.constexpr):
    valid = rows < end
    if HAS_MASK:
        valid = valid & (tl.load(MASK + position + rows, mask=valid, other=0) != 0)
    return valid


@triton.jit
def load_parts(BASE, stride_n, rows, valid, D: tl.constexpr, PARTS: tl.constexpr):
    """Dense rows ``[N, D]`` as ``PARTS`` column blocks ``[N, D/PARTS]`` (with 2, blocks 2-3 repeat 0-1)."""
    DP: tl.constexpr = D // PARTS
    pointers = BASE + rows[:, None] * stride_n + tl.arange(0, DP)[None, :]
    x0 = tl.load(pointers, mask=valid[:, None], other=0.0)
    x1 = tl.load(pointers + DP, mask=valid[:, None], other=0.0)
    if PARTS == 4:
        x2 = tl.load(pointers + 2 * DP, mask=valid[:, None], other=0.0)
        x3 = tl.load(pointers + 3 * DP, mask=valid[:, None], other=0.0)
    else:
        x2, x3 = x0, x1
    return x0, x1, x2, x3


@triton.jit
def _metadata(KS, ks_n, KZ, kz_n, K_GROUPS: tl.constexpr, VS, vs_n, VZ, vz_n, V_GROUPS: tl.constexpr, rows, end):
    """K's and V's ``scale`` and ``zero`` tiles ``[rows, groups]`` (0 from row ``end`` on)."""
    k_scales, k_zeros = _scale_zero(KS, ks_n, KZ, kz_n, rows, rows < end, K_GROUPS)
    v_scales, v_zeros = _scale_zero(VS, vs_n, VZ, vz_n, rows, rows < end, V_GROUPS)
    return k_scales, k_zeros, v_scales, v_zeros


@triton.jit
def _scale_zero(SCALE, scale_stride_n, ZERO, zero_stride_n, rows, in_range, GROUPS: tl.constexpr):
    groups = tl.arange(0, GROUPS)[None, :]
    scale = tl.load(SCALE + rows[:, None] * scale_stride_n + groups, mask=in_range[:, None], other=0.0)
    zero = tl.load(ZERO + rows[:, None] * zero_stride_n + groups, mask=in_range[:, None], other=0.0)
    return scale, zero


@triton.jit
def _group_column(tile, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """Column ``GROUP`` of a metadata tile, float32."""
    if GROUPS == 1:
        return tl.reshape(tile, (tile.shape[0],)).to(tl.float32)
    return tl.sum(tl.where(tl.arange(0, GROUPS)[None, :] == GROUP, tile.to(tl.float32), 0.0), axis=1)


@triton.jit
def _group_of(J: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr):
    """The group of column block ``J``'s dims (``4 - 2 * (BITS // 4)``: 4 blocks for 1- to 3-bit codes, 2 for 4)."""
    return (J * D // (4 - 2 * (BITS // 4))) // (D // GROUPS)


@triton.jit
def _affine(dots, q_sum, bias, score_scale, scales, zeros, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """Scores from code dots: ``q·k = scale * (dots - bias - zero * sum(q))`` per key row, where
    ``bias`` is what the codes' offset adds to ``dots`` (``OFFSET * sum(q_j / factor_j)``), times
    ``score_scale`` (folded into the per-row scale, not applied per score)."""
    scale, zero = _group_column(scales, GROUP, GROUPS), _group_column(zeros, GROUP, GROUPS)
    return (scale * score_scale)[None, :] * (dots - bias[:, None] - zero[None, :] * q_sum[:, None])


@triton.jit
def _packed_scores(
    q0,
    q1,
    q2,
    q3,
    q_sum,
    s0,
    s1,
    s2,
    s3,
    b0,
    b1,
    b2,
    b3,
    k0,
    k1,
    k2,
    k3,
    score_scale,
    scales,
    zeros,
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUPS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """``q·k`` over packed keys without dequantizing them (the tile stays codes, see :func:`_affine`).

    Per-row metadata makes dequantization affine, so it moves from the ``N x D`` key tile to the
    ``H x N`` scores. ``q_j`` are q's column blocks divided by their codes' factors, ``q_sum`` is the
    float32 sum of q, ``s_j`` that of its column block ``j`` and ``b_j`` what the codes' offset adds to
    that block's dot; ``scales`` and ``zeros`` are the keys' ``[rows, GROUPS]`` metadata. Each column
    block lies within one group (the dispatcher checks that groups are that wide).
    """
    PARTS: tl.constexpr = 4 - 2 * (BITS // 4)  # column blocks: 4 for 1- to 3-bit codes, 2 for 4-bit
    d0 = dot(q0, tl.trans(k0), INTERPRETED)
    d1 = dot(q1, tl.trans(k1), INTERPRETED)
    if PARTS == 4:
        d2 = dot(q2, tl.trans(k2), INTERPRETED)
        d3 = dot(q3, tl.trans(k3), INTERPRETED)
    if GROUPS == 1:  # one (scale, zero) per row: one correction for the sum of the block dots
        if PARTS == 4:
            d0 += d2 + d3
            b0 += b2 + b3
        scores = _affine(d0 + d1, q_sum, b0 + b1, score_scale, scales, zeros, 0, GROUPS)
    else:
        scores = _affine(d0, s0, b0, score_scale, scales, zeros, _group_of(0, D, BITS, GROUPS), GROUPS)
        scores += _affine(d1, s1, b1, score_scale, scales, zeros, _group_of(1, D, BITS, GROUPS), GROUPS)
        if PARTS == 4:
            scores += _affine(d2, s2, b2, score_scale, scales, zeros, _group_of(2, D, BITS, GROUPS), GROUPS)
            scores += _affine(d3, s3, b3, score_scale, scales, zeros, _group_of(3, D, BITS, GROUPS), GROUPS)
    return scores


@triton.jit
def _value_weights(
    p, scales, zeros, GROUP: tl.constexpr, GROUPS: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr
):
    """``w = p * scale`` as the dot operand, and per head ``sum(w)`` and ``sum(w * zero)``.

    ``sum_n w_n (c_n - zero_n) = (w·(OFFSET + f c) - OFFSET sum(w)) / f - sum(w * zero)`` for a column
    block whose codes come with factor ``f``: the corrections, from the same rounded weights, are
    applied once at the end of the span.
    """
    scale, zero = _group_column(scales, GROUP, GROUPS), _group_column(zeros, GROUP, GROUPS)
    weights = to_dtype(p * scale[None, :], DTYPE, INTERPRETED)
    w = weights.to(tl.float32)
    return weights, tl.sum(w, axis=1), tl.sum(w * zero[None, :], axis=1)


@triton.jit
def _divided(q, J: tl.constexpr, BITS: tl.constexpr, FREE: tl.constexpr):
    """Column block ``J`` of q divided by its codes' factor (a power of two: exact)."""
    return (q.to(tl.float32) * (1.0 / part_factor(J, BITS, FREE))).to(q.dtype)


@triton.jit
def packed_span(
    q0,
    q1,
    q2,
    q3,
    q_sum,
    s0,
    s1,
    s2,
    s3,
    m_i,
    l_i,
    a0,
    a1,
    a2,
    a3,
    KC,
    kc_n,
    KS,
    ks_n,
    KZ,
    kz_n,
    VC,
    vc_n,
    VS,
    vs_n,
    VZ,
    vz_n,
    start,
    end,
    MASK,
    position,
    score_scale,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_BITS: tl.constexpr,
    K_GROUPS: tl.constexpr,
    V_BITS: tl.constexpr,
    V_GROUPS: tl.constexpr,
    MAGIC: tl.constexpr,
    OFFSET: tl.constexpr,
    K_FREE: tl.constexpr,
    V_FREE: tl.constexpr,
    K_UNPACK: tl.constexpr,
    V_UNPACK: tl.constexpr,
    HAS_MASK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Attend over packed history rows ``[start, end)`` of one KV head; codes are never dequantized."""
    V_PARTS: tl.constexpr = 4 - 2 * (V_BITS // 4)
    dtype = q0.dtype
    q0, q1 = _divided(q0, 0, K_BITS, K_FREE), _divided(q1, 1, K_BITS, K_FREE)
    q2, q3 = _divided(q2, 2, K_BITS, K_FREE), _divided(q3, 3, K_BITS, K_FREE)
    b0, b1 = s0 * (OFFSET / part_factor(0, K_BITS, K_FREE)), s1 * (OFFSET / part_factor(1, K_BITS, K_FREE))
    b2, b3 = s2 * (OFFSET / part_factor(2, K_BITS, K_FREE)), s3 * (OFFSET / part_factor(3, K_BITS, K_FREE))
    # Value corrections per column block (see _value_weights), rescaled like the accumulators.
    c0 = tl.zeros(l_i.shape, tl.float32)
    c1, c2, c3 = c0, c0, c0
    # The metadata of tile i+1 is loaded while tile i computes: too narrow for the pipeliner's
    # asynchronous copies (2 bytes a thread), it would stall every tile on a global load.
    k_scales, k_zeros, v_scales, v_zeros = _metadata(
        KS, ks_n, KZ, kz_n, K_GROUPS, VS, vs_n, VZ, vz_n, V_GROUPS, start + tl.arange(0, BLOCK_N), end
    )
    for block in range(start, end, BLOCK_N):
        rows = block + tl.arange(0, BLOCK_N)
        valid = _key_valid(rows, end, MASK, position, HAS_MASK)
        ahead = _metadata(KS, ks_n, KZ, kz_n, K_GROUPS, VS, vs_n, VZ, vz_n, V_GROUPS, rows + BLOCK_N, end)
        k0, k1, k2, k3 = load_code_blocks(KC, kc_n, rows, valid, D, K_BITS, dtype, MAGIC, K_FREE, K_UNPACK)
        scores = _packed_scores(
            q0,
            q1,
            q2,
            q3,
            q_sum,
            s0,
            s1,
            s2,
            s3,
            b0,
            b1,
            b2,
            b3,
            k0,
            k1,
            k2,
            k3,
            score_scale,
            k_scales,
            k_zeros,
            D,
            K_BITS,
            K_GROUPS,
            INTERPRETED,
        )
        m_i, l_i, alpha, p = _online_softmax(scores, valid, m_i, l_i)
        v0, v1, v2, v3 = load_code_blocks(VC, vc_n, rows, valid, D, V_BITS, dtype, MAGIC, V_FREE, V_UNPACK)
        w0, sw0, sz0 = _value_weights(
            p, v_scales, v_zeros, _group_of(0, D, V_BITS, V_GROUPS), V_GROUPS, dtype, INTERPRETED
        )
        w1, sw1, sz1, w2, sw2, sz2, w3, sw3, sz3 = w0, sw0, sz0, w0, sw0, sz0, w0, sw0, sz0
        if V_GROUPS > 1:
            w1, sw1, sz1 = _value_weights(
                p, v_scales, v_zeros, _group_of(1, D, V_BITS, V_GROUPS), V_GROUPS, dtype, INTERPRETED
            )
            if V_PARTS == 4:
                w2, sw2, sz2 = _value_weights(
                    p, v_scales, v_zeros, _group_of(2, D, V_BITS, V_GROUPS), V_GROUPS, dtype, INTERPRETED
                )
                w3, sw3, sz3 = _value_weights(
                    p, v_scales, v_zeros, _group_of(3, D, V_BITS, V_GROUPS), V_GROUPS, dtype, INTERPRETED
                )
        k_scales, k_zeros, v_scales, v_zeros = ahead
        a0 = a0 * alpha[:, None] + dot(w0, v0, INTERPRETED)
        a1 = a1 * alpha[:, None] + dot(w1, v1, INTERPRETED)
        c0 = c0 * alpha + sz0 + sw0 * (OFFSET / part_factor(0, V_BITS, V_FREE))
        c1 = c1 * alpha + sz1 + sw1 * (OFFSET / part_factor(1, V_BITS, V_FREE))
        if V_PARTS == 4:
            a2 = a2 * alpha[:, None] + dot(w2, v2, INTERPRETED)
            a3 = a3 * alpha[:, None] + dot(w3, v3, INTERPRETED)
            c2 = c2 * alpha + sz2 + sw2 * (OFFSET / part_factor(2, V_BITS, V_FREE))
            c3 = c3 * alpha + sz3 + sw3 * (OFFSET / part_factor(3, V_BITS, V_FREE))
    a0 = a0 * (1.0 / part_factor(0, V_BITS, V_FREE)) - c0[:, None]
    a1 = a1 * (1.0 / part_factor(1, V_BITS, V_FREE)) - c1[:, None]
    a2 = a2 * (1.0 / part_factor(2, V_BITS, V_FREE)) - c2[:, None]
    a3 = a3 * (1.0 / part_factor(3, V_BITS, V_FREE)) - c3[:, None]
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _online_softmax(scores, valid, m_i, l_i):
    """One online-softmax step over scores in base-2 units (``q·k * sm_scale * log2(e)``, so that
    ``exp2`` replaces ``exp`` and its multiply): new max and sum, the rescale factor of older terms,
    and the weights."""
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A fully masked tile keeps m at -inf; subtracting 0 instead avoids exp(-inf - -inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def dense_span(
    q0,
    q1,
    q2,
    q3,
    m_i,
    l_i,
    a0,
    a1,
    a2,
    a3,
    K,
    k_stride_n,
    V,
    v_stride_n,
    start,
    end,
    MASK,
    position,
    score_scale,
    ring_start,
    ring_rows,
    ring_size,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_PARTS: tl.constexpr,
    V_PARTS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    RING: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Attend over dense rows ``[start, end)`` of one KV head (K/V point at that head's row 0).

    With ``RING`` the rows are a ring buffer of ``ring_size`` rows of which the ``ring_rows`` from
    ``ring_start`` on (wrapping around) are valid; softmax does not depend on the order of keys.
    """
    for block in range(start, end, BLOCK_N):
        rows = block + tl.arange(0, BLOCK_N)
        valid = _key_valid(rows, end, MASK, position, HAS_MASK)
        if RING:
            valid = valid & ((rows - ring_start + ring_size) % ring_size < ring_rows)
        k0, k1, k2, k3 = load_parts(K, k_stride_n, rows, valid, D, K_PARTS)
        v0, v1, v2, v3 = load_parts(V, v_stride_n, rows, valid, D, V_PARTS)
        m_i, l_i, a0, a1, a2, a3 = _attend(
            q0,
            q1,
            q2,
            q3,
            k0,
            k1,
            k2,
            k3,
            v0,
            v1,
            v2,
            v3,
            valid,
            m_i,
            l_i,
            a0,
            a1,
            a2,
            a3,
            score_scale,
            K_PARTS,
            V_PARTS,
            INTERPRETED,
        )
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def store_new_rows(
    NK,
    nk_stride_n,
    NV,
    nv_stride_n,
    RK,
    rk_stride_n,
    RV,
    rv_stride_n,
    start,
    end,
    first_slot,
    ring_size,
    D: tl.constexpr,
):
    """Static decoding: new rows ``[start, end)`` of one KV head into its ring, row r at slot
    ``(first_slot + r) % ring_size`` (the launch that attends them also stores them)."""
    dims = tl.arange(0, D)
    for row in range(start, end):
        slot = (first_slot + row) % ring_size
        tl.store(RK + slot * rk_stride_n + dims, tl.load(NK + row * nk_stride_n + dims))
        tl.store(RV + slot * rv_stride_n + dims, tl.load(NV + row * nv_stride_n + dims))
