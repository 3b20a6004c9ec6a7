"""Packed history codes as exact dot operands of the Triton stage 1 (:mod:`.decode_stages`).

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
blocks too, each code assembled whole before its one dot. 1-bit codes are such a plane alone. Only
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
    return 1 << (J * BITS * (J < FREE))


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

    Bits ``J*BITS..`` of byte ``c`` are dim ``J*D/k + c`` (k = 8/BITS codes per byte). For 16-bit
    floats the code is OR-ed into the mantissa of a power of two whose ulp is 1 (``MAGIC``: bf16
    128.0, fp16 1024.0), two integer operations and a free bitcast: an int-to-float conversion runs
    at a quarter of the ALU rate, enough to bind the loop on unpacking. float32
    (``MAGIC`` 0, offset 0) converts directly. The first ``FREE`` blocks lie inside the mantissa
    where they are, so they skip the shift and come out multiplied by ``2**(J*BITS)``
    (:func:`part_factor`); q is divided by the same power of two, which is exact.
    """
    MASK: tl.constexpr = (1 << BITS) - 1
    if J < FREE:
        codes = raw & (MASK << (J * BITS))
    else:
        codes = (raw >> (J * BITS)) & MASK
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
    PARTS: tl.constexpr = 8 // BITS
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
    return _as_dtype(codes, DTYPE, MAGIC)


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
    return _as_dtype(codes, DTYPE, MAGIC)


# ----------------------------------------------------------------------------- host side


def shift_free_blocks(bits: int, dtype: torch.dtype) -> int:
    """How many leading column blocks of a packed byte lie inside ``dtype``'s mantissa.

    Such a block's codes are masked where they are, without a shift: ``OFFSET + 2**(j*bits) * c``
    (:func:`part_factor`). bf16 with 2-bit codes: blocks 0-2 of 4, a quarter fewer unpacking
    instructions than shifting each block down. None for 3-bit codes, assembled from two planes, nor
    for 1-bit codes, unpacked in 4 blocks of two bits each.
    """
    if bits in (1, 3):
        return 0
    return min(8 // bits, CODE_MAGIC[dtype][2] // bits)


@functools.cache
def unpack_asm(bits: int, dtype: torch.dtype) -> str:
    """PTX for :func:`_code_blocks`: 4 packed bytes in, their codes as 16-bit floats ``OFFSET + f * c`` out.

    ``prmt`` moves bytes 0 and 1 (then 2 and 3) into the low bytes of the two 16-bit halves of a
    register; per column block ``j`` one ``lop3`` ``(t & mask) | magic`` (after a shift of ``t`` by
    ``j*bits`` for blocks outside the mantissa, :func:`shift_free_blocks`) then yields two codes,
    the same values as :func:`_code_block`. Output element ``i`` depends on input byte ``i`` only, so
    the result does not depend on how the compiler lays the bytes out across threads and registers.
    Empty (the portable path) for float32 and for 1- and 3-bit codes; the interpreter runs the portable
    path too.
    """
    magic = CODE_MAGIC[dtype][0]
    if magic == 0 or bits in (1, 3):
        return ""
    free, magic2 = shift_free_blocks(bits, dtype), magic * 0x10001
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
