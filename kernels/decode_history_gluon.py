"""The packed-history span of decode attention with explicit layouts (Gluon), for INT2 K and V, one
(scale, zero) per row, bf16, head_dim 128, up to 8 query heads per KV head, 64-key tiles on one
warp. On a GPU the decode kernel takes its history slots from here for the shapes it covers
(``OSCAR_DECODE_HISTORY=triton`` opts out): on an H200 at 100K, 25.4 us instead of 40.7 at batch 1,
and 162.4 instead of 281.7 at batch 8 (``eval/results/gluon_history_halves.md``). The dense
tiers (a Triton launch) and the merge follow it as programmatic dependent launches on Hopper, so they
start in the span's tail.

Why (``kernels/DESIGN.md``): the Triton tile lets ``tl.dot`` derive its layouts, which
costs 4 heads padded to 16 MMA rows, codes that reach the MMA one byte at a time through shared
memory, and ``p`` converted through shared memory. Here every layout is stated, and keys are the
MMA's rows, so heads pad nothing (they are the MMA's 8 columns; with at most 4 query heads a KV
head, each tile's two halves of 32 keys share them, see PAIRS):

* scores ``S^T [64 keys, 8 heads] = K · q^T``: K's codes are the A operand (int8), q the B operand
  (two int8 halves of its fixed point: 32 tensor-core instructions a tile);
* values ``out^T [128 dims, 8 heads] = V^T · P^T``: dims are the MMA's rows; ``P^T``, the scores'
  accumulator in bf16, becomes the B operand through one ``movmatrix`` (an 8x8 transpose within the
  warp's registers) per 8 keys, not shared memory;
* codes are loaded straight into registers as whole words (8 bytes of a K row, 4 of a V row a
  thread) and the MMAs' K index, the keys and the dims are *relabelled* to match what each thread
  holds: reshapes/permutes of register dimensions that ``convert_layout(..., assert_trivial=True)``
  proves free. q is gathered once into the same order and the output is scattered back by pointer
  arithmetic; the cache's byte layout does not change;
* per-head sums over keys (l, and the two value corrections) stay per lane inside the loop and are
  reduced across lanes once at the end; only the running max crosses lanes each tile;
* the tile is bound by the integer (ALU) pipe, which runs at half rate: unpacking is nearly all of
  it, so K's codes become int8 operands by masks alone (4 codes an instruction, bf16 took 2), and
  the bf16 conversions are single asm instructions (Triton 3.6: 819, then 735 instructions a tile
  with bf16 scores; Nsight Compute: ALU 51% busy, issue 48%, at 4 warps a scheduler). At 619
  instructions (int8 scores, two halves) fewer instructions gain little time (``kernels/DESIGN.md``):
  what bounds it is dependency latency within each
  one-warp program (Nsight Compute: Wait and Short Scoreboard stalls, under one eligible warp a
  scheduler) and the L1's data pipe, which shared-memory reads, shuffles and the staged copies share:
  copies that read whole rows an instruction halve its wavefronts a tile.

``python kernels/tools/sass_count.py --span`` compiles it for sm_90 on any machine and prints its
registers, the instructions of its loop and those before it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ._triton import LOG2E, launch_kernel, split_rows

D = gl.constexpr(128)
# Registers a thread, capped: uncapped, ptxas takes 138 (158 reading the length on the device), which
# fits 14 (12) one-warp programs an SM, not 16. Capped (Triton 3.6), the loop gains 6-14 instructions,
# and only the device-length variant spills: one local load and store a tile. Lower caps, at the
# 17-21 programs an SM they fit, are slower (H200, 100K, eval/results/gluon_history_registers.md:
# the span alone at batch 8 194-263 us against 171-174), likely because 17-19 programs give some of
# an SM's 4 schedulers a fifth warp that then sets the pace, and 20 need 96 registers, which spill.
REGISTERS = 128


def programs_per_sm(registers: int = REGISTERS) -> int:
    """One-warp programs an SM holds at ``registers`` a thread (65536 registers an SM)."""
    return 65536 // (32 * registers)

# m16n8k16: lane 4g+t holds accumulator rows g (+8, +16, ...) and columns 2t, 2t+1.
MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
# int8 operands of m16n8k32 (K's scores): a register holds 4 consecutive k.
A_OP8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
B_OP8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
HEAD_COLS: gl.constexpr = gl.SliceLayout(0, MMA)  # a per-column vector of the MMAs' [rows, 8] outputs


def _by_half_layout(rows: int, pack: int) -> gl.DistributedLinearLayout:
    """An MMA-shaped ``[rows, 8]`` tensor seen as ``[rows, pack, 8 // pack]``: column ``(8 // pack) h + j``
    is head j of half h. Lane 4g+t holds rows g + 8i and columns 2t, 2t+1, so with two halves the half
    is lane bit t // 2."""
    half = [0, 1, 0] if pack == 2 else [0, 0, 4]  # what column bit 2 is: the half, or a head's bit
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1]] + [[r, 0, 0] for r in (8, 16, 32) if r < rows],
        lane_bases=[[0, 0, 2], half, [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[], block_bases=[],
        shape=[rows, pack, 8 // pack],
    )  # fmt: skip


# A KV head with at most 4 query heads would leave 4 of the MMAs' 8 columns idle, and every
# elementwise step of the online softmax runs on all 8. Instead, each 64-key tile is two halves of 32
# keys: half h's scores fill columns 4h..4h+3 (q is the B operand of half 0 in columns 0-3, of half 1
# in columns 4-7, zero elsewhere), and the value MMAs take each half's weights in its own columns.
# The softmax then runs on [32 rows, 2 halves, 4 heads]: half the instructions a tile for what was
# [64 rows, 8 heads], half of it idle.
PAIRS: gl.constexpr = _by_half_layout(32, 2)  # scores and accumulators with two halves
SINGLE: gl.constexpr = _by_half_layout(64, 1)  # scores with one (5 to 8 query heads)
SINGLE_ACC: gl.constexpr = _by_half_layout(32, 1)  # accumulators with one


def halves(group: int, two_halves: bool = True) -> int:
    """Halves of 32 keys a 64-key tile splits into for ``group`` query heads a KV head (see PAIRS);
    ``two_halves=False`` keeps one half of 64 keys for any group."""
    return 2 if group <= 4 and two_halves else 1


# Codes travel as 32-bit words (4 bytes of a row; bytes would be carried one register each).
# K words [64 keys, 8 words]: lane 4g+t holds keys 8g..8g+7 (score rows g + 8i), words 2t, 2t+1.
WORDS_K: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [1, 0], [2, 0], [4, 0]],
    lane_bases=[[0, 2], [0, 4], [8, 0], [16, 0], [32, 0]], warp_bases=[], block_bases=[], shape=[64, 8],
)  # fmt: skip
# V words [64 keys, 8 words]: lane 4g+t holds keys 16t..16t+15 and word g; consecutive registers
# hold keys c and c + 8, the two keys a register of the value MMA's A operand pairs.
WORDS_V: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [1, 0], [2, 0], [4, 0]],
    lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[], block_bases=[], shape=[64, 8],
)  # fmt: skip
# Per-key metadata [64]: lane 4g+t holds keys 8g..8g+7 (all t alike): one 16-byte load a vector;
# with two halves, of those the 4 keys of its half t // 2: one 8-byte load.
META: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1], [2], [4]], lane_bases=[[0], [0], [8], [16], [32]], warp_bases=[], block_bases=[], shape=[64],
)  # fmt: skip
META_PAIRS: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1], [2]], lane_bases=[[0], [4], [8], [16], [32]], warp_bases=[], block_bases=[], shape=[64],
)  # fmt: skip
# Shared-memory staging of the next tile (PIPELINE). Copies read whole rows an instruction: K, 8 bytes
# a lane over 8 consecutive rows (256 bytes); V, 4 bytes a lane over rows k, k + 1, k + 8 and k + 9.
# Copies in the read layouts took a quarter or an eighth of each row an instruction, across 4 to 8
# lines, which kept the L1's data pipe ~62-79% busy (Nsight Compute) and cost ~7% of the call
# (kernels/DESIGN.md).
COPY_K: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[64, 8],
)  # fmt: skip
COPY_V: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[2, 0], [4, 0], [16, 0], [32, 0]],
    lane_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]], warp_bases=[], block_bases=[], shape=[64, 8],
)  # fmt: skip
# The stages, per stage: each thread's 16 K or V words of a tile (WORDS_K, WORDS_V) in 16-byte vectors,
# the warp's vectors side by side, swizzled so that the copies' writes are conflict-free as well as
# the reads: K's bank bit 4 is key bit 3 ^ key bit 1 (offset bit 7 is keys 2 + 8), V's bank bits 3 and
# 4 are word bits 1 and 2 ^ key bits 4 and 5. Each read instruction XORs bits fixed for it.
K_STAGES: gl.constexpr = gl.SharedLinearLayout(
    offset_bases=[[0, 1], [1, 0], [0, 2], [0, 4], [8, 0], [16, 0], [32, 0], [10, 0], [4, 0]],
)  # fmt: skip
V_STAGES: gl.constexpr = gl.SharedLinearLayout(
    offset_bases=[[8, 0], [1, 0], [0, 1], [0, 2], [0, 4], [2, 0], [4, 0], [16, 2], [32, 4]],
)  # fmt: skip
META_STAGES: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
META_COPY: gl.constexpr = gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32], warps_per_cta=[1], order=[0])
# Triton 3.6 names these async_copy_global_to_shared and thread_barrier; later versions async_load and barrier.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
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
def _v_operands(codes, PACK: gl.constexpr):
    """V codes ``[keys, bytes]`` as the value MMA's A operands ``[dims m, keys K]``, one a half, for free.

    Byte ``4g + b`` becomes row ``m = 8b + g``; key ``16t + 8e + (8 // PACK) h + c`` becomes ``K = 8c + 2t + e``
    of half h, which is score row ``m = 8c + g'`` of key ``8g' + (8 // PACK) h + c`` (see :func:`_key_rows`
    and :func:`_weights_operand`).
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
def _weights_operand(weights):
    """Scores-shaped bf16 weights ``[rows m, 8 columns]`` as the value MMA's B operand ``[K = m, 8 columns]``.

    After the transposes, the register that held ``W[8i + g, 2t + e]`` holds ``W[8i + 2t + e, g]``: the
    tensor read with its logical indices is ``W^T`` blockwise, and a relabelling makes it ``W``."""
    rows: gl.constexpr = weights.shape[0]
    moved = gl.inline_asm_elementwise(TRANSPOSE_8X8, "=r,r", [weights], dtype=gl.bfloat16, is_pure=True, pack=2)
    moved = gl.permute(gl.reshape(moved, [rows // 8, 8, 4, 2]), (0, 2, 3, 1))  # [i, g, t, e] -> [i, t, e, g]
    return gl.convert_layout(gl.reshape(moved, [rows, 8]), B_OP, assert_trivial=True)


@gluon.jit
def _half_columns(operand, HALF: gl.constexpr):
    """A B operand ``[K, 8 columns]`` with the columns of the other half zeroed: column n is lane group
    g = n, so lanes of the other half (lane id bit 4) zero their registers, a pair at a time."""
    keep: gl.constexpr = "ne" if HALF else "eq"
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; and.b32 l, l, 16; setp." + keep.value + ".u32 p, l, 0; "
        "selp.b32 $0, $1, 0, p; }", "=r,r", [operand], dtype=gl.bfloat16, is_pure=True, pack=2)  # fmt: skip


@gluon.jit
def _by_half(values, PACK: gl.constexpr):
    """An MMA-shaped ``[rows, 8]`` tensor as ``[rows, PACK, 8 // PACK]`` (column ``(8 // PACK) h + j``), for free."""
    rows: gl.constexpr = values.shape[0]
    values = gl.reshape(values, [rows, PACK, 8 // PACK])
    if PACK == 2:
        return gl.convert_layout(values, PAIRS, assert_trivial=True)
    elif rows == 64:
        return gl.convert_layout(values, SINGLE, assert_trivial=True)
    else:
        return gl.convert_layout(values, SINGLE_ACC, assert_trivial=True)


@gluon.jit
def _columns(values):
    """:func:`_by_half`'s inverse: ``[rows, PACK, heads]`` as the MMA-shaped ``[rows, 8]``, for free."""
    rows: gl.constexpr = values.shape[0]
    return gl.convert_layout(gl.reshape(values, [rows, 8]), MMA, assert_trivial=True)


@gluon.jit
def _key_rows(values, PACK: gl.constexpr):
    """A per-key vector (META or META_PAIRS) as ``[rows, PACK]`` of the scores by half, for free: key
    ``8g + (8 // PACK) h + i`` is row ``8i + g`` of half h."""
    rows: gl.constexpr = 64 // PACK
    values = gl.reshape(gl.permute(gl.reshape(values, [8, PACK, 8 // PACK]), (2, 0, 1)), [rows, PACK])
    if PACK == 2:
        return gl.convert_layout(values, gl.SliceLayout(2, PAIRS), assert_trivial=True)
    else:
        return gl.convert_layout(values, gl.SliceLayout(2, SINGLE), assert_trivial=True)


@gluon.jit
def _lane_sum(values):
    """``[rows, halves, heads]`` summed over the rows a lane holds (no shuffles): ``[8 lanes g, halves, heads]``."""
    rows: gl.constexpr = values.shape[0]
    return gl.sum(gl.reshape(values, [rows // 8, 8, values.shape[1], values.shape[2]]), axis=0)


@gluon.jit
def _head_total(partial):
    """A lane-partial ``[8 g, halves, heads]`` summed over lanes and halves: a per-head vector."""
    return gl.sum(gl.sum(partial, axis=0), axis=0)


@gluon.jit
def _per_head(columns, PACK: gl.constexpr):
    """A HEAD_COLS vector as ``[PACK, 8 // PACK]`` (half, head), to be reduced over its halves."""
    values = gl.reshape(columns, [PACK, 8 // PACK])
    if PACK == 2:
        return gl.convert_layout(values, gl.SliceLayout(0, PAIRS), assert_trivial=True)
    else:
        return gl.convert_layout(values, gl.SliceLayout(0, SINGLE), assert_trivial=True)


@gluon.jit
def _broadcast(per_head, like):
    """A per-head vector broadcast to ``like``'s ``[rows, halves, heads]`` layout, for free."""
    layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, like.type.layout))
    return gl.expand_dims(gl.expand_dims(gl.convert_layout(per_head, layout, assert_trivial=True), 0), 0)


@functools.cache
def value_unpack_asm() -> str:
    """PTX: V's 2-bit codes as bf16 ``OFFSET + f_j * code``, two codes a 32-bit output.

    Blocks j < 3 are ``128 + 4**j * code`` (they lie inside bf16's 7-bit mantissa); block 3 is
    ``128 + code`` after a shift (fp16, whose mantissa would hold it, would make the weights fp16, which
    could overflow on large value scales). Two words of two keys in, output ``4j + b`` holds block j of
    byte b of both keys (one key a 16-bit half, masked in its low byte), the pair the value MMA's A
    operand wants.
    """
    lines = [".reg .b32 t, u;"]
    for b in range(4):  # t: per 16-bit half, byte b of one key in its low byte
        lines.append(f"prmt.b32 t, $16, $17, {b | b << 4 | (4 + b) << 8 | (4 + b) << 12:#x};")
        for j in range(4):
            source, mask = "t", 0x00030003 << (2 * j)
            if j == 3:
                lines.append("shr.b32 u, t, 6;")
                source, mask = "u", 0x00030003
            lines.append(f"lop3.b32 ${4 * j + b}, {source}, {mask:#x}, 0x43004300, 0xEA;")
    return "{ " + " ".join(lines) + " }"


# bf16 pairs (one 32-bit register) as two float32, one instruction each (the compiler's conversion of
# the high half takes two), and two float32 as one rounded bf16 pair (one instruction, not three).
WIDEN_BF16 = gl.constexpr("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }")
NARROW_BF16 = gl.constexpr("cvt.rn.bf16x2.f32 $0, $2, $1;")


@gluon.jit
def _widen(values):
    """bf16 ``values`` as float32 (exact)."""
    return gl.inline_asm_elementwise(WIDEN_BF16, "=r,=r,r", [values], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _narrow(values):
    """float32 ``values`` rounded to bf16 (to nearest even, as ``.to(gl.bfloat16)``)."""
    return gl.inline_asm_elementwise(NARROW_BF16, "=r,r,r", [values], dtype=gl.bfloat16, is_pure=True, pack=2)


# K's scores run on int8 MMAs, q as two int8 halves of a 16-bit fixed point (``_q_int8``): a mask makes
# 4 codes an int8 operand register, where bf16 operands took 8 masks a word for its 16 codes, on the
# ALU pipe that bounds the tile (H200, 100K: the whole call 28.8 against 30.1 us at batch 1, 171.1
# against 180.1 at batch 8; eval/results/gluon_history_int8_scores.md). The sums are exact int32.
# Block j of each byte of a K word as int8 ``f_j * code``: f = 1, 4, 16 by masks alone, and 16 for
# block 3, shifted down by 2 so that it stays below int8's 128.
K_UNPACK = gl.constexpr(
    "{ .reg .b32 t; lop3.b32 $0, $4, 0x03030303, 0, 0xEA; lop3.b32 $1, $4, 0x0C0C0C0C, 0, 0xEA; "
    "lop3.b32 $2, $4, 0x30303030, 0, 0xEA; shr.b32 t, $4, 2; lop3.b32 $3, t, 0x30303030, 0, 0xEA; }"
)
K_FACTORS = (1.0, 4.0, 16.0, 16.0)
# q's fixed point: |q| * scale <= Q_RANGE, so a dot is at most 128 * 3 * Q_RANGE (int32) and each half
# fits int8 (hi <= 125).
Q_RANGE = gl.constexpr(32000.0)
# 1.5 * 2**23 + 128: a float32 below 2**22 in magnitude plus this is rounded to an integer (to nearest
# even, as 1.5 * 2**23 and 128 are even), which plus 128 is then its low mantissa bits: the float's
# bits less ROUNDER_BITS. With the 128 in, hi = (Q + 128) >> 8 is byte 1 of those bits and lo = Q - 256 hi
# is byte 0 ^ 0x80, so byte selects pack both (Q_BYTES).
ROUNDER = gl.constexpr(12583040.0)
ROUNDER_BITS = gl.constexpr(0x4B400080)
# Four rounded floats' bits in, hi's and lo's four int8 out: 5 instructions where shifts, adds and
# packing took 14 (per 4 of a prologue's 32 values a thread).
Q_BYTES = gl.constexpr(
    "{ .reg .b32 x, y, z; prmt.b32 x, $2, $3, 0x5140; prmt.b32 y, $4, $5, 0x5140; prmt.b32 $0, x, y, 0x7632; "
    "prmt.b32 z, x, y, 0x5410; xor.b32 $1, z, 0x80808080; }"
)


@gluon.jit
def _unpack_k(words):
    """Per column block j the int8 codes ``f_j * c`` ``[keys, bytes]`` (byte ``4w + b``) of K's ``[keys, words]``."""
    twice = gl.join(words, words)
    four = gl.reshape(gl.join(twice, twice), [64, 8, 4])
    o = gl.inline_asm_elementwise(K_UNPACK, "=r,=r,=r,=r,r,r,r,r", [four], dtype=(gl.int8,) * 4,
                                  is_pure=True, pack=4)  # fmt: skip
    return (gl.reshape(o[0], [64, 32]), gl.reshape(o[1], [64, 32]), gl.reshape(o[2], [64, 32]),
            gl.reshape(o[3], [64, 32]))  # fmt: skip


@gluon.jit
def _k_operands(codes, PACK: gl.constexpr):
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
    (heads >= GROUP are 0); ``byte(k)`` inverts :func:`_k_operands`' relabelling."""
    k = gl.arange(0, 32, layout=gl.SliceLayout(1, B_OP8))
    heads = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP8))
    byte = 8 * ((k // 4) % 4) + 4 * (k // 16) + k % 4
    return _widen(gl.load(Q + heads[None, :] * D + (32 * J + byte)[:, None], mask=(heads < GROUP)[None, :], other=0.0))


@gluon.jit
def _q_halves(block, scale, FACTOR: gl.constexpr):
    """A q block as the integers ``Q = round(q * scale / FACTOR)`` (to nearest, even on ties), split
    ``Q = 256 hi + lo`` into two int8 B operands, and ``FACTOR * Q`` (what the codes' zero points multiply,
    summed over dims). The rounding adds ``ROUNDER`` on the float pipe: a conversion instruction runs on
    the quarter-rate unit, where the 16 programs of an SM would queue their prologues' 32 each."""
    bits = (block * (scale / FACTOR)[None, :] + ROUNDER).to(gl.int32, bitcast=True)
    hi, lo = gl.inline_asm_elementwise(Q_BYTES, "=r,=r,r,r,r,r", [bits], dtype=(gl.int8, gl.int8), is_pure=True,
                                       pack=4)  # fmt: skip
    return hi, lo, (bits - ROUNDER_BITS) * int(FACTOR)


@gluon.jit
def _q_int8(Q, GROUP: gl.constexpr, PACK: gl.constexpr):
    """q for the int8 scores: per column block the two int8 halves of its fixed point, each as one B
    operand a half (:func:`_halves_of`), and per head ``-sum(q)`` in fixed-point units and the unit
    (``1 / scale``). Blocks are combined elementwise first, so that each per-head value takes one
    cross-lane reduction."""
    d0, d1, d2, d3 = _q_dims(Q, 0, GROUP), _q_dims(Q, 1, GROUP), _q_dims(Q, 2, GROUP), _q_dims(Q, 3, GROUP)
    amax = gl.max(gl.maximum(gl.maximum(gl.abs(d0), gl.abs(d1)), gl.maximum(gl.abs(d2), gl.abs(d3))), axis=0)
    amax = gl.maximum(amax, 1e-30)  # heads past GROUP (and an all-zero q) quantize to 0
    scale = Q_RANGE / amax
    # the factors are K_FACTORS (K_UNPACK's), written out: a jitted function reads only constexpr globals
    h0, l0, s0 = _q_halves(d0, scale, 1.0)
    h1, l1, s1 = _q_halves(d1, scale, 4.0)
    h2, l2, s2 = _q_halves(d2, scale, 16.0)
    h3, l3, s3 = _q_halves(d3, scale, 16.0)
    neg_q_sum = gl.convert_layout(-gl.sum(s0 + s1 + s2 + s3, axis=0).to(gl.float32), HEAD_COLS)
    unit = gl.convert_layout(amax * (1.0 / Q_RANGE), HEAD_COLS)
    # columns past GROUP hold 0 and a unit of 1e-30 / Q_RANGE: a half's sum and max are its heads'
    return ((_halves_of(h0, PACK), _halves_of(h1, PACK), _halves_of(h2, PACK), _halves_of(h3, PACK)),
            (_halves_of(l0, PACK), _halves_of(l1, PACK), _halves_of(l2, PACK), _halves_of(l3, PACK)),
            gl.sum(_per_head(neg_q_sum, PACK), axis=0), gl.max(_per_head(unit, PACK), axis=0))  # fmt: skip


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
def _unpack_v(words, UNPACK: gl.constexpr):
    """Per column block j the ``[keys, bytes]`` codes of V's ``[keys, words]`` (``value_unpack_asm()``)."""
    o = gl.inline_asm_elementwise(UNPACK, "=r," * 16 + "r,r", [words], dtype=(gl.bfloat16,) * 16, is_pure=True,
                                  pack=2)  # fmt: skip
    return (_bytes_of(o[0], o[1], o[2], o[3]), _bytes_of(o[4], o[5], o[6], o[7]),
            _bytes_of(o[8], o[9], o[10], o[11]), _bytes_of(o[12], o[13], o[14], o[15]))  # fmt: skip


@gluon.jit
def _word_offsets(LAYOUT: gl.constexpr, ROW_WORDS: gl.constexpr):
    """A tile's rows ``[64]`` and its words' offsets ``[64, 8]`` (rows ``ROW_WORDS`` words apart) in ``LAYOUT``."""
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, LAYOUT))
    return rows, rows[:, None] * ROW_WORDS + gl.arange(0, 8, layout=gl.SliceLayout(0, LAYOUT))[None, :]


@gluon.jit
def _load_tile(KC, VC, KS, KZ, VS, VZ, block, end, ROW_WORDS: gl.constexpr, MASKED: gl.constexpr, PACK: gl.constexpr):
    """One tile's K and V code words and its four metadata vectors; ``MASKED``: rows from ``end`` on
    read as 0. A row's 8 words are contiguous (rows ``ROW_WORDS`` apart), its scale or zero one element:
    constant strides let loads be 8 and 16 bytes wide, which a mask allows only where it is known
    constant over 8 rows (not for a length read on the device). Offsets are taken from the tile's first row, so each address is a base plus
    a constant."""
    k_rows, k_offsets = _word_offsets(gl.constexpr(WORDS_K), ROW_WORDS)
    v_rows, v_offsets = _word_offsets(gl.constexpr(WORDS_V), ROW_WORDS)
    rows = gl.arange(0, 64, layout=META_PAIRS if PACK == 2 else META)
    KC, VC = KC + block * ROW_WORDS, VC + block * ROW_WORDS
    KS, KZ, VS, VZ = KS + block, KZ + block, VS + block, VZ + block
    if MASKED:
        n = end - block
        raw_k = gl.load(KC + k_offsets, mask=(k_rows < n)[:, None], other=0)
        raw_v = gl.load(VC + v_offsets, mask=(v_rows < n)[:, None], other=0)
        ok = rows < n
        meta = (gl.load(KS + rows, mask=ok, other=0.0), gl.load(KZ + rows, mask=ok, other=0.0),
                gl.load(VS + rows, mask=ok, other=0.0), gl.load(VZ + rows, mask=ok, other=0.0))  # fmt: skip
    else:
        raw_k, raw_v = gl.load(KC + k_offsets), gl.load(VC + v_offsets)
        meta = (gl.load(KS + rows), gl.load(KZ + rows), gl.load(VS + rows), gl.load(VZ + rows))
    return raw_k, raw_v, meta


@gluon.jit
def _stage_buffers(KS):
    """Two stages of a tile's K and V words and of its four metadata vectors, in shared memory."""
    meta = KS.dtype.element_ty
    return (gl.allocate_shared_memory(gl.int32, [2, 64, 8], K_STAGES),
            gl.allocate_shared_memory(gl.int32, [2, 64, 8], V_STAGES),
            gl.allocate_shared_memory(meta, [2, 64], META_STAGES),
            gl.allocate_shared_memory(meta, [2, 64], META_STAGES),
            gl.allocate_shared_memory(meta, [2, 64], META_STAGES),
            gl.allocate_shared_memory(meta, [2, 64], META_STAGES))  # fmt: skip


@gluon.jit
def _copy_tile(buffers, stage, KC, VC, KS, KZ, VS, VZ, block, ROW_WORDS: gl.constexpr):
    """Start copying the whole tile at row ``block`` into ``stage`` (no registers held meanwhile), each
    instruction whole rows (COPY_K, COPY_V); the metadata go in the copy's own layout."""
    k_buf, v_buf, ks_buf, kz_buf, vs_buf, vz_buf = buffers
    _, k_offsets = _word_offsets(gl.constexpr(COPY_K), ROW_WORDS)
    _, v_offsets = _word_offsets(gl.constexpr(COPY_V), ROW_WORDS)
    rows = gl.arange(0, 64, layout=META_COPY)
    _async_load(k_buf.index(stage), KC + block * ROW_WORDS + k_offsets)
    _async_load(v_buf.index(stage), VC + block * ROW_WORDS + v_offsets)
    _async_load(ks_buf.index(stage), KS + block + rows)
    _async_load(kz_buf.index(stage), KZ + block + rows)
    _async_load(vs_buf.index(stage), VS + block + rows)
    _async_load(vz_buf.index(stage), VZ + block + rows)


@gluon.jit
def _staged_tile(buffers, stage, PACK: gl.constexpr):
    """A copied tile read back from ``stage`` in the layouts :func:`_load_tile` gives."""
    k_buf, v_buf, ks_buf, kz_buf, vs_buf, vz_buf = buffers
    layout: gl.constexpr = META_PAIRS if PACK == 2 else META
    meta = (ks_buf.index(stage).load(layout), kz_buf.index(stage).load(layout), vs_buf.index(stage).load(layout),
            vz_buf.index(stage).load(layout))  # fmt: skip
    return k_buf.index(stage).load(WORDS_K), v_buf.index(stage).load(WORDS_V), meta


@gluon.jit
def _launch_dependents():
    """Let the next kernel in the stream, if launched programmatically, start now."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)  # fmt: skip


@gluon.jit
def _wait_for_inputs():
    """Wait until the kernel before this one (it launched this one programmatically) has ended and its
    writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


# A program's timeline (SpanVariant.timeline, kernels/tools/timeline_decode.py): TIMELINE_FIELDS
# int64 a program, its SM, warp slot and tiles (``sm + slot << 16 + tiles << 32``, see :func:`placement`),
# the global timer at its start and end (ns, comparable across SMs), and the SM's cycle counter at the
# start, after the wait for the kernel ahead (EARLY), once q is ready, after the last tile and at the end.
# Untimed launches (the default) compile none of it.
TIMELINE_FIELDS = gl.constexpr(8)


def placement(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sm, warp slot, tiles)`` of each timeline record ``[programs, TIMELINE_FIELDS]``."""
    return records[:, 0] & 0xFFFF, (records[:, 0] >> 16) & 0xFFFF, records[:, 0] >> 32


@gluon.jit
def _clock(after):
    """The SM's cycle counter, read once ``after`` (a scalar) is computed."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64; // $1", "=l,f", [after], dtype=gl.int64, is_pure=False,
                                     pack=1)  # fmt: skip


# Special registers as int64, for _special: the SM's cycle counter, the global timer (ns), the SM and the warp slot.
CLOCK = gl.constexpr("mov.u64 $0, %clock64;")
GLOBAL_TIME = gl.constexpr("mov.u64 $0, %globaltimer;")
SM_ID = gl.constexpr("{ .reg .u32 t; mov.u32 t, %smid; cvt.u64.u32 $0, t; }")
WARP_SLOT = gl.constexpr("{ .reg .u32 t; mov.u32 t, %warpid; cvt.u64.u32 $0, t; }")


@gluon.jit
def _special(READ: gl.constexpr):
    """The special register that ``READ`` (one of the reads above) moves into an int64."""
    return gl.inline_asm_elementwise(READ, "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def history_kernel(
    Q, q_b, KW, kw_b, kw_h, VW, vw_b, vw_h, KS, KZ, VS, VZ, meta_b, meta_h,
    n_hist, chunk, PM, PL, PACC, n_slots, score_scale, LENGTHS, TIMES,
    GROUP: gl.constexpr, V_UNPACK: gl.constexpr, RING: gl.constexpr, PIPELINE: gl.constexpr,
    LAUNCH_DEPENDENTS: gl.constexpr, EARLY: gl.constexpr, PACK: gl.constexpr, TIMED: gl.constexpr,
    ROW_WORDS: gl.constexpr,
):  # fmt: skip
    """Program ``(b, kv head, split)``: history rows ``[split*chunk, (split+1)*chunk)`` of one KV head for
    its ``GROUP`` query heads, into partial slot ``split`` (``PM``/``PL`` ``[B, Hq, n_slots]``, ``PACC``
    ``[B, Hq, n_slots, D]``, as the Triton stage 1 writes its history slots). Codes come as 32-bit words
    ``[B, Hkv, L, 8]``, rows ``ROW_WORDS`` words apart (8 packed, more where rows of K and V alternate in
    one buffer); scale/zero ``[B, Hkv, L]`` (one group). ``RING`` (static decoding): the valid history rows
    are ``LENGTHS[0]`` (device memory), split in ``num_programs(2)`` chunks as the Triton stage 1 does.
    ``LAUNCH_DEPENDENTS``: let the next kernel (the dense tiers, launched programmatically) start now;
    it writes other slots and waits for this grid before it ends. ``EARLY`` (staged only): this grid was
    launched programmatically, before the kernel ahead of it ended; the history and ``LENGTHS`` were
    written before that kernel, so the first tile's copy starts at once, and q (which that kernel may
    write) is read, the slots written and the dense tiers let start, only after it has ended.
    ``TIMED``: the program's timeline goes to ``TIMES`` (see :data:`TIMELINE_FIELDS`)."""
    if TIMED:
        started, started_cycle = _special(GLOBAL_TIME), _special(CLOCK)
    if LAUNCH_DEPENDENTS and not EARLY:
        _launch_dependents()
    if RING:
        n_hist = gl.load(LENGTHS).to(gl.int32)
        chunk = gl.cdiv(gl.cdiv(n_hist, gl.num_programs(2)), 64) * 64
    b = gl.program_id(0).to(gl.int64)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    start = split * chunk
    # Splits sized for a capacity can start past a shorter history: empty, not negative (a negative
    # length would floor to a stray masked tile over another split's rows).
    end = gl.maximum(gl.minimum(start + chunk, n_hist), start)
    if TIMED:
        TIMES += ((b * gl.num_programs(1) + kv_head) * gl.num_programs(2) + split) * TIMELINE_FIELDS
        gl.store(TIMES + 1, started)
        gl.store(TIMES + 3, started_cycle)
        tiles = gl.cdiv(end - start, 64).to(gl.int64)
        gl.store(TIMES, _special(SM_ID) + (_special(WARP_SLOT) << 16) + (tiles << 32))
    head0 = b * (gl.num_programs(1) * GROUP) + kv_head * GROUP
    _history_span(
        Q + b * q_b + kv_head * GROUP * D, KW + b * kw_b + kv_head * kw_h, VW + b * vw_b + kv_head * vw_h,
        KS + b * meta_b + kv_head * meta_h, KZ + b * meta_b + kv_head * meta_h,
        VS + b * meta_b + kv_head * meta_h, VZ + b * meta_b + kv_head * meta_h, start, end,
        PM + head0 * n_slots + split, PL + head0 * n_slots + split, PACC + (head0 * n_slots + split) * D, n_slots,
        score_scale, TIMES, GROUP, V_UNPACK, PIPELINE, LAUNCH_DEPENDENTS, EARLY, PACK, TIMED, ROW_WORDS,
    )  # fmt: skip
    if TIMED:
        gl.store(TIMES + 7, _special(CLOCK))
        gl.store(TIMES + 2, _special(GLOBAL_TIME))


@gluon.jit
def _history_span(
    Q, KC, VC, KS, KZ, VS, VZ, start, end, PM, PL, PACC, head_stride, score_scale, TIMES,
    GROUP: gl.constexpr, V_UNPACK: gl.constexpr, PIPELINE: gl.constexpr, LAUNCH_DEPENDENTS: gl.constexpr,
    EARLY: gl.constexpr, PACK: gl.constexpr, TIMED: gl.constexpr, ROW_WORDS: gl.constexpr,
):  # fmt: skip
    """Rows ``[start, end)`` of one KV head's packed history for its ``GROUP`` query heads: running max,
    sum and unnormalised accumulator (float32). K's codes enter int8 MMAs as ``f_j * c`` against q's
    fixed point (:func:`_q_int8`), V's bf16 MMAs as ``OFFSET + 4**j * c`` and ``OFFSET + c`` (see
    :func:`value_unpack_asm`). Whole tiles run without masks; a last partial tile runs masked.
    ``PIPELINE``: each whole tile is copied into shared memory (``cp.async``) while the one before
    computes, so that its loads' latency is hidden without registers to hold them (a register prefetch
    took 204 registers a thread). ``EARLY``: see :func:`history_kernel`."""
    whole_end = start + (end - start) // 64 * 64
    if PIPELINE:  # the first tile's copy starts before q is gathered, so that the two latencies overlap
        buffers = _stage_buffers(KS)
        if start < whole_end:
            _copy_tile(buffers, 0, KC, VC, KS, KZ, VS, VZ, start, ROW_WORDS)
        async_copy.commit_group()
    if EARLY:  # the copy above overlaps the kernel before; what follows may read what it wrote
        _wait_for_inputs()
        if LAUNCH_DEPENDENTS:
            _launch_dependents()
    if TIMED:
        gl.store(TIMES + 4, _special(CLOCK))
    q = _q_int8(Q, GROUP, PACK)
    if TIMED:
        gl.store(TIMES + 5, _clock(gl.max(q[3], axis=0)))
    # per lane, half and head: sum(p), sum(w), sum(w * zero) over the lane's keys (reduced at the end)
    lane_sums = _lane_sum(_by_half(gl.full([64 // PACK, 8], 0.0, gl.float32, MMA), PACK))
    acc = gl.full([32, 8], 0.0, gl.float32, MMA)
    m_i = gl.max(_per_head(gl.full([8], float("-inf"), gl.float32, HEAD_COLS), PACK), axis=0)
    state = (m_i, lane_sums, lane_sums, lane_sums, acc, acc, acc, acc)
    if PIPELINE:  # tile i + 1 is copied into shared memory while tile i computes
        for block in range(start, whole_end, 64):
            stage = (block - start) // 64 % 2
            if block + 64 < whole_end:
                _copy_tile(buffers, 1 - stage, KC, VC, KS, KZ, VS, VZ, block + 64, ROW_WORDS)
            async_copy.commit_group()  # empty past the last whole tile: the wait below stays one group behind
            async_copy.wait_group(1)
            _barrier()  # the metadata were copied by other lanes than those that read them
            state = _tile_step(state, _staged_tile(buffers, stage, PACK), q, score_scale, block, end, V_UNPACK, False,
                               PACK)
    else:
        for block in range(start, whole_end, 64):
            tile = _load_tile(KC, VC, KS, KZ, VS, VZ, block, end, ROW_WORDS, False, PACK)
            state = _tile_step(state, tile, q, score_scale, block, end, V_UNPACK, False, PACK)
    if whole_end < end:
        tile = _load_tile(KC, VC, KS, KZ, VS, VZ, whole_end, end, ROW_WORDS, True, PACK)
        state = _tile_step(state, tile, q, score_scale, whole_end, end, V_UNPACK, True, PACK)
    m_i, l_part, w_part, wz_part, acc0, acc1, acc2, acc3 = state
    if TIMED:
        gl.store(TIMES + 6, _clock(gl.max(m_i, axis=0)))
    _store_partials(PM, PL, PACC, head_stride, m_i, _head_total(l_part), _head_total(w_part), _head_total(wz_part),
                    acc0, acc1, acc2, acc3, GROUP, PACK)  # fmt: skip


@gluon.jit
def _fixed_point_dots(raw_k, k_zero, q, PACK: gl.constexpr):
    """``[rows m, PACK, heads]`` of ``q . (c - zero)`` in q's fixed-point units (float32): per column
    block two int8 MMAs a half (q's high and low halves, exact int32 sums), joined as ``256 hi + lo``."""
    q_hi, q_lo, neg_q_sum, unit = q
    c0, c1, c2, c3 = _unpack_k(raw_k)
    hi = gl.full([64 // PACK, 8], 0, gl.int32, MMA)
    hi, lo = _block_dots(c0, q_hi[0], q_lo[0], hi, hi, PACK)
    hi, lo = _block_dots(c1, q_hi[1], q_lo[1], hi, lo, PACK)
    hi, lo = _block_dots(c2, q_hi[2], q_lo[2], hi, lo, PACK)
    hi, lo = _block_dots(c3, q_hi[3], q_lo[3], hi, lo, PACK)
    dots = _by_half((hi * 256 + lo).to(gl.float32), PACK)
    return dots + _key_rows(k_zero, PACK)[:, :, None] * _broadcast(neg_q_sum, dots)


@gluon.jit
def _block_dots(codes, q_hi, q_lo, hi, lo, PACK: gl.constexpr):
    """One column block's MMAs into ``hi`` and ``lo``: each half's keys against its q operand."""
    a = _k_operands(codes, PACK)
    hi, lo = mma_v2(a[0], q_hi[0], hi), mma_v2(a[0], q_lo[0], lo)
    if PACK == 2:
        hi, lo = mma_v2(a[1], q_hi[1], hi), mma_v2(a[1], q_lo[1], lo)
    return hi, lo


@gluon.jit
def _tile_step(state, tile, q, score_scale, block, end, V_UNPACK: gl.constexpr, MASKED: gl.constexpr,
               PACK: gl.constexpr):  # fmt: skip
    """The online softmax over one 64-key tile, as ``[64 // PACK rows, PACK halves, heads]``: ``state``
    (m, three lane-partial sums, four accumulators) updated. ``MASKED``: keys from ``end`` on score -inf."""
    m_i, l_part, w_part, wz_part, acc0, acc1, acc2, acc3 = state
    raw_k, raw_v, meta = tile
    k_scale, k_zero, v_scale, v_zero = _widen(meta[0]), _widen(meta[1]), _widen(meta[2]), _widen(meta[3])
    unit = q[3]
    # scores in q's fixed-point units; the unit (a head's factor > 0) enters the max and the exponent
    scores = _fixed_point_dots(raw_k, k_zero, q, PACK) * (_key_rows(k_scale, PACK) * score_scale)[:, :, None]
    if MASKED:
        keys = block + gl.arange(0, 64, layout=META_PAIRS if PACK == 2 else META)
        scores = gl.where(_key_rows(keys < end, PACK)[:, :, None], scores, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(gl.max(scores, axis=0), axis=0) * unit)
    m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_new)
    m_i = m_new
    lanes = _broadcast(alpha, l_part)
    l_part, w_part, wz_part = l_part * lanes, w_part * lanes, wz_part * lanes
    p = gl.exp2(scores * _broadcast(unit, scores) - _broadcast(m_i, scores))
    weights = _narrow(p * _key_rows(v_scale, PACK)[:, :, None])
    w = _widen(weights)
    l_part = l_part + _lane_sum(p)
    w_part = w_part + _lane_sum(w)
    wz_part = wz_part + _lane_sum(w * _key_rows(v_zero, PACK)[:, :, None])
    w_op = _weights_operand(_columns(weights))
    v0, v1, v2, v3 = _unpack_v(raw_v, V_UNPACK)
    if PACK == 2:
        first, second = _half_columns(w_op, 0), _half_columns(w_op, 1)
        acc0 = _value_mmas(_v_operands(v0, PACK), first, second, _rescaled(acc0, alpha, PACK))
        acc1 = _value_mmas(_v_operands(v1, PACK), first, second, _rescaled(acc1, alpha, PACK))
        acc2 = _value_mmas(_v_operands(v2, PACK), first, second, _rescaled(acc2, alpha, PACK))
        acc3 = _value_mmas(_v_operands(v3, PACK), first, second, _rescaled(acc3, alpha, PACK))
    else:
        acc0 = mma_v2(_v_operands(v0, PACK)[0], w_op, _rescaled(acc0, alpha, PACK))
        acc1 = mma_v2(_v_operands(v1, PACK)[0], w_op, _rescaled(acc1, alpha, PACK))
        acc2 = mma_v2(_v_operands(v2, PACK)[0], w_op, _rescaled(acc2, alpha, PACK))
        acc3 = mma_v2(_v_operands(v3, PACK)[0], w_op, _rescaled(acc3, alpha, PACK))
    return m_i, l_part, w_part, wz_part, acc0, acc1, acc2, acc3


@gluon.jit
def _value_mmas(codes, first, second, acc):
    """Both halves' value MMAs: each half's codes against its weights, zero in the other's columns."""
    return mma_v2(codes[1], second, mma_v2(codes[0], first, acc))


@gluon.jit
def _rescaled(acc, alpha, PACK: gl.constexpr):
    """An accumulator ``[32 dims, 8 columns]`` times each column's head's ``alpha``."""
    acc = _by_half(acc, PACK)
    return _columns(acc * _broadcast(alpha, acc))


@gluon.jit
def _store_partials(PM, PL, PACC, head_stride, m_i, l_i, w_sum, wz_sum, acc0, acc1, acc2, acc3,
                    GROUP: gl.constexpr, PACK: gl.constexpr):  # fmt: skip
    """m, l and ``acc[h, dim] = acc_j[m, h] / f_j - sum(w * zero) - OFFSET / f_j * sum(w)`` (``f_j`` the
    block's code factor; dim ``32j + 4*(m % 8) + m // 8``; ``acc_j`` summed over its halves)."""
    acc0, acc1, acc2, acc3 = _over_halves(acc0, PACK), _over_halves(acc1, PACK), _over_halves(acc2, PACK), \
        _over_halves(acc3, PACK)  # fmt: skip
    heads = gl.arange(0, 8 // PACK, layout=m_i.type.layout)
    gl.store(PM + heads * head_stride, m_i, mask=heads < GROUP)
    gl.store(PL + heads * head_stride, gl.convert_layout(l_i, m_i.type.layout, assert_trivial=True), mask=heads < GROUP)
    columns: gl.constexpr = gl.SliceLayout(0, acc0.type.layout)
    heads = gl.arange(0, 8 // PACK, layout=columns)
    w_sum = gl.convert_layout(w_sum, columns, assert_trivial=True)[None, :]
    wz_sum = gl.convert_layout(wz_sum, columns, assert_trivial=True)[None, :]
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, acc0.type.layout))
    out = PACC + heads[None, :] * (head_stride * D) + (4 * (rows % 8) + rows // 8)[:, None]
    ok = (heads < GROUP)[None, :]
    gl.store(out, acc0 - wz_sum - OFFSET * w_sum, mask=ok)
    gl.store(out + 32, acc1 * 0.25 - wz_sum - (OFFSET * 0.25) * w_sum, mask=ok)
    gl.store(out + 64, acc2 * 0.0625 - wz_sum - (OFFSET * 0.0625) * w_sum, mask=ok)
    gl.store(out + 96, acc3 - wz_sum - OFFSET * w_sum, mask=ok)


@gluon.jit
def _over_halves(acc, PACK: gl.constexpr):
    """An accumulator ``[32 dims, 8 columns]`` as ``[32 dims, heads]``, its halves summed."""
    return gl.sum(_by_half(acc, PACK), axis=1)


@dataclasses.dataclass(frozen=True, eq=False)
class SpanVariant:
    """Variants of the span for kernel development (kernels/tools/); the defaults are the production
    kernel. ``two_halves=False`` splits no tile into halves (:func:`halves`); ``registers`` caps the
    registers a thread (``maxnreg``), and the decode call sizes its splits by the programs an SM that
    cap fits; ``timeline``, a zeroed int64 buffer of at least ``batch * kv heads * splits *
    TIMELINE_FIELDS``, receives each program's timeline (see :data:`TIMELINE_FIELDS`)."""

    two_halves: bool = True
    registers: int = REGISTERS
    timeline: torch.Tensor | None = None

    def programs_per_sm(self) -> int:
        return programs_per_sm(self.registers)


PRODUCTION = SpanVariant()


def history_into(
    q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, v_codes: torch.Tensor,
    v_scale: torch.Tensor, v_zero: torch.Tensor, sm_scale: float, partial_m: torch.Tensor, partial_l: torch.Tensor,
    partial_acc: torch.Tensor, splits: int, chunk: int, lengths: torch.Tensor | None = None,
    pipeline: bool | None = None, launch_dependents: bool = False, early: bool = False, *,
    variant: SpanVariant = PRODUCTION,
) -> None:
    """Write the packed history's partial results into slots ``[0, splits)`` of the decode kernel's
    buffers (``partial_m``/``partial_l`` ``[B, Hq, n_slots]``, ``partial_acc`` ``[B, Hq, n_slots, D]``;
    m and l in base-2 units): ``chunk`` rows a split, or with ``lengths`` (static decoding) the first
    ``lengths[0]`` rows split on the device. ``pipeline``: stage the next tile in shared memory (see
    :func:`_history_span`); None (the default) stages where the metadata are aligned for it, as a
    cache's buffers are (H200, 100K: 170.0-175.5 us at batch 8 against 174.0-175.7 direct, a tie at
    batch 1; ``eval/results/gluon_history_timing.md``). ``launch_dependents`` (Hopper
    and later): the next kernel may start before this one ends, and must not read what it writes
    without waiting (``griddepcontrol.wait``). ``early`` (Hopper and later, staged): this launch may
    start before the kernel ahead of it ends, copying its first tiles meanwhile; only for a history
    (and ``lengths``) that kernel does not write, as in a decode step, where it rotates q. ``variant``:
    see :class:`SpanVariant`."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k_codes.shape[1]
    group = q_heads // kv_heads
    if (head_dim, k_codes.shape[-1], v_codes.shape[-1], k_scale.shape[-1], q.dtype) != (128, 32, 32, 1, torch.bfloat16):
        raise ValueError("the span covers INT2 K and V, head_dim 128, one group, bf16 only")
    if group > 8:
        raise ValueError(f"the span covers at most 8 query heads per KV head, got {group}")
    q = q.contiguous()
    # Rows are read in place (a cache's buffers hold more rows than are valid): no copies per call.
    words_k, words_v = _code_words(k_codes), _code_words(v_codes)
    if words_k.stride(2) != words_v.stride(2):  # one row stride for both
        words_k, words_v = words_k.contiguous(), words_v.contiguous()
    meta = [_metadata_in_place(t) for t in (k_scale, k_zero, v_scale, v_zero)]
    strides = [t.stride()[:2] for t in meta]
    if strides.count(strides[0]) != 4:  # the kernel takes one pair of strides for all four
        meta = [t.contiguous() for t in meta]
        strides = [t.stride()[:2] for t in meta]
    aligned = staging_aligned(meta)
    if pipeline is None:
        pipeline = aligned
    elif pipeline and not aligned:
        raise ValueError("pipeline=True stages the metadata with 4-byte copies: each head's rows must start "
                         "16-row aligned (storage.ROW_ALIGNMENT)")
    if early and pipeline:  # a copy made here is the kernel just before the span: its rows are not settled
        originals = (k_codes, v_codes, k_scale, k_zero, v_scale, v_zero)
        early = all(a.data_ptr() == b.data_ptr() for a, b in zip((words_k, words_v, *meta), originals))
    else:
        early = False
    launch_kernel(history_kernel, (batch, kv_heads, splits),
        q, q.stride(0), words_k, *words_k.stride()[:2], words_v, *words_v.stride()[:2], *meta,
        *strides[0], k_codes.shape[2], chunk, partial_m, partial_l, partial_acc, partial_m.shape[-1],
        sm_scale * LOG2E, q if lengths is None else lengths,  # unread without RING
        q if variant.timeline is None else variant.timeline,  # unread untimed
        GROUP=group, V_UNPACK=value_unpack_asm(), RING=lengths is not None, PIPELINE=pipeline,
        LAUNCH_DEPENDENTS=launch_dependents, EARLY=early, PACK=halves(group, variant.two_halves),
        TIMED=variant.timeline is not None, ROW_WORDS=words_k.stride(2),
        num_warps=1, maxnreg=variant.registers, launch_pdl=early,
    )  # fmt: skip


def _code_words(codes: torch.Tensor) -> torch.Tensor:
    """INT2 code rows ``[B, H, L, 32]`` (bytes) as int32 words ``[B, H, L, 8]``, in place where each row is
    contiguous and rows start 8 bytes aligned (the copies are 8 bytes wide), else copied."""
    strides = codes.stride()
    if strides[3] != 1 or strides[2] % 8 or strides[1] % 8 or strides[0] % 8 or codes.data_ptr() % 8:
        codes = codes.contiguous()
    return codes.view(torch.int32)


def _metadata_in_place(rows: torch.Tensor) -> torch.Tensor:
    """One group's scales or zeros ``[B, H, L, 1]`` as the kernel reads them (consecutive rows, any stride
    between heads); copied only where rows are not consecutive."""
    if rows.stride(2) != 1:
        return rows.contiguous()
    return rows


def staging_aligned(metadata: list[torch.Tensor]) -> bool:
    """Whether each head's metadata rows start 16 bytes aligned and Triton can prove it (pointer and
    strides divisible by 16), as ``pipeline=True`` needs."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0 for t in metadata)


def history_partials(
    q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, v_codes: torch.Tensor,
    v_scale: torch.Tensor, v_zero: torch.Tensor, sm_scale: float, splits: int, pipeline: bool = False, *,
    variant: SpanVariant = PRODUCTION,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The span over the whole packed history in ``splits`` chunks: ``(m, l, acc)`` per (batch, query
    head, split), as :func:`merge_partials` (or the decode kernel's stage 2) merges them."""
    batch, q_heads, head_dim = q.shape
    splits, chunk = split_rows(k_codes.shape[2], splits, 64)
    m = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=q.device)
    l, acc = torch.empty_like(m), torch.empty(batch, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    history_into(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, sm_scale, m, l, acc, splits, chunk,
                 pipeline=pipeline, variant=variant)  # fmt: skip
    return m, l, acc


def merge_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Attention output ``[B, Hq, D]`` from partial slots (base-2 log-sum-exp), as stage 2 merges them."""
    weight = torch.exp2(m - m.amax(dim=-1, keepdim=True)).nan_to_num(0.0)
    return (weight[..., None] * acc).sum(-2) / (weight * l).sum(-1, keepdim=True)
