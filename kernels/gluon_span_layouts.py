"""Register and shared-memory layouts of the Gluon history span (:mod:`.gluon_span_kernel`), and the
free relabellings between them.

Keys are the MMAs' rows and query heads their 8 columns; codes travel as 32-bit words. The jitted
functions here only reshape and relabel: each ends in ``convert_layout(..., assert_trivial=True)``,
which the compiler proves costs no instruction.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

D = gl.constexpr(128)  # head_dim, the only one the span covers
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
        lane_bases=[[0, 0, 2], half, [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[rows, pack, 8 // pack],
    )


# A KV head with at most 4 query heads would leave 4 of the MMAs' 8 columns idle, and every
# elementwise step of the online softmax runs on all 8. Instead, each 64-key tile is two halves of 32
# keys: half h's scores fill columns 4h..4h+3 (q is the B operand of half 0 in columns 0-3, of half 1
# in columns 4-7, zero elsewhere), and the value MMAs take each half's weights in its own columns.
# The softmax then runs on [32 rows, 2 halves, 4 heads], half the instructions a tile of
# [64 rows, 8 heads] with half of it idle.
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
    lane_bases=[[0, 2], [0, 4], [8, 0], [16, 0], [32, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[64, 8],
)
# V words [64 keys, 8 words]: lane 4g+t holds keys 16t..16t+15 and word g; consecutive registers
# hold keys c and c + 8, the two keys a register of the value MMA's A operand pairs.
WORDS_V: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [1, 0], [2, 0], [4, 0]],
    lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]],
    warp_bases=[],
    block_bases=[],
    shape=[64, 8],
)
# Per-key metadata [64]: lane 4g+t holds keys 8g..8g+7 (all t alike): one 16-byte load a vector;
# with two halves, of those the 4 keys of its half t // 2: one 8-byte load.
META: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1], [2], [4]],
    lane_bases=[[0], [0], [8], [16], [32]],
    warp_bases=[],
    block_bases=[],
    shape=[64],
)
META_PAIRS: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1], [2]],
    lane_bases=[[0], [4], [8], [16], [32]],
    warp_bases=[],
    block_bases=[],
    shape=[64],
)
# Shared-memory staging of the next tile (PIPELINE). Copies read whole rows an instruction: K, 8 bytes
# a lane over 8 consecutive rows (256 bytes); V, 4 bytes a lane over rows k, k + 1, k + 8 and k + 9.
# Copies in the read layouts would take a quarter or an eighth of each row an instruction, across 4
# to 8 lines, and keep the L1's data pipe busy (kernels/DESIGN.md).
COPY_K: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[64, 8],
)
COPY_V: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[2, 0], [4, 0], [16, 0], [32, 0]],
    lane_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]],
    warp_bases=[],
    block_bases=[],
    shape=[64, 8],
)
# The stages, per stage: each thread's 16 K or V words of a tile (WORDS_K, WORDS_V) in 16-byte vectors,
# the warp's vectors side by side, swizzled so that the copies' writes are conflict-free as well as
# the reads: K's bank bit 4 is key bit 3 ^ key bit 1 (offset bit 7 is keys 2 + 8), V's bank bits 3 and
# 4 are word bits 1 and 2 ^ key bits 4 and 5. Each read instruction XORs bits fixed for it.
K_STAGES: gl.constexpr = gl.SharedLinearLayout(
    offset_bases=[[0, 1], [1, 0], [0, 2], [0, 4], [8, 0], [16, 0], [32, 0], [10, 0], [4, 0]],
)
V_STAGES: gl.constexpr = gl.SharedLinearLayout(
    offset_bases=[[8, 0], [1, 0], [0, 1], [0, 2], [0, 4], [2, 0], [4, 0], [16, 2], [32, 4]],
)
META_STAGES: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
META_COPY: gl.constexpr = gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32], warps_per_cta=[1], order=[0])


@gluon.jit
def by_half(values, PACK: gl.constexpr):
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
def as_columns(values):
    """:func:`by_half`'s inverse: ``[rows, PACK, heads]`` as the MMA-shaped ``[rows, 8]``, for free."""
    rows: gl.constexpr = values.shape[0]
    return gl.convert_layout(gl.reshape(values, [rows, 8]), MMA, assert_trivial=True)


@gluon.jit
def key_rows(values, PACK: gl.constexpr):
    """A per-key vector (META or META_PAIRS) as ``[rows, PACK]`` of the scores by half, for free: key
    ``8g + (8 // PACK) h + i`` is row ``8i + g`` of half h."""
    rows: gl.constexpr = 64 // PACK
    values = gl.reshape(gl.permute(gl.reshape(values, [8, PACK, 8 // PACK]), (2, 0, 1)), [rows, PACK])
    if PACK == 2:
        return gl.convert_layout(values, gl.SliceLayout(2, PAIRS), assert_trivial=True)
    else:
        return gl.convert_layout(values, gl.SliceLayout(2, SINGLE), assert_trivial=True)


@gluon.jit
def lane_sum(values):
    """``[rows, halves, heads]`` summed over the rows a lane holds (no shuffles): ``[8 lanes g, halves, heads]``."""
    rows: gl.constexpr = values.shape[0]
    return gl.sum(gl.reshape(values, [rows // 8, 8, values.shape[1], values.shape[2]]), axis=0)


@gluon.jit
def head_total(partial):
    """A lane-partial ``[8 g, halves, heads]`` summed over lanes and halves: a per-head vector."""
    return gl.sum(gl.sum(partial, axis=0), axis=0)


@gluon.jit
def head_halves(columns, PACK: gl.constexpr):
    """A HEAD_COLS vector as ``[PACK, 8 // PACK]`` (half, head), to be reduced over its halves."""
    values = gl.reshape(columns, [PACK, 8 // PACK])
    if PACK == 2:
        return gl.convert_layout(values, gl.SliceLayout(0, PAIRS), assert_trivial=True)
    else:
        return gl.convert_layout(values, gl.SliceLayout(0, SINGLE), assert_trivial=True)


@gluon.jit
def broadcast_heads(per_head, like):
    """A per-head vector broadcast to ``like``'s ``[rows, halves, heads]`` layout, for free."""
    layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, like.type.layout))
    return gl.expand_dims(gl.expand_dims(gl.convert_layout(per_head, layout, assert_trivial=True), 0), 0)
