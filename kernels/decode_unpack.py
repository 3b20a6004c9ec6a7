"""Packed history codes as exact dot operands of the Triton stage 1 (:mod:`.decode_tiles`).

Codes enter the dots as exact 16-bit floats ``OFFSET + f * c`` built with one or two integer
operations (:func:`_code_block`; ``f`` a power of two for the blocks unpacked without a shift, q
divided by it); the offset is folded into the zero-point corrections. Dequantizing each element in
float32 instead (an int-to-float conversion, a subtract, a multiply and a cast) binds the kernel on
that arithmetic, not on memory.

Byte ``c`` of a packed row holds dims ``c, c + D/k, ...`` (k codes per byte), so shift ``j`` of the
byte tile is the column block ``j`` of the rows: every tile (q, K, V, the accumulator) is handled as k
column blocks, and ``q·k`` as a sum of k dots. 3-bit codes are 2-bit codes (their low bits, in that
layout) plus a 1-bit plane of their high bits (byte ``c`` holding dims ``c + i*D/8``): block ``j`` takes
bits ``2j`` and ``2j + 1`` of the plane's bytes for its two halves, so they are handled as 4 column
blocks too, each code assembled whole before its one dot. 1-bit codes are such a plane alone. Once the
second half of a block's plane bytes is shifted right by one, block ``j``'s bit sits at ``2j`` for both
halves, so 1- and 3-bit codes unpack like 2-bit ones, block ``j`` at bit ``2j`` (:func:`block_shift`). Only
loads, shifts and ``tl.dot`` are used: full-width tiles rebuilt with ``tl.interleave`` pass in the
interpreter but give wrong results compiled on Hopper for some tile shapes.

The jitted functions here unpack; the host-side functions at the end choose how (:func:`shift_free_blocks`,
:func:`unpack_asm`) for a launch.
"""

from __future__ import annotations

import functools

import torch

from ._triton import tl, triton

# Codes enter the dots as OFFSET + code: int16 bits of a power of two whose ulp is 1, OR-ed with the
# code (see _code_block); float32 converts codes directly.
# The third number is the mantissa's width: column blocks of codes that fit in it need no shift.
CODE_MAGIC = {torch.bfloat16: (0x4300, 128.0, 7), torch.float16: (0x6400, 1024.0, 10), torch.float32: (0, 0.0, 23)}


@triton.jit
def part_factor(J: tl.constexpr, BITS: tl.constexpr, FREE: tl.constexpr):
    """Column block ``J``'s codes enter the dots as ``OFFSET + factor * c`` (see :func:`_code_block`)."""
    SHIFT: tl.constexpr = 2 + 2 * (BITS // 4)  # block_shift
    return 1 << (J * SHIFT * (J < FREE))


@triton.jit
def _as_dtype(codes, DTYPE: tl.constexpr, MAGIC: tl.constexpr):
    """Integer codes as ``DTYPE`` values ``OFFSET + code``: OR-ed into the mantissa of ``MAGIC`` and
    bitcast (16-bit floats), or converted directly (float32, ``MAGIC`` 0)."""
    # (Triton compiles the statements after a returning static branch too, hence the else.)
    if MAGIC == 0:
        values = codes.to(DTYPE)
    else:
        values = (codes | MAGIC).to(DTYPE, bitcast=True)
    return values


@triton.jit
def _code_block(raw, J: tl.constexpr, BITS: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr, FREE: tl.constexpr):
    """Column block ``J`` of packed bytes (``int16``) as ``DTYPE`` values ``OFFSET + factor * code``, exactly.

    Bits ``J*S..J*S+BITS`` of byte ``c`` are dim ``J*D/k + c`` (S = :func:`block_shift`, k = 8/S
    blocks). For 16-bit floats the code is OR-ed into the mantissa of a power of two whose ulp is 1
    (``MAGIC``: bf16 128.0, fp16 1024.0), two integer operations and a free bitcast: an int-to-float
    conversion runs at a quarter of the ALU rate, enough to bind the loop on unpacking. float32
    (``MAGIC`` 0, offset 0) converts directly. The first ``FREE`` blocks lie inside the mantissa
    where they are, so they skip the shift and come out multiplied by ``2**(J*S)``
    (:func:`part_factor`); q is divided by the same power of two, which is exact.
    """
    MASK: tl.constexpr = (1 << BITS) - 1
    SHIFT: tl.constexpr = J * (2 + 2 * (BITS // 4))  # J * block_shift
    if J < FREE:
        codes = raw & (MASK << SHIFT)
    else:
        codes = (raw >> SHIFT) & MASK
    return _as_dtype(codes, DTYPE, MAGIC)


@triton.jit
def _code_blocks(
    raw, BITS: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr, FREE: tl.constexpr, UNPACK: tl.constexpr
):
    """All column blocks of a packed ``uint8`` tile (blocks 2-3 repeat 0-1 for 4-bit codes).

    With ``UNPACK`` (PTX from :func:`unpack_asm`: compiled 16-bit kernels) the 4 bytes a thread holds
    in one 32-bit register unpack together, about one instruction per code; the portable path
    (interpreter, float32) unpacks byte by byte with :func:`_code_block`. Both give the same values.
    """
    PARTS: tl.constexpr = 4 - 2 * (BITS // 4)  # 8 // block_shift
    if UNPACK != "":
        if PARTS == 4:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r,r", [raw], dtype=(DTYPE.value,) * 4, is_pure=True, pack=4
            )
        else:
            c0, c1 = tl.inline_asm_elementwise(
                UNPACK, "=r,=r,=r,=r,r", [raw], dtype=(DTYPE.value,) * 2, is_pure=True, pack=4
            )
            c2, c3 = c0, c1
    else:
        raw = raw.to(tl.int16)
        c0, c1 = _code_block(raw, 0, BITS, DTYPE, MAGIC, FREE), _code_block(raw, 1, BITS, DTYPE, MAGIC, FREE)
        c2, c3 = c0, c1
        if PARTS == 4:
            c2, c3 = _code_block(raw, 2, BITS, DTYPE, MAGIC, FREE), _code_block(raw, 3, BITS, DTYPE, MAGIC, FREE)
    return c0, c1, c2, c3


@triton.jit
def load_code_blocks(
    C,
    c_n,
    rows,
    valid,
    D: tl.constexpr,
    BITS: tl.constexpr,
    DTYPE: tl.constexpr,
    MAGIC: tl.constexpr,
    FREE: tl.constexpr,
    UNPACK: tl.constexpr,
):
    """The column blocks of packed rows ``rows`` of one head (``C`` its row 0), as :func:`_code_blocks`."""
    if BITS == 1 or BITS == 3:
        # Block j's two halves are bits 2j and 2j + 1 of the 1-bit plane's bytes: a [N, D/4] tile of
        # them; ``odd`` marks the second half, whose bytes are shifted right by one as they unpack.
        DP: tl.constexpr = D // 4
        columns = tl.arange(0, DP)
        PLANE: tl.constexpr = 0 if BITS == 1 else DP  # 3-bit rows: the 2-bit plane, then the 1-bit one
        # Rows start D/8-byte aligned (the launcher's row stride is a multiple of D/8): said, so that
        # rows of 8 or 24 bytes (head_dim 64) are staged in vectors, not loaded a byte at a time.
        starts = tl.multiple_of(rows * c_n, D // 8)[:, None]
        plane = tl.load(C + starts + PLANE + (columns % (D // 8))[None, :], mask=valid[:, None], other=0)
        odd = tl.broadcast_to((columns >= D // 8).to(tl.uint8)[None, :], plane.shape)
        if BITS == 1:
            c0, c1, c2, c3 = _code_blocks1(plane, odd, DTYPE, MAGIC, FREE, UNPACK)
        else:
            low = tl.load(C + starts + columns[None, :], mask=valid[:, None], other=0)
            c0, c1, c2, c3 = _code_blocks3(low, plane, odd, DTYPE, MAGIC, FREE, UNPACK)
    else:
        raw = tl.load(C + rows[:, None] * c_n + tl.arange(0, D * BITS // 8)[None, :], mask=valid[:, None], other=0)
        c0, c1, c2, c3 = _code_blocks(raw, BITS, DTYPE, MAGIC, FREE, UNPACK)
    return c0, c1, c2, c3


@triton.jit
def _code_blocks1(plane, odd, DTYPE: tl.constexpr, MAGIC: tl.constexpr, FREE: tl.constexpr, UNPACK: tl.constexpr):
    """1-bit codes as 4 column blocks ``OFFSET + factor * code``: the 2-bit path once the bytes where
    ``odd`` is 1 are shifted right by one (in the PTX from :func:`unpack_asm` when ``UNPACK``: a byte
    operation on the tile costs Triton about an instruction a byte)."""
    if UNPACK != "":
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [plane, odd], dtype=(DTYPE.value,) * 4, is_pure=True, pack=4
        )
    else:
        c0, c1, c2, c3 = _code_blocks(plane >> odd, 1, DTYPE, MAGIC, FREE, UNPACK)
    return c0, c1, c2, c3


@triton.jit
def _code_blocks3(low, high, odd, DTYPE: tl.constexpr, MAGIC: tl.constexpr, FREE: tl.constexpr, UNPACK: tl.constexpr):
    """3-bit codes as 4 column blocks ``OFFSET + factor * code``: ``low`` the 2-bit plane ``[N, D/4]``,
    ``high`` the 1-bit plane, shifted right by one where ``odd`` is 1 (:func:`load_code_blocks`).
    ``UNPACK``: PTX from :func:`unpack_asm` taking a word of each; else block by block with :func:`_code3`."""
    if UNPACK != "":
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [low, high, odd], dtype=(DTYPE.value,) * 4, is_pure=True, pack=4
        )
    else:
        low, high = low.to(tl.int16), (high >> odd).to(tl.int16)
        c0 = _code3(low, high, 0, DTYPE, MAGIC, FREE)
        c1 = _code3(low, high, 1, DTYPE, MAGIC, FREE)
        c2 = _code3(low, high, 2, DTYPE, MAGIC, FREE)
        c3 = _code3(low, high, 3, DTYPE, MAGIC, FREE)
    return c0, c1, c2, c3


@triton.jit
def _code3(low, high, J: tl.constexpr, DTYPE: tl.constexpr, MAGIC: tl.constexpr, FREE: tl.constexpr):
    """Block ``J``'s codes: bits ``2J, 2J + 1`` of ``low`` and bit ``2J`` of ``high`` as bit 2, in place
    (times ``4**J``) for the first ``FREE`` blocks."""
    if J < FREE:
        codes = (low & (3 << (2 * J))) | ((high << 2) & (4 << (2 * J)))
    else:
        codes = ((low >> (2 * J)) & 3) | (((high >> (2 * J)) & 1) << 2)
    return _as_dtype(codes, DTYPE, MAGIC)


# ----------------------------------------------------------------------------- host side


def block_shift(bits: int) -> int:
    """Bits between consecutive column blocks in a packed byte: 4 for 4-bit codes, else 2 (2-bit codes;
    3-bit codes' 2-bit plane; 1-bit codes, each at bit ``2j`` once the plane is shifted, see
    :func:`load_code_blocks`). The jitted functions repeat this expression, which Triton folds."""
    return 2 + 2 * (bits // 4)


def shift_free_blocks(bits: int, dtype: torch.dtype) -> int:
    """How many leading column blocks of a packed byte lie inside ``dtype``'s mantissa.

    Such a block's codes are masked where they are, without a shift: ``OFFSET + 2**(j*S) * c``
    (S = :func:`block_shift`, :func:`part_factor`). bf16: blocks 0-2 of 4 for 2- and 3-bit codes, a
    quarter fewer unpacking instructions than shifting each block down; all 4 for 1-bit codes (bits
    0, 2, 4 and 6); block 0 of 2 for 4-bit codes.
    """
    shift = block_shift(bits)
    return min(8 // shift, (CODE_MAGIC[dtype][2] - bits) // shift + 1)


@functools.cache
def unpack_asm(bits: int, dtype: torch.dtype) -> str:
    """PTX for :func:`_code_blocks` (:func:`_code_blocks1`, :func:`_code_blocks3` for 1- and 3-bit codes):
    4 packed bytes in (for 3-bit codes a word of each plane; for 1- and 3-bit codes then ``odd``'s word,
    whose bytes are all 0 or all 1), their codes as 16-bit floats ``OFFSET + f * c`` out.

    ``prmt`` moves bytes 0 and 1 (then 2 and 3) into the low bytes of the two 16-bit halves of a
    register; per column block ``j`` one ``lop3`` ``(t & mask) | magic`` (after a shift of ``t`` by
    ``j*S`` for blocks outside the mantissa, :func:`shift_free_blocks`) then yields two codes,
    the same values as :func:`_code_block`. A 3-bit code's high bit, moved to bit ``2j + 2`` of its
    half, enters by a second ``lop3``. Output element ``i`` depends on input byte ``i`` only, so the
    result does not depend on how the compiler lays the bytes out across threads and registers. Empty
    (the portable path) for float32; the interpreter runs the portable path too.
    """
    magic = CODE_MAGIC[dtype][0]
    if magic == 0:
        return ""
    free, magic2, shift = shift_free_blocks(bits, dtype), magic * 0x10001, block_shift(bits)
    blocks, low_bits = 8 // shift, 2 if bits == 3 else bits  # low_bits: the codes' bits in ``lo``/``hi``
    lines = [".reg .b32 lo, hi, t;"]
    if bits in (1, 3):  # the 1-bit plane's word, shifted right by one where its bytes are odd (all or none)
        lines += [".reg .b32 s, w;", "and.b32 s, $ODD, 1;", f"shr.b32 w, {'$IN' if bits == 1 else '$HIGH'}, s;"]
    lines += [
        f"prmt.b32 lo, {'w' if bits == 1 else '$IN'}, 0, 0x1100;",
        f"prmt.b32 hi, {'w' if bits == 1 else '$IN'}, 0, 0x3322;",
    ]
    if bits == 3:  # each block's high bit moved up to the 2-bit field's third bit
        lines += [".reg .b32 hlo, hhi, u, v;", "prmt.b32 hlo, w, 0, 0x1100;", "prmt.b32 hhi, w, 0, 0x3322;"]
        lines += ["shl.b32 hlo, hlo, 2;", "shl.b32 hhi, hhi, 2;"]
    for j in range(blocks):
        for half, (word, high) in enumerate((("lo", "hlo"), ("hi", "hhi"))):
            mask, top, base = ((1 << low_bits) - 1) * 0x10001, 4 * 0x10001, magic2
            if j < free:
                source, mask, top = word, mask << (j * shift), top << (j * shift)
            else:
                source = "t"
                lines.append(f"shr.b32 t, {word}, {j * shift};")
                if bits == 3:
                    lines.append(f"shr.b32 v, {high}, {j * shift};")
                    high = "v"
            if bits == 3:
                lines.append(f"lop3.b32 u, {high}, {top}, {magic2}, 0xEA;")
                base = "u"
            lines.append(f"lop3.b32 ${2 * j + half}, {source}, {mask}, {base}, 0xEA;")
    inputs = ("$IN", "$ODD") if bits == 1 else ("$IN", "$HIGH", "$ODD") if bits == 3 else ("$IN",)
    program = " ".join(lines)
    for index, name in enumerate(inputs):  # operands follow the 2 * blocks outputs
        program = program.replace(name, f"${2 * blocks + index}")
    return "{ " + program + " }"
