"""Split-K (flash-decoding) attention of one new query token over ``[sink | packed history | recent | new]``.

The key sequence of one layer is four tiers, in this order of positions:

* ``sink``    dense rows ``[B, Hkv, S, D]`` (the first real tokens; with left padding some are pads),
* history     packed INT1-INT4 codes ``[B, Hkv, L, D*bits/8]`` + scale/zero ``[B, Hkv, L, D/G]``,
              K and V with their own bit widths and groups (``oscar-k4v2``: K 4-bit, V 2-bit),
* ``recent``  dense rows ``[B, Hkv, R, D]``,
* ``new``     dense rows ``[B, Hkv, T, D]`` (the token being decoded, not stored yet).

Everything is in the rotated basis: ``q`` is ``q·R_K`` and the output is in the ``V·R_V`` basis
(the caller applies ``·R_V^T``).

Stage 1 (one launch for all tiers): program ``(b, kv head [x head block], slot)`` handles one split
of one tier for all ``Hq/Hkv`` query heads of its KV head, so every KV tile is read once per group.
History tiles are loaded as contiguous packed bytes and never dequantized: with one (scale, zero) per
row and group, dequantization is affine, so ``q·k = scale * (q·c - zero * sum(q))`` moves it from the
``N x D`` key tile to the ``H x N`` scores, and ``sum_n p_n (c_n - zero_n) scale_n`` becomes a dot of
the weights ``p * scale`` with the codes minus one correction per head. Codes enter the dots as exact
16-bit floats ``OFFSET + f * c`` built with one or two integer operations (:func:`_code_block`; ``f``
a power of two for the blocks unpacked without a shift, q divided by it), and the offset is folded
into the same corrections. Dequantizing each element in float32 instead (an int-to-float
conversion, a subtract, a multiply and a cast) binds the kernel on that arithmetic, not on memory. Byte ``c`` of a packed row holds dims ``c, c + D/k, ...`` (k codes per
byte), so shift ``j`` of the byte tile is the column block ``j`` of the rows: every tile (q, K, V, the
accumulator) is handled as k column blocks, and ``q·k`` as a sum of k dots. 3-bit codes are 2-bit
codes (their low bits, in that layout) plus a 1-bit plane of their high bits (byte ``c`` holding dims
``c + i*D/8``): block ``j`` takes bits ``2j`` and ``2j + 1`` of the plane's bytes for its two halves,
so they are handled as 4 column blocks too, each code assembled whole before its one dot. 1-bit codes are such a plane alone. Only loads, shifts and
``tl.dot`` are used: full-width tiles rebuilt with ``tl.interleave`` pass in the interpreter but give
wrong results compiled on an H200 for some tile shapes.
Each slot stores its running max ``m``, sum ``l`` and unnormalised accumulator ``acc`` (float32).
Stage 2 merges the slots with exact log-sum-exp weights: one softmax over the union of the tiers.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import TYPE_CHECKING

import torch

from oscar_hf.log import get_logger
from oscar_hf.quant import QuantizedRows, check_bits, dequantize

from ._triton import (
    INTERPRET, LOG2E, cdiv, define_op, dot, is_power_of_two, launch_kernel, next_power_of_two, op_or_launcher,
    programmatic_launch, runs_triton, split_rows, tl, to_dtype, triton,
)  # fmt: skip

if TYPE_CHECKING:
    from .decode_history_gluon import SpanVariant

logger = get_logger(__name__)

_DENSE_SPLIT_TOKENS = 256  # dense tiers are short (sink 64, recent <= 263): a couple of splits each
# Beside the Gluon span the dense tiers are a launch of their own, after it, so its time adds up:
# short splits keep it near one tile's latency (one split of the recent window, 16 tiles in a row,
# took 11 us a layer on an H200).
_SPAN_DENSE_SPLIT_TOKENS = 32
# Dense tiles stay small: the kernel's shared memory is sized by its largest branch, and wide dense
# tiles (pipelined) would cap how many history programs fit on a multiprocessor.
_DENSE_BLOCK_N = 16
_MIN_SPLIT_TOKENS = 256  # below this a history split costs more in the merge than it saves
# Bounds the Triton stage 1's splits (and so the merge's slots). The Gluon span's fill their wave: at
# batch 1 and 100K on an H200 that is 260 splits of 6 tiles, where the cap left 223 of 7 (the whole
# call 30.3 us against 31.0; eval/results/gluon_history_split_cap.md).
_MAX_SPLITS = 256
# Codes enter the dots as OFFSET + code: int16 bits of a power of two whose ulp is 1, OR-ed with the
# code (see _code_block); float32 converts codes directly.
# The third number is the mantissa's width: column blocks of codes that fit in it need no shift.
_CODE_MAGIC = {torch.bfloat16: (0x4300, 128.0, 7), torch.float16: (0x6400, 1024.0, 10), torch.float32: (0, 0.0, 23)}

# ------------------------------------------------------------------------------------ jit helpers


@triton.jit
def _attend(
    q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, m_i, l_i, a0, a1, a2, a3, score_scale,
    K_PARTS: tl.constexpr, V_PARTS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
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
def _load_parts(BASE, stride_n, rows, valid, D: tl.constexpr, PARTS: tl.constexpr):
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
def _part_factor(J: tl.constexpr, BITS: tl.constexpr, FREE: tl.constexpr):
    """Column block ``J``'s codes enter the dots as ``OFFSET + factor * c`` (see :func:`_code_block`)."""
    return 1 << (J * BITS * (J < FREE))


@triton.jit
def _code_block(raw, J: tl.constexpr, BITS: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr,
                FREE: tl.constexpr):  # fmt: skip
    """Column block ``J`` of packed bytes (``int16``) as ``DTYPE`` values ``OFFSET + factor * code``, exactly.

    Bits ``J*BITS..`` of byte ``c`` are dim ``J*D/k + c`` (k = 8/BITS codes per byte). For 16-bit
    floats the code is OR-ed into the mantissa of a power of two whose ulp is 1 (``MAGIC``: bf16
    128.0, fp16 1024.0), two integer operations and a free bitcast: an int-to-float conversion runs
    at a quarter of the ALU rate and was the bottleneck of the dequantizing first version. float32
    (``MAGIC`` 0, offset 0) converts directly. The first ``FREE`` blocks lie inside the mantissa
    where they are, so they skip the shift and come out multiplied by ``2**(J*BITS)``
    (:func:`_part_factor`); q is divided by the same power of two, which is exact.
    """
    MASK: tl.constexpr = (1 << BITS) - 1
    if J < FREE:
        codes = raw & (MASK << (J * BITS))
    else:
        codes = (raw >> (J * BITS)) & MASK
    # (Triton compiles the statements after a returning static branch too, hence the else.)
    if MAGIC == 0:
        values = codes.to(DTYPE)
    else:
        values = (codes | MAGIC).to(DTYPE, bitcast=True)
    return values


@triton.jit
def _code_blocks(raw, BITS: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr, FREE: tl.constexpr,
                 UNPACK: tl.constexpr):  # fmt: skip
    """All column blocks of a packed ``uint8`` tile (blocks 2-3 repeat 0-1 for 4-bit codes).

    With ``UNPACK`` (PTX from :func:`_unpack_asm`: compiled 16-bit kernels) the 4 bytes a thread holds
    in one 32-bit register unpack together, about one instruction per code; the portable path
    (interpreter, float32) unpacks byte by byte with :func:`_code_block`. Both give the same values.
    """
    PARTS: tl.constexpr = 8 // BITS
    if UNPACK != "":
        if PARTS == 4:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r,r", [raw],
                                                       dtype=(DTYPE.value,) * 4, is_pure=True, pack=4)  # fmt: skip
        else:
            c0, c1 = tl.inline_asm_elementwise(UNPACK, "=r,=r,=r,=r,r", [raw], dtype=(DTYPE.value,) * 2, is_pure=True,
                                               pack=4)  # fmt: skip
            c2, c3 = c0, c1
    else:
        raw = raw.to(tl.int16)
        c0, c1 = _code_block(raw, 0, BITS, DTYPE, MAGIC, FREE), _code_block(raw, 1, BITS, DTYPE, MAGIC, FREE)
        c2, c3 = c0, c1
        if PARTS == 4:
            c2, c3 = _code_block(raw, 2, BITS, DTYPE, MAGIC, FREE), _code_block(raw, 3, BITS, DTYPE, MAGIC, FREE)
    return c0, c1, c2, c3


@triton.jit
def _load_code_blocks(C, c_n, rows, valid, D: tl.constexpr, BITS: tl.constexpr, DTYPE: tl.constexpr,
                      MAGIC: tl.constexpr, FREE: tl.constexpr, UNPACK: tl.constexpr):  # fmt: skip
    """The column blocks of packed rows ``rows`` of one head (``C`` its row 0), as :func:`_code_blocks`."""
    if BITS == 1:
        # Block j's two halves are bits 2j and 2j + 1 of the plane's bytes: a [N, D/4] tile of them, as
        # 3-bit codes read their high plane.
        DP1: tl.constexpr = D // 4
        columns1 = tl.arange(0, DP1)
        plane = tl.load(C + rows[:, None] * c_n + (columns1 % (D // 8))[None, :], mask=valid[:, None], other=0)
        c0, c1, c2, c3 = _code_blocks1(plane, D, DTYPE, MAGIC)
    elif BITS == 3:
        DP: tl.constexpr = D // 4
        columns = tl.arange(0, DP)
        low = tl.load(C + rows[:, None] * c_n + columns[None, :], mask=valid[:, None], other=0)
        # Both halves of a block read the same high-plane bytes (different bits): a [N, D/4] tile of them.
        high = tl.load(C + rows[:, None] * c_n + DP + (columns % (D // 8))[None, :], mask=valid[:, None], other=0)
        c0, c1, c2, c3 = _code_blocks3(low, high, D, DTYPE, MAGIC)
    else:
        raw = tl.load(C + rows[:, None] * c_n + tl.arange(0, D * BITS // 8)[None, :], mask=valid[:, None], other=0)
        c0, c1, c2, c3 = _code_blocks(raw, BITS, DTYPE, MAGIC, FREE, UNPACK)
    return c0, c1, c2, c3


@triton.jit
def _code_blocks1(plane, D: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr):
    """1-bit codes as 4 column blocks ``OFFSET + code`` (factor 1); ``plane`` holds byte ``c % (D/8)`` at column ``c``."""
    # Block j's second half reads bit 2j + 1: one shift of the tile puts every block's bit at 2j.
    plane = plane.to(tl.int16) >> (tl.arange(0, D // 4) >= D // 8).to(tl.int16)[None, :]
    c0 = _code1(plane, 0, DTYPE, MAGIC)
    c1 = _code1(plane, 1, DTYPE, MAGIC)
    c2 = _code1(plane, 2, DTYPE, MAGIC)
    c3 = _code1(plane, 3, DTYPE, MAGIC)
    return c0, c1, c2, c3


@triton.jit
def _code1(plane, J: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr):
    """Block ``J``'s codes: bit ``2J`` of the (shifted) plane."""
    codes = (plane >> (2 * J)) & 1
    if MAGIC == 0:
        values = codes.to(DTYPE)
    else:
        values = (codes | MAGIC).to(DTYPE, bitcast=True)
    return values


@triton.jit
def _code_blocks3(low, high, D: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr):
    """3-bit codes as 4 column blocks ``OFFSET + code`` (factor 1): ``low`` the 2-bit plane ``[N, D/4]``,
    ``high`` the 1-bit plane's byte ``c % (D/8)`` at column ``c``."""
    low = low.to(tl.int16)
    # Block j's second half reads bit 2j + 1: one shift of the tile puts every block's bit at 2j.
    high = high.to(tl.int16) >> (tl.arange(0, D // 4) >= D // 8).to(tl.int16)[None, :]
    c0 = _code3(low, high, 0, DTYPE, MAGIC)
    c1 = _code3(low, high, 1, DTYPE, MAGIC)
    c2 = _code3(low, high, 2, DTYPE, MAGIC)
    c3 = _code3(low, high, 3, DTYPE, MAGIC)
    return c0, c1, c2, c3


@triton.jit
def _code3(low, high, J: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr):
    """Block ``J``'s codes: bits ``2J, 2J + 1`` of ``low`` and bit ``2J`` of ``high`` moved to bit 2."""
    if J == 0:
        top = (high << 2) & 4
    else:
        top = (high >> (2 * J - 2)) & 4
    codes = ((low >> (2 * J)) & 3) | top
    if MAGIC == 0:
        values = codes.to(DTYPE)
    else:
        values = (codes | MAGIC).to(DTYPE, bitcast=True)
    return values


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
    q0, q1, q2, q3, q_sum, s0, s1, s2, s3, b0, b1, b2, b3, k0, k1, k2, k3, score_scale, scales, zeros,
    D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
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
def _value_weights(p, scales, zeros, GROUP: tl.constexpr, GROUPS: tl.constexpr, DTYPE: tl.constexpr,
                   INTERPRETED: tl.constexpr):  # fmt: skip
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
    return (q.to(tl.float32) * (1.0 / _part_factor(J, BITS, FREE))).to(q.dtype)


@triton.jit
def _packed_span(
    q0, q1, q2, q3, q_sum, s0, s1, s2, s3, m_i, l_i, a0, a1, a2, a3,
    KC, kc_n, KS, ks_n, KZ, kz_n, VC, vc_n, VS, vs_n, VZ, vz_n, start, end, MASK, position, score_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr, K_GROUPS: tl.constexpr,
    V_BITS: tl.constexpr, V_GROUPS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    K_FREE: tl.constexpr, V_FREE: tl.constexpr, K_UNPACK: tl.constexpr, V_UNPACK: tl.constexpr,
    HAS_MASK: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Attend over packed history rows ``[start, end)`` of one KV head; codes are never dequantized."""
    V_PARTS: tl.constexpr = 4 - 2 * (V_BITS // 4)
    dtype = q0.dtype
    q0, q1 = _divided(q0, 0, K_BITS, K_FREE), _divided(q1, 1, K_BITS, K_FREE)
    q2, q3 = _divided(q2, 2, K_BITS, K_FREE), _divided(q3, 3, K_BITS, K_FREE)
    b0, b1 = s0 * (OFFSET / _part_factor(0, K_BITS, K_FREE)), s1 * (OFFSET / _part_factor(1, K_BITS, K_FREE))
    b2, b3 = s2 * (OFFSET / _part_factor(2, K_BITS, K_FREE)), s3 * (OFFSET / _part_factor(3, K_BITS, K_FREE))
    # Value corrections per column block (see _value_weights), rescaled like the accumulators.
    c0 = tl.zeros(l_i.shape, tl.float32)
    c1, c2, c3 = c0, c0, c0
    # The metadata of tile i+1 is loaded while tile i computes: too narrow for the pipeliner's
    # asynchronous copies (2 bytes a thread), it stalled every tile on a global load.
    k_scales, k_zeros, v_scales, v_zeros = _metadata(
        KS, ks_n, KZ, kz_n, K_GROUPS, VS, vs_n, VZ, vz_n, V_GROUPS, start + tl.arange(0, BLOCK_N), end
    )
    for block in range(start, end, BLOCK_N):
        rows = block + tl.arange(0, BLOCK_N)
        valid = _key_valid(rows, end, MASK, position, HAS_MASK)
        ahead = _metadata(KS, ks_n, KZ, kz_n, K_GROUPS, VS, vs_n, VZ, vz_n, V_GROUPS, rows + BLOCK_N, end)
        k0, k1, k2, k3 = _load_code_blocks(KC, kc_n, rows, valid, D, K_BITS, dtype, MAGIC, K_FREE, K_UNPACK)
        scores = _packed_scores(
            q0, q1, q2, q3, q_sum, s0, s1, s2, s3, b0, b1, b2, b3, k0, k1, k2, k3, score_scale, k_scales, k_zeros,
            D, K_BITS, K_GROUPS, INTERPRETED,
        )  # fmt: skip
        m_i, l_i, alpha, p = _online_softmax(scores, valid, m_i, l_i)
        v0, v1, v2, v3 = _load_code_blocks(VC, vc_n, rows, valid, D, V_BITS, dtype, MAGIC, V_FREE, V_UNPACK)
        w0, sw0, sz0 = _value_weights(p, v_scales, v_zeros, _group_of(0, D, V_BITS, V_GROUPS), V_GROUPS, dtype,
                                      INTERPRETED)  # fmt: skip
        w1, sw1, sz1, w2, sw2, sz2, w3, sw3, sz3 = w0, sw0, sz0, w0, sw0, sz0, w0, sw0, sz0
        if V_GROUPS > 1:
            w1, sw1, sz1 = _value_weights(p, v_scales, v_zeros, _group_of(1, D, V_BITS, V_GROUPS), V_GROUPS, dtype,
                                          INTERPRETED)  # fmt: skip
            if V_PARTS == 4:
                w2, sw2, sz2 = _value_weights(p, v_scales, v_zeros, _group_of(2, D, V_BITS, V_GROUPS), V_GROUPS,
                                              dtype, INTERPRETED)  # fmt: skip
                w3, sw3, sz3 = _value_weights(p, v_scales, v_zeros, _group_of(3, D, V_BITS, V_GROUPS), V_GROUPS,
                                              dtype, INTERPRETED)  # fmt: skip
        k_scales, k_zeros, v_scales, v_zeros = ahead
        a0 = a0 * alpha[:, None] + dot(w0, v0, INTERPRETED)
        a1 = a1 * alpha[:, None] + dot(w1, v1, INTERPRETED)
        c0 = c0 * alpha + sz0 + sw0 * (OFFSET / _part_factor(0, V_BITS, V_FREE))
        c1 = c1 * alpha + sz1 + sw1 * (OFFSET / _part_factor(1, V_BITS, V_FREE))
        if V_PARTS == 4:
            a2 = a2 * alpha[:, None] + dot(w2, v2, INTERPRETED)
            a3 = a3 * alpha[:, None] + dot(w3, v3, INTERPRETED)
            c2 = c2 * alpha + sz2 + sw2 * (OFFSET / _part_factor(2, V_BITS, V_FREE))
            c3 = c3 * alpha + sz3 + sw3 * (OFFSET / _part_factor(3, V_BITS, V_FREE))
    a0 = a0 * (1.0 / _part_factor(0, V_BITS, V_FREE)) - c0[:, None]
    a1 = a1 * (1.0 / _part_factor(1, V_BITS, V_FREE)) - c1[:, None]
    a2 = a2 * (1.0 / _part_factor(2, V_BITS, V_FREE)) - c2[:, None]
    a3 = a3 * (1.0 / _part_factor(3, V_BITS, V_FREE)) - c3[:, None]
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
def _dense_span(
    q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, K, k_stride_n, V, v_stride_n, start, end, MASK, position, score_scale,
    ring_start, ring_rows, ring_size,
    D: tl.constexpr, BLOCK_N: tl.constexpr, K_PARTS: tl.constexpr, V_PARTS: tl.constexpr,
    HAS_MASK: tl.constexpr, RING: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Attend over dense rows ``[start, end)`` of one KV head (K/V point at that head's row 0).

    With ``RING`` the rows are a ring buffer of ``ring_size`` rows of which the ``ring_rows`` from
    ``ring_start`` on (wrapping around) are valid; softmax does not depend on the order of keys.
    """
    for block in range(start, end, BLOCK_N):
        rows = block + tl.arange(0, BLOCK_N)
        valid = _key_valid(rows, end, MASK, position, HAS_MASK)
        if RING:
            valid = valid & ((rows - ring_start + ring_size) % ring_size < ring_rows)
        k0, k1, k2, k3 = _load_parts(K, k_stride_n, rows, valid, D, K_PARTS)
        v0, v1, v2, v3 = _load_parts(V, v_stride_n, rows, valid, D, V_PARTS)
        m_i, l_i, a0, a1, a2, a3 = _attend(
            q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, m_i, l_i, a0, a1, a2, a3, score_scale,
            K_PARTS, V_PARTS, INTERPRETED,
        )  # fmt: skip
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _store_new_rows(NK, nk_stride_n, NV, nv_stride_n, RK, rk_stride_n, RV, rv_stride_n, start, end, first_slot,
                    ring_size, D: tl.constexpr):  # fmt: skip
    """Static decoding: new rows ``[start, end)`` of one KV head into its ring, row r at slot
    ``(first_slot + r) % ring_size`` (the launch that attends them also stores them)."""
    dims = tl.arange(0, D)
    for row in range(start, end):
        slot = (first_slot + row) % ring_size
        tl.store(RK + slot * rk_stride_n + dims, tl.load(NK + row * nk_stride_n + dims))
        tl.store(RV + slot * rv_stride_n + dims, tl.load(NV + row * nv_stride_n + dims))


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def _decode_stage1_kernel(
    Q, q_st,
    SK, sk_st, SV, sv_st, n_sink, chunk_sink,
    RK, rk_st, RV, rv_st, n_recent, chunk_recent,
    NK, nk_st, NV, nv_st, n_new, chunk_new,
    KC, kc_st, KS, ks_st, KZ, kz_st, VC, vc_st, VS, vs_st, VZ, vz_st, n_hist, chunk_hist,
    MASK, mask_stride_b, PM, PL, PACC, score_scale, hist_splits, dense_splits, n_slots, first_slot, LENGTHS,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DENSE_BLOCK_N: tl.constexpr,
    D: tl.constexpr, K_BITS: tl.constexpr, K_GROUPS: tl.constexpr, V_BITS: tl.constexpr,
    V_GROUPS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, K_FREE: tl.constexpr, V_FREE: tl.constexpr,
    K_UNPACK: tl.constexpr, V_UNPACK: tl.constexpr, HAS_MASK: tl.constexpr, RING: tl.constexpr,
    INTERPRETED: tl.constexpr, AFTER_SPAN: tl.constexpr,
):  # fmt: skip
    if AFTER_SPAN:
        # Launched while the Gluon span still runs (programmatic dependent launch), on slots it does not
        # touch. The merge may launch as soon as every program here has started: it waits for this grid,
        # which completes only after the span has (below). Released at the end instead, the merge's launch
        # sat behind the last dense program's work: 25.1 us against 24.9 at batch 1 and 100K, 14.1 against
        # 13.8 at 32K (eval/results/gluon_dense_trigger*.md).
        tl.extra.cuda.gdc_launch_dependents()
    # K tiles (and q) split in as many column blocks as K's codes unpack in (4 for 1- to 3-bit codes,
    # 2 for 4-bit), V tiles (and acc) as V's.
    K_PARTS: tl.constexpr = 4 - 2 * (K_BITS // 4)
    V_PARTS: tl.constexpr = 4 - 2 * (V_BITS // 4)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    local = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = local < GROUP
    heads = kv_head * GROUP + local
    slot = tl.program_id(2) + first_slot  # slots below first_slot are another kernel's (the Gluon span)
    q0, q1, q2, q3 = _load_parts(Q + b * q_st[0], q_st[1], heads, head_ok, D, K_PARTS)
    MASK = MASK + b * mask_stride_b

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    a0 = tl.zeros((BLOCK_H, D // V_PARTS), tl.float32)
    a1, a2, a3 = a0, a0, a0
    # Slots: history splits first, then `dense_splits` for each of sink, recent and new.
    # Static decoding (RING): the history is allocated at capacity and the recent window is a ring;
    # their lengths are read here from device memory, so a captured launch stays valid as they grow.
    # The key mask then covers the sink only (left padding never reaches past it).
    ring_start, ring_rows = 0, n_recent
    if RING:
        n_hist = tl.load(LENGTHS).to(tl.int32)
        chunk_hist = tl.cdiv(tl.cdiv(n_hist, hist_splits), BLOCK_N) * BLOCK_N
        ring_start, ring_rows = tl.load(LENGTHS + 1).to(tl.int32), tl.load(LENGTHS + 2).to(tl.int32)
        ring_rows -= n_new  # the ring's newest rows are the new rows' slots: attended as new rows, stored here
    TIER_MASK: tl.constexpr = HAS_MASK and not RING
    if slot < hist_splits:
        start = slot * chunk_hist
        # Sums of q as the dots see it (rounded to the K dtype), for the zero-point corrections.
        s0, s1 = tl.sum(q0.to(tl.float32), axis=1), tl.sum(q1.to(tl.float32), axis=1)
        s2, s3 = s0, s1
        if K_PARTS == 4:
            s2, s3 = tl.sum(q2.to(tl.float32), axis=1), tl.sum(q3.to(tl.float32), axis=1)
            q_sum = s0 + s1 + s2 + s3
        else:
            q_sum = s0 + s1
        m_i, l_i, a0, a1, a2, a3 = _packed_span(
            q0, q1, q2, q3, q_sum, s0, s1, s2, s3, m_i, l_i, a0, a1, a2, a3,
            KC + b * kc_st[0] + kv_head * kc_st[1], kc_st[2], KS + b * ks_st[0] + kv_head * ks_st[1], ks_st[2],
            KZ + b * kz_st[0] + kv_head * kz_st[1], kz_st[2], VC + b * vc_st[0] + kv_head * vc_st[1], vc_st[2],
            VS + b * vs_st[0] + kv_head * vs_st[1], vs_st[2], VZ + b * vz_st[0] + kv_head * vz_st[1], vz_st[2],
            start, tl.minimum(start + chunk_hist, n_hist), MASK, n_sink, score_scale,
            D, BLOCK_N, K_BITS, K_GROUPS, V_BITS, V_GROUPS, MAGIC, OFFSET, K_FREE, V_FREE, K_UNPACK, V_UNPACK, TIER_MASK,
            INTERPRETED,
        )  # fmt: skip
    else:
        tier = (slot - hist_splits) // dense_splits
        split = (slot - hist_splits) % dense_splits
        if tier == 0:
            start = split * chunk_sink
            m_i, l_i, a0, a1, a2, a3 = _dense_span(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, SK + b * sk_st[0] + kv_head * sk_st[1], sk_st[2],
                SV + b * sv_st[0] + kv_head * sv_st[1], sv_st[2], start, tl.minimum(start + chunk_sink, n_sink),
                MASK, 0, score_scale, 0, 0, 1, D, DENSE_BLOCK_N, K_PARTS, V_PARTS, HAS_MASK, False, INTERPRETED,
            )  # fmt: skip
        elif tier == 1:
            start = split * chunk_recent
            m_i, l_i, a0, a1, a2, a3 = _dense_span(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, RK + b * rk_st[0] + kv_head * rk_st[1], rk_st[2],
                RV + b * rv_st[0] + kv_head * rv_st[1], rv_st[2], start, tl.minimum(start + chunk_recent, n_recent),
                MASK, n_sink + n_hist, score_scale, ring_start, ring_rows, n_recent, D, DENSE_BLOCK_N, K_PARTS, V_PARTS,
                TIER_MASK, RING, INTERPRETED,
            )  # fmt: skip
        else:
            start = split * chunk_new
            if RING and tl.program_id(1) % HEAD_BLOCKS == 0:
                _store_new_rows(
                    NK + b * nk_st[0] + kv_head * nk_st[1], nk_st[2], NV + b * nv_st[0] + kv_head * nv_st[1], nv_st[2],
                    RK + b * rk_st[0] + kv_head * rk_st[1], rk_st[2], RV + b * rv_st[0] + kv_head * rv_st[1], rv_st[2],
                    start, tl.minimum(start + chunk_new, n_new), ring_start + ring_rows, n_recent, D,
                )  # fmt: skip
            m_i, l_i, a0, a1, a2, a3 = _dense_span(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, NK + b * nk_st[0] + kv_head * nk_st[1], nk_st[2],
                NV + b * nv_st[0] + kv_head * nv_st[1], nv_st[2], start, tl.minimum(start + chunk_new, n_new),
                MASK, n_sink + n_hist + n_recent, score_scale, 0, 0, 1, D, DENSE_BLOCK_N, K_PARTS, V_PARTS, TIER_MASK, False,
                INTERPRETED,
            )  # fmt: skip

    out = (b * (tl.num_programs(1) // HEAD_BLOCKS * GROUP) + heads) * n_slots + slot
    tl.store(PM + out, m_i, mask=head_ok)
    tl.store(PL + out, l_i, mask=head_ok)
    DPV: tl.constexpr = D // V_PARTS
    pointers = PACC + out[:, None] * D + tl.arange(0, DPV)[None, :]
    tl.store(pointers, a0, mask=head_ok[:, None])
    tl.store(pointers + DPV, a1, mask=head_ok[:, None])
    if V_PARTS == 4:
        tl.store(pointers + 2 * DPV, a2, mask=head_ok[:, None])
        tl.store(pointers + 3 * DPV, a3, mask=head_ok[:, None])
    if AFTER_SPAN:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _decode_stage2_kernel(
    PM, PL, PACC, O, o_st, n_slots,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SLOTS: tl.constexpr, INTERPRETED: tl.constexpr,
    DEPENDENT: tl.constexpr,
):  # fmt: skip
    """Merge the slots of one (batch, query head, block of dims): exact softmax over all tiers and splits.
    ``DEPENDENT``: launched before stage 1 has finished (programmatic dependent launch); waits for it."""
    if DEPENDENT:
        # the next call's span may start now: it copies only settled history before it waits on this grid
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slots = tl.arange(0, SLOTS)
    used = slots < n_slots
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    base = (b * tl.num_programs(1) + head) * n_slots
    m = tl.load(PM + base + slots, mask=used, other=float("-inf"))
    l = tl.load(PL + base + slots, mask=used, other=0.0)
    acc = tl.load(PACC + (base + slots)[:, None] * D + dims[None, :], mask=used[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty slots (m = -inf) weigh 0
    total = tl.sum(weight * l, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)  # all masked -> 0
    tl.store(O + b * o_st[0] + head * o_st[1] + dims, to_dtype(out, O.dtype.element_ty, INTERPRETED))


# --------------------------------------------------------------------------------------- launcher


# One warp a program, no stage-1 barrier: each warp keeps its own softmax state over its tiles, and
# the metadata prefetch (see _packed_span) hides what latency is left. On an H200 at 100K, 64-key
# tiles on 1 warp with 2 stages took 45, 302 and 1,168 us at batches 1, 8 and 32, against 58, 408
# and 1,595 us for 128-key tiles on 4 warps (decode_kernel_tuning.md, decode_kernel_tuning_4warps.md).
_WARPS = 1
_STAGES = 2
_TILE_CODES = 8192  # keys x head_dim a tile: ~250 registers a thread on 1 warp, no spills up to head_dim 256
# Programs of one SM at once: registers bound them, 64K an SM (sm_90 compiles at head_dim 128 and
# each warp count's default tile: 1 warp 245 registers a thread, 255 on the H200's toolchain per
# Nsight Compute; 2 warps 168, 4 warps 128, 8 warps 153). Two-warp programs: 6 an SM took 334 us
# at batch 8 and 100K, 8 (two waves) 434.
_PROGRAMS_PER_SM = {1: 8, 2: 6, 4: 4, 8: 1}
_MERGE_BLOCK_D = 32
_MERGE_TILE = 8192  # floats of a merge program's [slots, dims] tile: 64 registers a thread at 4 warps
# Warps a merge program: 1-8 took the same at each tile (H200, 100K, eval/results/gluon_history_merge_warps.md);
# the tile counts (2048 floats: 29.0-29.7 us at batch 1, 8192: 27.0-27.3), as fewer programs do.
_MERGE_WARPS = 4


def _device_programs(device: torch.device, programs_per_sm: int) -> int:
    """History programs that run at once on ``device`` (4 off CUDA). History splits fill one such
    wave: a partial second wave nearly doubled the time (batch 8 at 100K on an H200: 17 splits 704
    us, 16 splits 526 us; decode_kernel_tuning_v3.md), and 12 one-warp programs an SM instead of 8
    took 62 us instead of 45 at batch 1."""
    return programs_per_sm * _multiprocessors(device) if device.type == "cuda" else 4


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(
    length: int, requested: int, programs_per_split: int, device: torch.device, block_n: int, programs_per_sm: int,
    cap: int | None,
) -> tuple[int, int]:
    """``(splits, chunk)`` for a history of ``length`` rows; ``chunk`` is a multiple of ``block_n``.

    The history programs fill one wave of :func:`_device_programs` where the batch allows, at most
    ``cap`` splits (the short dense-tier programs are scheduled after them and only add a short tail).
    """
    if length == 0:
        return 0, block_n
    wave = max(1, _device_programs(device, programs_per_sm) // programs_per_split)
    return split_rows(length, requested or min(cap or wave, cdiv(length, _MIN_SPLIT_TOKENS), wave), block_n)


def _dense_chunk(length: int, splits: int, block_n: int) -> int:
    return max(1, cdiv(cdiv(length, splits), block_n)) * block_n


def _block_sizes(group: int, head_dim: int, block_n: int) -> tuple[int, int, int]:
    """``(block_h, head_blocks, block_n)``: one row per query head of the group (Triton pads the
    MMA's 16 rows itself, and 4 real rows spend less on the softmax than 16 padded ones), and
    ``_TILE_CODES // head_dim`` keys a tile unless ``block_n`` is given."""
    block_h = min(64, next_power_of_two(group))
    return block_h, cdiv(group, block_h), block_n or min(128, _TILE_CODES // head_dim)


def decode_attention_triton(
    q: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    recent_k: torch.Tensor,
    recent_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    key_mask: torch.Tensor | None,
    k_bits: int,
    v_bits: int,
    sm_scale: float,
    num_splits: int = 0,
    block_n: int = 0,
    num_warps: int = 0,
    num_stages: int = 0,
    lengths: torch.Tensor | None = None,
    history_settled: bool = False,
    *,
    span_variant: SpanVariant | None = None,
) -> torch.Tensor:
    """Launch stage 1 and stage 2 (arguments as :func:`decode_attention`).

    ``num_splits``, ``block_n`` (keys per tile), ``num_warps`` and ``num_stages`` of stage 1 are tuning
    knobs, 0 meaning automatic (see :func:`_block_sizes`). ``span_variant``: a
    ``decode_history_gluon.SpanVariant`` of the Gluon span for kernel development (None: production).
    """
    gluon = _gluon_history(q, k_codes, k_bits, v_bits, k_scale, v_scale, tuned=bool(num_splits or block_n or num_warps))
    batch, q_heads, head_dim = q.shape
    kv_heads = sink_k.shape[1]
    group = q_heads // kv_heads
    block_h, head_blocks, block_n = _block_sizes(group, head_dim, block_n)
    num_stages = num_stages or (1 if q.dtype == torch.float32 else _STAGES)
    n_sink, n_hist, n_recent, n_new = sink_k.shape[2], k_codes.shape[2], recent_k.shape[2], new_k.shape[2]
    dense_tokens = _SPAN_DENSE_SPLIT_TOKENS if gluon else _DENSE_SPLIT_TOKENS
    # One number of splits for all three tiers, which leaves some empty beside the span (at 100K, 11 of 24
    # a KV head). Splits of each tier's own, none empty, were faster at batch 1 and 100K (24.5-24.6 us
    # against 24.7-24.8) but slower at 32K (14.6 against 13.8). There the span is half a wave (127 splits of
    # 4 tiles), so dense programs fit beside it, and without the empty ones the next call's span programs
    # started up to 7.6 us late, not 2.0 (eval/results/gluon_dense_trigger*.md,
    # timeline_decode_32k_*.md).
    dense_splits = max(1, cdiv(max(n_sink, n_recent, n_new), dense_tokens))
    programs_per_split = batch * kv_heads * head_blocks
    num_warps = num_warps or _WARPS
    if gluon:  # the explicit-layout span fills the history slots: one-warp programs of 64 keys, all heads
        from .decode_history_gluon import PRODUCTION, history_into

        span_variant = span_variant or PRODUCTION
        hist_splits, chunk_hist = _splits(n_hist, 0, batch * kv_heads, q.device, 64, span_variant.programs_per_sm(),
                                          None)  # fmt: skip
    else:
        hist_splits, chunk_hist = _splits(n_hist, num_splits, programs_per_split, q.device, block_n,
                                          _PROGRAMS_PER_SM.get(num_warps, 1), _MAX_SPLITS)  # fmt: skip
    n_slots = hist_splits + 3 * dense_splits

    partial_m, partial_l, partial_acc = _partials(batch, q_heads, n_slots, head_dim, q.device, reuse=lengths is None)
    out = torch.empty(batch, q_heads, head_dim, dtype=q.dtype, device=q.device)
    # Masks travel as bytes (bool pointers are not portable across Triton versions). Without one the
    # kernel never reads the pointer: q stands in, sparing an allocation per call.
    mask = q if key_mask is None else key_mask.to(torch.uint8).contiguous()
    t = _last_dim_contiguous
    magic, offset = _CODE_MAGIC[q.dtype][:2]

    first_slot = hist_splits if gluon else 0
    # On Hopper and later the dense tiers and the merge launch early (programmatic dependent launch):
    # the dense tiers fill the span's tail instead of waiting for all of it, and launch gaps hide.
    overlap = gluon and programmatic_launch(q.device)
    if gluon:
        history_into(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, sm_scale, partial_m, partial_l,
                     partial_acc, hist_splits, chunk_hist, lengths, launch_dependents=overlap,
                     early=overlap and history_settled, variant=span_variant)  # fmt: skip
    launch_kernel(_decode_stage1_kernel, (batch, kv_heads * head_blocks, n_slots - first_slot),
        *t(q),
        *t(sink_k), *t(sink_v), n_sink, _dense_chunk(n_sink, dense_splits, _DENSE_BLOCK_N),
        *t(recent_k), *t(recent_v), n_recent, _dense_chunk(n_recent, dense_splits, _DENSE_BLOCK_N),
        *t(new_k), *t(new_v), n_new, _dense_chunk(n_new, dense_splits, _DENSE_BLOCK_N),
        *t(k_codes), *t(k_scale), *t(k_zero), *t(v_codes), *t(v_scale), *t(v_zero), n_hist, chunk_hist,
        mask, mask.stride(0), partial_m, partial_l, partial_acc, sm_scale * LOG2E, hist_splits, dense_splits, n_slots,
        first_slot, q if lengths is None else lengths,  # unread without RING
        GROUP=group, HEAD_BLOCKS=head_blocks, BLOCK_H=block_h, BLOCK_N=block_n, DENSE_BLOCK_N=_DENSE_BLOCK_N, D=head_dim,
        K_BITS=k_bits, K_GROUPS=k_scale.shape[-1], V_BITS=v_bits, V_GROUPS=v_scale.shape[-1],
        MAGIC=magic, OFFSET=offset, K_FREE=_shift_free_blocks(k_bits, q.dtype), V_FREE=_shift_free_blocks(v_bits, q.dtype),
        K_UNPACK="" if INTERPRET else _unpack_asm(k_bits, q.dtype),
        V_UNPACK="" if INTERPRET else _unpack_asm(v_bits, q.dtype),
        HAS_MASK=key_mask is not None, RING=lengths is not None, INTERPRETED=INTERPRET, AFTER_SPAN=overlap,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=overlap,
    )  # fmt: skip
    # Blocks of dims spread the merge over more programs: one program per head (32 at batch 1) took
    # 4.4 us a layer at 100K, merging 135 slots; one per 32 dims 2.2 us. Narrower beyond 256 slots.
    slots = next_power_of_two(n_slots)
    block_d = min(head_dim, _MERGE_BLOCK_D, max(1, _MERGE_TILE // slots))
    launch_kernel(_decode_stage2_kernel, (batch, q_heads, head_dim // block_d),
        partial_m, partial_l, partial_acc, *t(out), n_slots,
        D=head_dim, BLOCK_D=block_d, SLOTS=slots, INTERPRETED=INTERPRET, DEPENDENT=overlap,
        num_warps=_MERGE_WARPS, launch_pdl=overlap,
    )  # fmt: skip
    return out


# (device, stream, thread) -> the partial buffers of the latest eager call there
_PARTIALS: dict[tuple, tuple[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}


def _partials(batch: int, q_heads: int, n_slots: int, head_dim: int, device: torch.device, reuse: bool):
    """``(m, l, acc)`` slot buffers, float32 ``[B, Hq, n_slots]`` (acc ``[..., D]``).

    They live from stage 1 to stage 2 of one call. Calls from one thread on one stream run in
    order, so eager calls there share one set while the shape stays (every layer of a step):
    three allocations fewer a call, and eager batch-1 decoding is bound by host time. One set stays
    allocated per stream and thread (at most ~300 slots: 4.4 MB at batch 1 for 32 heads of 128 dims).
    Static decoding (``reuse`` false) allocates inside the graph it is captured in.
    """
    shape = (batch, q_heads, n_slots, head_dim)
    reuse = reuse and device.type == "cuda"
    if reuse:
        where = (device, triton.runtime.driver.active.get_current_stream(device.index), threading.get_ident())
        kept = _PARTIALS.get(where)
        if kept is not None and kept[0] == shape:
            return kept[1]
    m = torch.empty(batch, q_heads, n_slots, dtype=torch.float32, device=device)
    buffers = (m, torch.empty_like(m), torch.empty(shape, dtype=torch.float32, device=device))
    if reuse:
        _PARTIALS[where] = (shape, buffers)
    return buffers


HISTORY_KERNELS = ("gluon", "triton")


def _gluon_history(q, k_codes, k_bits, v_bits, k_scale, v_scale, tuned: bool) -> bool:
    """Whether the history slots come from the explicit-layout span (``kernels/decode_history_gluon.py``):
    on a GPU, for the shapes it covers, at the launcher's default tiles, where this Triton has Gluon,
    unless ``OSCAR_DECODE_HISTORY=triton`` asks for the Triton stage 1 throughout.

    Raises:
        ValueError: ``OSCAR_DECODE_HISTORY`` is neither ``gluon`` nor ``triton``.
        RuntimeError: ``OSCAR_DECODE_HISTORY=gluon`` asked for the span where it cannot load.
    """
    import os

    choice = os.environ.get("OSCAR_DECODE_HISTORY")
    if choice not in (None, *HISTORY_KERNELS):
        raise ValueError(f"OSCAR_DECODE_HISTORY={choice!r}: expected one of {HISTORY_KERNELS}")
    covered = (
        choice != "triton" and q.is_cuda and not INTERPRET
        and q.dtype == torch.bfloat16 and q.shape[-1] == 128 and (k_bits, v_bits) == (2, 2)
        and k_scale.shape[-1] == v_scale.shape[-1] == 1 and q.shape[1] // k_codes.shape[1] <= 8
        and not tuned and k_codes.shape[2] > 0
    )  # fmt: skip
    if not covered:
        return False
    reason = _gluon_unavailable()
    if reason is not None and choice == "gluon":
        raise RuntimeError(f"OSCAR_DECODE_HISTORY=gluon, but the Gluon span cannot load here ({reason})")
    return reason is None


@functools.cache
def _gluon_unavailable() -> str | None:
    """Why the Gluon span cannot load with this Triton (it was written for 3.6 and later), or None.
    Logged once; the Triton stage 1 then reads the history."""
    try:
        from . import decode_history_gluon  # noqa: F401
    except (ImportError, AttributeError) as error:
        reason = f"triton {triton.__version__}: {type(error).__name__}: {error}"
        logger.warning("the Gluon history span cannot load (%s): decoding uses the Triton kernel alone", reason)
        return reason
    return None


def _shift_free_blocks(bits: int, dtype: torch.dtype) -> int:
    """How many leading column blocks of a packed byte lie inside ``dtype``'s mantissa.

    Such a block's codes are masked where they are, without a shift: ``OFFSET + 2**(j*bits) * c``
    (:func:`_part_factor`). bf16 with 2-bit codes: blocks 0-2 of 4, a quarter fewer unpacking
    instructions than shifting each block down. None for 3-bit codes, assembled from two planes, nor
    for 1-bit codes, unpacked in 4 blocks of two bits each.
    """
    if bits in (1, 3):
        return 0
    return min(8 // bits, _CODE_MAGIC[dtype][2] // bits)


@functools.cache
def _unpack_asm(bits: int, dtype: torch.dtype) -> str:
    """PTX for :func:`_code_blocks`: 4 packed bytes in, their codes as 16-bit floats ``OFFSET + f * c`` out.

    ``prmt`` moves bytes 0 and 1 (then 2 and 3) into the low bytes of the two 16-bit halves of a
    register; per column block ``j`` one ``lop3`` ``(t & mask) | magic`` (after a shift of ``t`` by
    ``j*bits`` for blocks outside the mantissa, :func:`_shift_free_blocks`) then yields two codes,
    the same values as :func:`_code_block`. Output element ``i`` depends on input byte ``i`` only, so
    the result does not depend on how the compiler lays the bytes out across threads and registers.
    Empty (the portable path) for float32 and for 1- and 3-bit codes; the interpreter runs the portable
    path too.
    """
    magic = _CODE_MAGIC[dtype][0]
    if magic == 0 or bits in (1, 3):
        return ""
    free, magic2 = _shift_free_blocks(bits, dtype), magic * 0x10001
    lines = [".reg .b32 lo, hi, t;", "prmt.b32 lo, $IN, 0, 0x1100;", "prmt.b32 hi, $IN, 0, 0x3322;"]
    for j in range(8 // bits):
        for half, word in enumerate(("lo", "hi")):
            mask = ((1 << bits) - 1) * 0x10001
            if j < free:
                source, mask = word, mask << (j * bits)
            else:
                source = "t"
                lines.append(f"shr.b32 t, {word}, {j * bits};")
            lines.append(f"lop3.b32 ${2 * j + half}, {source}, {mask}, {magic2}, 0xEA;")
    return "{ " + " ".join(lines).replace("$IN", f"${2 * (8 // bits)}") + " }"


def _last_dim_contiguous(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(tensor, strides of all but the last dim)``; kernels index the last dim with unit stride."""
    strides = tensor.stride()
    if strides[-1] != 1 and tensor.numel():
        tensor = tensor.contiguous()
        strides = tensor.stride()
    return tensor, strides[:-1]


# -------------------------------------------------------------------------------- torch reference


def decode_attention_reference(
    q: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    recent_k: torch.Tensor,
    recent_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    *,
    k_bits: int,
    v_bits: int,
    sm_scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    num_splits: int = 0,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference and CPU fallback of :func:`decode_attention` (``num_splits`` is ignored).

    Dequantizes the history with :func:`oscar_hf.quant.dequantize` into the query dtype, concatenates
    the tiers and runs one float32 softmax, with the query heads of each KV head grouped (GQA).
    With ``lengths`` it first stores the new rows in the ring, as the kernel does, then takes the
    valid history rows and unrolls the ring (a host sync).
    """
    if lengths is not None:
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, key_mask = _unroll_static(
            lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v, key_mask
        )
    batch, q_heads, head_dim = q.shape
    kv_heads = sink_k.shape[1]
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    history_k = dequantize(QuantizedRows(k_codes, k_scale, k_zero), k_bits, head_dim // k_scale.shape[-1], q.dtype)
    history_v = dequantize(QuantizedRows(v_codes, v_scale, v_zero), v_bits, head_dim // v_scale.shape[-1], q.dtype)
    keys = torch.cat([sink_k, history_k, recent_k, new_k], dim=2).float()
    values = torch.cat([sink_v, history_v, recent_v, new_v], dim=2).float()
    grouped_q = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.einsum("bkgd,bktd->bkgt", grouped_q, keys) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask.bool()[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row attends to nothing
    out = torch.einsum("bkgt,bktd->bkgd", probs, values)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def _unroll_static(lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v,
                   key_mask):  # fmt: skip
    """Static-decoding tiers as plain ones: the new rows stored in the ring's newest slots, then the first
    ``lengths[0]`` history rows, the ring's other valid rows in order from its start, and the sink mask
    extended with True for every other key."""
    history, start, rows = (int(v) for v in lengths.tolist())
    n_new, ring_size = new_k.shape[2], recent_k.shape[2]
    rows -= n_new
    new_slots = (start + rows + torch.arange(n_new, device=recent_k.device)) % ring_size
    recent_k.index_copy_(2, new_slots, new_k)
    recent_v.index_copy_(2, new_slots, new_v)
    ring = (start + torch.arange(rows, device=recent_k.device)) % ring_size
    packed = [t[:, :, :history] for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)]
    recent = [t.index_select(2, ring) for t in (recent_k, recent_v)]
    if key_mask is not None:
        rest = torch.ones(key_mask.shape[0], history + rows + n_new, dtype=torch.bool, device=key_mask.device)
        key_mask = torch.cat([key_mask.bool(), rest], dim=1)
    return (*packed, *recent, key_mask)


# ------------------------------------------------------------------------------------ custom op


def _decode_attention_op(
    q: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    recent_k: torch.Tensor,
    recent_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    key_mask: torch.Tensor | None,
    k_bits: int,
    v_bits: int,
    sm_scale: float,
    num_splits: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    lengths: torch.Tensor | None = None,
    history_settled: bool = False,
) -> torch.Tensor:
    launch = sys.modules[__name__].decode_attention_triton  # see quantize._quantize_pack_op
    return launch(
        q, sink_k, sink_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v,
        new_k, new_v, key_mask, k_bits, v_bits, sm_scale, num_splits, block_n, num_warps, num_stages, lengths,
        history_settled,
    )  # fmt: skip


def _decode_attention_fake(q, *args):
    return torch.empty_like(q)


define_op("oscar::decode_attention", _decode_attention_op, _decode_attention_fake, mutates=("recent_k", "recent_v"))


# ----------------------------------------------------------------------------------- dispatcher


def _check_inputs(q, dense, k_codes, k_scale, v_codes, v_scale, key_mask, k_bits, v_bits, lengths) -> None:
    """Shapes and dtypes the kernels rely on (``dense``: the six sink/recent/new tensors)."""
    check_bits(k_bits), check_bits(v_bits)
    batch, q_heads, head_dim = q.shape
    kv_heads = dense[0].shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    for rows in dense:
        if rows.shape[:2] != (batch, kv_heads) or rows.shape[-1] != head_dim or rows.dtype != q.dtype:
            raise ValueError(f"dense rows {tuple(rows.shape)} {rows.dtype} do not match [{batch}, {kv_heads}, *, "
                             f"{head_dim}] {q.dtype}: q must be in the dtype of the windows")  # fmt: skip
    for name, codes, scale, bits in (("key", k_codes, k_scale, k_bits), ("value", v_codes, v_scale, v_bits)):
        if (codes.shape[:3] != (batch, kv_heads, k_codes.shape[2]) or codes.shape[-1] * 8 != head_dim * bits
                or scale.shape[:3] != codes.shape[:3] or head_dim % scale.shape[-1]):  # fmt: skip
            raise ValueError(f"{name} history codes {tuple(codes.shape)} / scale {tuple(scale.shape)} do not fit "
                             f"{bits}-bit rows of {head_dim} dims")  # fmt: skip
    masked = dense[0].shape[2]  # static decoding: the sink only
    if lengths is None:
        masked += k_codes.shape[2] + dense[2].shape[2] + dense[4].shape[2]
    elif lengths.shape != (3,) or lengths.dtype not in (torch.int32, torch.int64) or lengths.device != q.device:
        raise ValueError(f"lengths must be 3 integers on {q.device}, got {tuple(lengths.shape)} {lengths.dtype}")
    if key_mask is not None and tuple(key_mask.shape) != (batch, masked):
        raise ValueError(f"key_mask has shape {tuple(key_mask.shape)}, expected [{batch}, {masked}]")


def column_blocks(bits: int) -> int:
    """Column blocks that ``bits``-bit codes unpack in: 4 for 1- to 3-bit codes, 2 for 4-bit."""
    check_bits(bits)
    return 2 if bits == 4 else 4


def kernel_supports_decode(head_dim: int, k_bits: int = 2, v_bits: int = 2, k_groups: int = 1, v_groups: int = 1) -> bool:
    """Tiles are column blocks of ``D / column_blocks(bits)`` dims: a power of two, at least 16 for
    ``tl.dot``, and each within one quantization group (``groups`` per row, at most that many blocks)."""
    blocks = (column_blocks(k_bits), column_blocks(v_bits))
    return (
        is_power_of_two(head_dim)
        and head_dim // max(blocks) >= 16
        and all(is_power_of_two(g) and g <= n for g, n in zip((k_groups, v_groups), blocks))
    )


def decode_attention(
    q: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    recent_k: torch.Tensor,
    recent_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    *,
    k_bits: int,
    v_bits: int,
    sm_scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    num_splits: int = 0,
    lengths: torch.Tensor | None = None,
    history_settled: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence over ``[sink | history | recent | new]``, rotated basis.

    Args:
        q: ``[B, Hq, D]`` query, already multiplied by R_K, in the dtype of the dense rows.
        sink_k, sink_v, recent_k, recent_v, new_k, new_v: dense rows ``[B, Hkv, n, D]`` (views are fine).
        k_codes, v_codes: packed history ``uint8 [B, Hkv, L, D*bits/8]`` (the layout of
            :func:`oscar_hf.quant.pack`); ``L`` may be 0.
        k_scale, k_zero, v_scale, v_zero: ``[B, Hkv, L, D/G]`` per-group metadata (any float dtype).
        k_bits, v_bits: 1, 2, 3 or 4 each.
        sm_scale: score scale, ``1/sqrt(D)`` by default.
        key_mask: optional ``bool [B, S+L+R+T]``, True where a key may be attended (left-padding pads
            are False).
        num_splits: history splits (0: chosen from the length and the device).
        lengths: static decoding (CUDA graphs): integers ``[history rows, ring start, ring rows]`` on the
            device. The history tensors are then allocated at capacity with their first ``lengths[0]``
            rows valid, ``recent_k``/``recent_v`` are a ring whose ``lengths[2]`` rows from
            ``lengths[1]`` on are valid, and ``key_mask`` covers the sink only. The newest
            ``new_k.shape[2]`` of those ring rows are the new rows' slots: the call stores ``new_k`` and
            ``new_v`` there (a decode step's one write) and attends them as new rows. Nothing is read
            on the host, so one launch can be captured and replayed as the lengths change.
        history_settled: the kernel launched just before this call wrote neither the history nor
            ``lengths`` (as in a decode step, where that kernel rotates q, K and V). On Hopper the
            history's first tiles are then copied while it still runs. False is always correct.

    Returns:
        ``[B, Hq, D]`` in the dtype of ``q`` and in the rotated V basis (the caller applies ``·R_V^T``).

    Runs the Triton kernels when :func:`~._triton.runs_triton` says so, else the torch reference.
    """
    dense = (sink_k, sink_v, recent_k, recent_v, new_k, new_v)
    _check_inputs(q, dense, k_codes, k_scale, v_codes, v_scale, key_mask, k_bits, v_bits, lengths)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    supported = kernel_supports_decode(q.shape[-1], k_bits, v_bits, k_scale.shape[-1], v_scale.shape[-1])
    if not (runs_triton(q) and supported):
        return decode_attention_reference(
            q, sink_k, sink_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v,
            k_bits=k_bits, v_bits=v_bits, sm_scale=scale, key_mask=key_mask, lengths=lengths,
        )  # fmt: skip
    launch = op_or_launcher(torch.ops.oscar.decode_attention, decode_attention_triton)
    return launch(
        q, sink_k, sink_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v,
        key_mask, k_bits, v_bits, scale, num_splits, 0, 0, 0, lengths, history_settled,
    )  # fmt: skip

