"""MMA operands of the Gluon history span (:mod:`.gluon_span_kernel`): packed code words unpacked by
inline PTX, q as an int8 fixed point, the scores' weights moved into the value MMA's B operand.

K's codes become int8 operands ``f_j * c`` of ``m16n8k32`` MMAs against q's 16-bit fixed point split
into two int8 halves; V's codes become bf16 ``OFFSET + f_j * c`` of ``m16n8k16`` MMAs against the
weights ``p * scale``. The relabellings that make each operand's layout what the thread already holds
are :mod:`.gluon_span_layouts`'s.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_span_layouts import (
    A_OP,
    A_OP8,
    B_OP,
    B_OP8,
    HEAD_COLS,
    D,
    head_halves,
)

# movmatrix.trans on each 8x8 bf16 block of a [rows, 8] accumulator-shaped tensor (pack=2: a register
# holds row g, columns 2t, 2t+1 of a block; afterwards, of the block's transpose).
TRANSPOSE_8X8 = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
# A B operand's column n is lane group g = n: lanes g and g ^ 4 (lane ids 16 apart) swap registers.
SWAP_HALVES = gl.constexpr("shfl.sync.bfly.b32 $0, $1, 16, 31, -1;")
# What V's codes' magic exponent adds (see value_unpack_asm): 0x4300 is bf16 128.
OFFSET = gl.constexpr(128.0)


@gluon.jit
def _bytes_of(b0, b1, b2, b3):
    """Four ``[keys, words]`` tensors of a word's bytes as one ``[keys, bytes]`` (byte ``4w + b``)."""
    codes = gl.join(gl.join(b0, b1), gl.join(b2, b3))  # [keys, words, b & 1, b >> 1]
    return gl.reshape(gl.permute(codes, (0, 1, 3, 2)), [64, 32])


@gluon.jit
def v_operands(codes, PACK: gl.constexpr):
    """V codes ``[keys, bytes]`` as the value MMA's A operands ``[dims m, keys K]``, one a half, for free.

    Byte ``4g + b`` becomes row ``m = 8b + g``; key ``16t + 8e + (8 // PACK) h + c`` becomes ``K = 8c + 2t + e``
    of half h, which is score row ``m = 8c + g'`` of key ``8g' + (8 // PACK) h + c`` (see
    :func:`.gluon_span_layouts.key_rows` and :func:`weights_operand`).
    """
    codes = gl.reshape(codes, [4, 2, PACK, 8 // PACK, 8, 4])  # [t, e, h, c, g, b]
    if PACK == 2:
        first, second = gl.split(gl.permute(codes, (0, 1, 3, 4, 5, 2)))
        return _v_rows(first), _v_rows(second)
    else:
        return (_v_rows(gl.reshape(codes, [4, 2, 8, 8, 4])),)


@gluon.jit
def _v_rows(codes):
    """``[t, e, c, g, b]`` codes as the A operand ``[8b + g, 8c + 2t + e]``."""
    keys: gl.constexpr = 8 * codes.shape[2]
    codes = gl.permute(codes, (4, 3, 2, 0, 1))
    return gl.convert_layout(gl.reshape(codes, [32, keys]), A_OP, assert_trivial=True)


@gluon.jit
def weights_operand(weights):
    """Scores-shaped bf16 weights ``[rows m, 8 columns]`` as the value MMA's B operand ``[K = m, 8 columns]``.

    After the transposes, the register that held ``W[8i + g, 2t + e]`` holds ``W[8i + 2t + e, g]``: the
    tensor read with its logical indices is ``W^T`` blockwise, and a relabelling makes it ``W``."""
    rows: gl.constexpr = weights.shape[0]
    moved = gl.inline_asm_elementwise(TRANSPOSE_8X8, "=r,r", [weights], dtype=gl.bfloat16, is_pure=True, pack=2)
    moved = gl.permute(gl.reshape(moved, [rows // 8, 8, 4, 2]), (0, 2, 3, 1))  # [i, g, t, e] -> [i, t, e, g]
    return gl.convert_layout(gl.reshape(moved, [rows, 8]), B_OP, assert_trivial=True)


@gluon.jit
def half_columns(operand, HALF: gl.constexpr):
    """A B operand ``[K, 8 columns]`` with the columns of the other half zeroed: column n is lane group
    g = n, so lanes of the other half (lane id bit 4) zero their registers, a pair at a time."""
    keep: gl.constexpr = "ne" if HALF else "eq"
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; and.b32 l, l, 16; setp." + keep.value + ".u32 p, l, 0; "
        "selp.b32 $0, $1, 0, p; }",
        "=r,r",
        [operand],
        dtype=gl.bfloat16,
        is_pure=True,
        pack=2,
    )


def value_factors(bits: int = 2) -> tuple[float, ...]:
    """``f_j`` of :func:`value_unpack_asm`'s blocks: ``4**j``, but 1 for block 3 of 2-bit codes."""
    return (1.0, 4.0, 16.0, 1.0 if bits == 2 else 64.0)


@functools.cache
def value_unpack_asm(bits: int = 2) -> str:
    """PTX: V's codes, in 2-bit words (:func:`.gluon_span_tiles.load_tile`), as bf16 ``OFFSET + f_j * code``
    (:func:`value_factors`), two codes a 32-bit output; ``bits`` (2 or 1) is how many bits of each 2-bit
    field hold the code.

    Blocks j < 3 are ``128 + 4**j * code`` (they lie inside bf16's 7-bit mantissa); block 3 of 2-bit
    codes is ``128 + code`` after a shift (fp16, whose mantissa would hold it, would make the weights
    fp16, which could overflow on large value scales), of 1-bit codes ``128 + 64 * code`` (192 is a bf16).
    Two words of two keys in, output ``4j + b`` holds block j of byte b of both keys (one key a 16-bit
    half, masked in its low byte), the pair the value MMA's A operand wants.
    """
    if bits not in (1, 2):
        raise ValueError(f"the span reads 1- or 2-bit values, not {bits}-bit")
    field = ((1 << bits) - 1) * 0x00010001
    lines = [".reg .b32 t, u;"]
    for b in range(4):  # t: per 16-bit half, byte b of one key in its low byte
        lines.append(f"prmt.b32 t, $16, $17, {b | b << 4 | (4 + b) << 8 | (4 + b) << 12:#x};")
        for j in range(4):
            source, mask = "t", field << (2 * j)
            if j == 3 and bits == 2:
                lines.append("shr.b32 u, t, 6;")
                source, mask = "u", field
            lines.append(f"lop3.b32 ${4 * j + b}, {source}, {mask:#x}, 0x43004300, 0xEA;")
    return "{ " + " ".join(lines) + " }"


# bf16 pairs (one 32-bit register) as two float32, one instruction each (the compiler's conversion of
# the high half takes two), and two float32 as one rounded bf16 pair (one instruction, not three).
WIDEN_BF16 = gl.constexpr("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }")
NARROW_BF16 = gl.constexpr("cvt.rn.bf16x2.f32 $0, $2, $1;")


@gluon.jit
def widen(values):
    """bf16 ``values`` as float32 (exact)."""
    return gl.inline_asm_elementwise(WIDEN_BF16, "=r,=r,r", [values], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def narrow(values):
    """float32 ``values`` rounded to bf16 (to nearest even, as ``.to(gl.bfloat16)``)."""
    return gl.inline_asm_elementwise(NARROW_BF16, "=r,r,r", [values], dtype=gl.bfloat16, is_pure=True, pack=2)


# K's scores run on int8 MMAs, q as two int8 halves of a 16-bit fixed point (``q_int8``): a mask makes
# 4 codes an int8 operand register, where bf16 operands would take 8 masks a word for its 16 codes, on
# the ALU pipe that bounds the tile (kernels/DESIGN.md). The sums are exact int32.
# Block j of each byte of a K word as int8 ``f_j * code``: f = 1, 4, 16 by masks alone, and 16 for
# block 3, shifted down by 2 so that it stays below int8's 128.
K_UNPACK = gl.constexpr(
    "{ .reg .b32 t; lop3.b32 $0, $4, 0x03030303, 0, 0xEA; lop3.b32 $1, $4, 0x0C0C0C0C, 0, 0xEA; "
    "lop3.b32 $2, $4, 0x30303030, 0, 0xEA; shr.b32 t, $4, 2; lop3.b32 $3, t, 0x30303030, 0, 0xEA; }"
)
K_FACTORS = (1.0, 4.0, 16.0, 16.0)
# 4-bit keys: 2-bit word w's block j is dims 4w + b + 32j, which are the low nibbles of 4-bit words w
# (j = 0) and w + 8 (j = 1) and their high nibbles (j = 2, 3). Two words in, the four blocks' int8 codes
# out, each by a mask where it lies (f = 1: a 0xF0 mask would make codes past 7 negative int8).
K4_UNPACK = gl.constexpr(
    "{ .reg .b32 t; lop3.b32 $0, $4, 0x0F0F0F0F, 0, 0xEA; lop3.b32 $1, $8, 0x0F0F0F0F, 0, 0xEA; "
    "shr.b32 t, $4, 4; lop3.b32 $2, t, 0x0F0F0F0F, 0, 0xEA; shr.b32 t, $8, 4; lop3.b32 $3, t, 0x0F0F0F0F, 0, 0xEA; }"
)
K4_FACTORS = (1.0, 1.0, 1.0, 1.0)
# 3-bit keys: 2-bit word w's blocks are the low two bits, and word w of the high-bit plane (its word
# w % 4 shifted right by w // 4, _key_words) holds each field's third bit at bit 2j of its bytes. Two
# words in: one lop3 selects blocks 0 and 2 (then 1 and 3) as 3-bit codes in a byte's two nibbles, low
# bits from the 2-bit word, the rest from the high word shifted so that the third bits land at bit 2 of
# each nibble (bit 3 holds a stray bit), then a mask each (f = 1, 1, 16, 16: 16 * 7 stays below 128).
K3_UNPACK = gl.constexpr(
    "{ .reg .b32 t, u, c; shl.b32 u, $8, 2; lop3.b32 c, $4, 0x33333333, u, 0xE2; "
    "and.b32 $0, c, 0x07070707; and.b32 $2, c, 0x70707070; "
    "shr.b32 t, $4, 2; lop3.b32 c, t, 0x33333333, $8, 0xE2; "
    "and.b32 $1, c, 0x07070707; and.b32 $3, c, 0x70707070; }"
)
K3_FACTORS = (1.0, 1.0, 16.0, 16.0)
# q's fixed point: |q| * scale <= Q_RANGE, so a dot is at most 128 * 15 * Q_RANGE < 2**31 (int32, 4-bit
# codes) and each half fits int8 (hi <= 125). Past 2**24 (4-bit keys) the dot's float32 conversion
# rounds, by at most 2**-24 of it: below the rounding of the zero-point product that joins it.
Q_RANGE = gl.constexpr(32000.0)
# 1.5 * 2**23 + 128: a float32 below 2**22 in magnitude plus this is rounded to an integer (to nearest
# even, as 1.5 * 2**23 and 128 are even), which plus 128 is then its low mantissa bits: the float's
# bits less ROUNDER_BITS. With the 128 in, hi = (Q + 128) >> 8 is byte 1 of those bits and lo = Q - 256 hi
# is byte 0 ^ 0x80, so byte selects pack both (Q_BYTES).
ROUNDER = gl.constexpr(12583040.0)
ROUNDER_BITS = gl.constexpr(0x4B400080)
# Four rounded floats' bits in, hi's and lo's four int8 out: 5 instructions, fewer than shifts, adds
# and packing would take (per 4 of a prologue's 32 values a thread).
Q_BYTES = gl.constexpr(
    "{ .reg .b32 x, y, z; prmt.b32 x, $2, $3, 0x5140; prmt.b32 y, $4, $5, 0x5140; prmt.b32 $0, x, y, 0x7632; "
    "prmt.b32 z, x, y, 0x5410; xor.b32 $1, z, 0x80808080; }"
)


@gluon.jit
def unpack_k(words, K_BITS: gl.constexpr):
    """Per column block j the int8 codes ``f_j * c`` ``[keys, bytes]`` (byte ``4w + b`` of the 2-bit
    layout) of K's ``[keys, words]``: 2-bit words, or a pair for 4-bit keys (words w, words w + 8) and
    for 3-bit keys (low-bit words, high-bit words)."""
    if K_BITS == 2:
        o = gl.inline_asm_elementwise(
            K_UNPACK, "=r,=r,=r,=r,r,r,r,r", [_fourfold(words)], dtype=(gl.int8,) * 4, is_pure=True, pack=4
        )
    else:
        PAIR_UNPACK: gl.constexpr = K4_UNPACK if K_BITS == 4 else K3_UNPACK
        low, high = words
        o = gl.inline_asm_elementwise(
            PAIR_UNPACK,
            "=r,=r,=r,=r" + ",r" * 8,
            [_fourfold(low), _fourfold(high)],
            dtype=(gl.int8,) * 4,
            is_pure=True,
            pack=4,
        )
    return (
        gl.reshape(o[0], [64, 32]),
        gl.reshape(o[1], [64, 32]),
        gl.reshape(o[2], [64, 32]),
        gl.reshape(o[3], [64, 32]),
    )


@gluon.jit
def _fourfold(words):
    """``[keys, words]`` as ``[keys, words, 4]``, each word repeated: an int8 asm output of ``pack=4`` is one
    register, whose 4 inputs are then the same word."""
    twice = gl.join(words, words)
    return gl.reshape(gl.join(twice, twice), [64, 8, 4])


@gluon.jit
def k_operands(codes, PACK: gl.constexpr):
    """int8 K codes ``[keys, bytes]`` as the scores' A operands ``[rows m, k]`` of m16n8k32, one a half,
    for free. Key ``8g + (8 // PACK) h + i`` becomes row ``m = 8i + g`` of half h; byte ``8t + 4e + b``
    (thread t's word 2t + e, byte b) becomes ``k = 16e + 4t + b`` (see :func:`_q_dims`)."""
    codes = gl.reshape(codes, [8, PACK, 8 // PACK, 4, 2, 4])  # [g, h, i, t, e, b]
    if PACK == 2:
        first, second = gl.split(gl.permute(codes, (0, 2, 3, 4, 5, 1)))
        return _k_rows(first), _k_rows(second)
    else:
        return (_k_rows(gl.reshape(codes, [8, 8, 4, 2, 4])),)


@gluon.jit
def _k_rows(codes):
    """``[g, i, t, e, b]`` codes as the A operand ``[8i + g, 16e + 4t + b]``."""
    rows: gl.constexpr = 8 * codes.shape[1]
    codes = gl.permute(codes, (1, 0, 3, 2, 4))
    return gl.convert_layout(gl.reshape(codes, [rows, 32]), A_OP8, assert_trivial=True)


@gluon.jit
def _q_dims(Q, J: gl.constexpr, GROUP: gl.constexpr):
    """q's dims ``32J + byte(k)`` in float32 as ``[32 k, 8 heads]`` of the int8 B operand's layout
    (heads >= GROUP are 0); ``byte(k)`` inverts :func:`k_operands`' relabelling."""
    k = gl.arange(0, 32, layout=gl.SliceLayout(1, B_OP8))
    heads = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP8))
    byte = 8 * ((k // 4) % 4) + 4 * (k // 16) + k % 4
    return widen(gl.load(Q + heads[None, :] * D + (32 * J + byte)[:, None], mask=(heads < GROUP)[None, :], other=0.0))


@gluon.jit
def _q_halves(block, scale, FACTOR: gl.constexpr):
    """A q block as the integers ``Q = round(q * scale / FACTOR)`` (to nearest, even on ties), split
    ``Q = 256 hi + lo`` into two int8 B operands, and ``FACTOR * Q`` (what the codes' zero points multiply,
    summed over dims). The rounding adds ``ROUNDER`` on the float pipe: a conversion instruction runs on
    the quarter-rate unit, where the 16 programs of an SM would queue their prologues' 32 each."""
    bits = (block * (scale / FACTOR)[None, :] + ROUNDER).to(gl.int32, bitcast=True)
    hi, lo = gl.inline_asm_elementwise(Q_BYTES, "=r,=r,r,r,r,r", [bits], dtype=(gl.int8, gl.int8), is_pure=True, pack=4)
    return hi, lo, (bits - ROUNDER_BITS) * int(FACTOR)


@gluon.jit
def q_int8(Q, GROUP: gl.constexpr, PACK: gl.constexpr, K_BITS: gl.constexpr):
    """q for the int8 scores of ``K_BITS``-bit keys: per column block the two int8 halves of its fixed
    point, each as one B operand a half (:func:`_halves_of`), and per head ``-sum(q)`` in fixed-point
    units and the unit (``1 / scale``). Blocks are combined elementwise first, so that each per-head
    value takes one cross-lane reduction."""
    d0, d1, d2, d3 = _q_dims(Q, 0, GROUP), _q_dims(Q, 1, GROUP), _q_dims(Q, 2, GROUP), _q_dims(Q, 3, GROUP)
    amax = gl.max(gl.maximum(gl.maximum(gl.abs(d0), gl.abs(d1)), gl.maximum(gl.abs(d2), gl.abs(d3))), axis=0)
    amax = gl.maximum(amax, 1e-30)  # heads past GROUP (and an all-zero q) quantize to 0
    scale = Q_RANGE / amax
    # the factors are K_FACTORS (1, 4, 16, 16), K3_FACTORS (1, 1, 16, 16) or K4_FACTORS (all 1), written
    # out: a jitted function reads only constexpr globals
    F1: gl.constexpr = 4.0 if K_BITS == 2 else 1.0
    F2: gl.constexpr = 1.0 if K_BITS == 4 else 16.0
    h0, l0, s0 = _q_halves(d0, scale, 1.0)
    h1, l1, s1 = _q_halves(d1, scale, F1)
    h2, l2, s2 = _q_halves(d2, scale, F2)
    h3, l3, s3 = _q_halves(d3, scale, F2)
    neg_q_sum = gl.convert_layout(-gl.sum(s0 + s1 + s2 + s3, axis=0).to(gl.float32), HEAD_COLS)
    unit = gl.convert_layout(amax * (1.0 / Q_RANGE), HEAD_COLS)
    # columns past GROUP hold 0 and a unit of 1e-30 / Q_RANGE: a half's sum and max are its heads'
    return (
        (_halves_of(h0, PACK), _halves_of(h1, PACK), _halves_of(h2, PACK), _halves_of(h3, PACK)),
        (_halves_of(l0, PACK), _halves_of(l1, PACK), _halves_of(l2, PACK), _halves_of(l3, PACK)),
        gl.sum(head_halves(neg_q_sum, PACK), axis=0),
        gl.max(head_halves(unit, PACK), axis=0),
    )


@gluon.jit
def _halves_of(operand, PACK: gl.constexpr):
    """A q B operand (its heads in columns 0-3 with two halves) as one operand a half: half 1's has the
    heads in columns 4-7 and zeros in 0-3, which is the operand with lanes g and g ^ 4 swapped."""
    if PACK == 2:
        moved = gl.inline_asm_elementwise(SWAP_HALVES, "=r,r", [operand], dtype=gl.int8, is_pure=False, pack=4)
        return operand, moved
    else:
        return (operand,)


@gluon.jit
def unpack_v(words, UNPACK: gl.constexpr):
    """Per column block j the ``[keys, bytes]`` codes of V's ``[keys, words]`` (``value_unpack_asm()``)."""
    o = gl.inline_asm_elementwise(UNPACK, "=r," * 16 + "r,r", [words], dtype=(gl.bfloat16,) * 16, is_pure=True, pack=2)
    return (
        _bytes_of(o[0], o[1], o[2], o[3]),
        _bytes_of(o[4], o[5], o[6], o[7]),
        _bytes_of(o[8], o[9], o[10], o[11]),
        _bytes_of(o[12], o[13], o[14], o[15]),
    )
