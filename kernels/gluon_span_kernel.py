"""The packed-history span of decode attention with explicit layouts (Gluon): the kernel body.

For 2-, 3- or 4-bit K and 2- or 1-bit V, one (scale, zero) per row, bf16, head_dim 128, up to 8 query
heads per KV head, 64-key tiles on one warp. :mod:`.decode_history_gluon` stages the inputs and launches it; it writes
the same partial slots as the Triton stage 1 (:mod:`.decode_stages`), whose merge follows.

Why (``kernels/DESIGN.md``): the Triton tile lets ``tl.dot`` derive its layouts, which
costs 4 heads padded to 16 MMA rows, codes that reach the MMA one byte at a time through shared
memory, and ``p`` converted through shared memory. Here every layout is stated, and keys are the
MMA's rows, so heads pad nothing (they are the MMA's 8 columns; with at most 4 query heads a KV
head, each tile's two halves of 32 keys share them, see ``gluon_span_layouts.PAIRS``):

* scores ``S^T [64 keys, 8 heads] = K · q^T``: K's codes are the A operand (int8), q the B operand
  (two int8 halves of its fixed point: 32 tensor-core instructions a tile);
* values ``out^T [128 dims, 8 heads] = V^T · P^T``: dims are the MMA's rows; ``P^T``, the scores'
  accumulator in bf16, becomes the B operand through one ``movmatrix`` (an 8x8 transpose within the
  warp's registers) per 8 keys, not shared memory;
* codes are loaded straight into registers as whole words (8 bytes of a K row, 4 of a V row a
  thread) and the MMAs' K index, the keys and the dims are *relabelled* to match what each thread
  holds: reshapes/permutes of register dimensions that ``convert_layout(..., assert_trivial=True)``
  proves free (:mod:`.gluon_span_layouts`). q is gathered once into the same order and the output is
  scattered back by pointer arithmetic; the cache's byte layout does not change. 3- and 4-bit keys and
  1-bit values are read into the 2-bit words' order as they load (:mod:`.gluon_span_tiles`),
  so all that follows is the same;
* per-head sums over keys (l, and the two value corrections) stay per lane inside the loop and are
  reduced across lanes once at the end; only the running max crosses lanes each tile;
* unpacking is nearly all of the integer (ALU) pipe's work, so K's codes become int8 operands by
  masks alone (4 codes an instruction) and the bf16 conversions are single asm instructions
  (:mod:`.gluon_span_operands`). What bounds the tile is dependency latency within each one-warp
  program and the L1's data pipe, which shared-memory reads, shuffles and the staged copies share
  (``kernels/DESIGN.md``, "What bounds the decode call").

``python kernels/tools/sass_count.py --span`` compiles it for sm_90 on any machine and prints its
registers, the instructions of its loop and those before it.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .gluon_span_layouts import (
    HEAD_COLS,
    META,
    META_PAIRS,
    MMA,
    D,
    as_columns,
    broadcast_heads,
    by_half,
    head_halves,
    head_total,
    key_rows,
    lane_sum,
)
from .gluon_span_operands import (
    OFFSET,
    half_columns,
    k_operands,
    narrow,
    q_int8,
    unpack_k,
    unpack_v,
    v_operands,
    weights_operand,
    widen,
)
from .gluon_span_tiles import copy_tile, load_tile, stage_buffers, staged_tile

# Triton 3.6 names this thread_barrier; later versions barrier.
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _launch_dependents():
    """Let the next kernel in the stream, if launched programmatically, start now."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


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
    return gl.inline_asm_elementwise(
        "mov.u64 $0, %clock64; // $1", "=l,f", [after], dtype=gl.int64, is_pure=False, pack=1
    )


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
    Q,
    q_b,
    KW,
    kw_b,
    kw_h,
    VW,
    vw_b,
    vw_h,
    KS,
    KZ,
    VS,
    VZ,
    meta_b,
    meta_h,
    n_hist,
    chunk,
    PM,
    PL,
    PACC,
    n_slots,
    score_scale,
    LENGTHS,
    TIMES,
    GROUP: gl.constexpr,
    V_UNPACK: gl.constexpr,
    RING: gl.constexpr,
    PIPELINE: gl.constexpr,
    LAUNCH_DEPENDENTS: gl.constexpr,
    EARLY: gl.constexpr,
    PACK: gl.constexpr,
    TIMED: gl.constexpr,
    K_BITS: gl.constexpr,
    V_BITS: gl.constexpr,
    K_ROW: gl.constexpr,
    V_ROW: gl.constexpr,
):
    """Program ``(b, kv head, split)``: history rows ``[split*chunk, (split+1)*chunk)`` of one KV head for
    its ``GROUP`` query heads, into partial slot ``split`` (``PM``/``PL`` ``[B, Hq, n_slots]``, ``PACC``
    ``[B, Hq, n_slots, D]``, as the Triton stage 1 writes its history slots). Codes come as 32-bit words
    ``[B, Hkv, L, 4 * bits]`` (``K_BITS`` 2, 3 or 4, ``V_BITS`` 2 or 1), K's rows ``K_ROW`` words apart and V's
    ``V_ROW`` (more than a row's words where rows of K and V alternate in one buffer); scale/zero
    ``[B, Hkv, L]`` (one group). ``PIPELINE`` needs 2-bit K and V. ``RING`` (static decoding): the valid
    history rows are ``LENGTHS[0]`` (device memory), split in ``num_programs(2)`` chunks as the Triton
    stage 1 does.
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
        Q + b * q_b + kv_head * GROUP * D,
        KW + b * kw_b + kv_head * kw_h,
        VW + b * vw_b + kv_head * vw_h,
        KS + b * meta_b + kv_head * meta_h,
        KZ + b * meta_b + kv_head * meta_h,
        VS + b * meta_b + kv_head * meta_h,
        VZ + b * meta_b + kv_head * meta_h,
        start,
        end,
        PM + head0 * n_slots + split,
        PL + head0 * n_slots + split,
        PACC + (head0 * n_slots + split) * D,
        n_slots,
        score_scale,
        TIMES,
        GROUP,
        V_UNPACK,
        PIPELINE,
        LAUNCH_DEPENDENTS,
        EARLY,
        PACK,
        TIMED,
        K_BITS,
        V_BITS,
        K_ROW,
        V_ROW,
    )
    if TIMED:
        gl.store(TIMES + 7, _special(CLOCK))
        gl.store(TIMES + 2, _special(GLOBAL_TIME))


@gluon.jit
def _history_span(
    Q,
    KC,
    VC,
    KS,
    KZ,
    VS,
    VZ,
    start,
    end,
    PM,
    PL,
    PACC,
    head_stride,
    score_scale,
    TIMES,
    GROUP: gl.constexpr,
    V_UNPACK: gl.constexpr,
    PIPELINE: gl.constexpr,
    LAUNCH_DEPENDENTS: gl.constexpr,
    EARLY: gl.constexpr,
    PACK: gl.constexpr,
    TIMED: gl.constexpr,
    K_BITS: gl.constexpr,
    V_BITS: gl.constexpr,
    K_ROW: gl.constexpr,
    V_ROW: gl.constexpr,
):
    """Rows ``[start, end)`` of one KV head's packed history for its ``GROUP`` query heads: running max,
    sum and unnormalised accumulator (float32). K's codes enter int8 MMAs as ``f_j * c`` against q's
    fixed point (:func:`.gluon_span_operands.q_int8`), V's bf16 MMAs as ``OFFSET + f_j * c`` (see
    :func:`.gluon_span_operands.value_unpack_asm`). Whole tiles run without masks; a
    last partial tile runs masked.
    ``PIPELINE``: each whole tile is copied into shared memory (``cp.async``) while the one before
    computes, so that its loads' latency is hidden without registers to hold them (a register prefetch
    needs more than the cap leaves). ``EARLY``: see :func:`history_kernel`."""
    whole_end = start + (end - start) // 64 * 64
    if PIPELINE:  # the first tile's copy starts before q is gathered, so that the two latencies overlap
        buffers = stage_buffers(KS)
        if start < whole_end:
            copy_tile(buffers, 0, KC, VC, KS, KZ, VS, VZ, start, K_ROW, V_ROW)
        async_copy.commit_group()
    if EARLY:  # the copy above overlaps the kernel before; what follows may read what it wrote
        _wait_for_inputs()
        if LAUNCH_DEPENDENTS:
            _launch_dependents()
    if TIMED:
        gl.store(TIMES + 4, _special(CLOCK))
    q = q_int8(Q, GROUP, PACK, K_BITS)
    if TIMED:
        gl.store(TIMES + 5, _clock(gl.max(q[3], axis=0)))
    # per lane, half and head: sum(p), sum(w), sum(w * zero) over the lane's keys (reduced at the end)
    lane_sums = lane_sum(by_half(gl.full([64 // PACK, 8], 0.0, gl.float32, MMA), PACK))
    acc = gl.full([32, 8], 0.0, gl.float32, MMA)
    m_i = gl.max(head_halves(gl.full([8], float("-inf"), gl.float32, HEAD_COLS), PACK), axis=0)
    state = (m_i, lane_sums, lane_sums, lane_sums, acc, acc, acc, acc)
    if PIPELINE:  # tile i + 1 is copied into shared memory while tile i computes
        for block in range(start, whole_end, 64):
            stage = (block - start) // 64 % 2
            if block + 64 < whole_end:
                copy_tile(buffers, 1 - stage, KC, VC, KS, KZ, VS, VZ, block + 64, K_ROW, V_ROW)
            async_copy.commit_group()  # empty past the last whole tile: the wait below stays one group behind
            async_copy.wait_group(1)
            _barrier()  # the metadata were copied by other lanes than those that read them
            state = _tile_step(
                state, staged_tile(buffers, stage, PACK), q, score_scale, block, end, V_UNPACK, False, PACK, K_BITS
            )
    else:
        for block in range(start, whole_end, 64):
            tile = load_tile(KC, VC, KS, KZ, VS, VZ, block, end, K_ROW, V_ROW, K_BITS, V_BITS, False, PACK)
            state = _tile_step(state, tile, q, score_scale, block, end, V_UNPACK, False, PACK, K_BITS)
    if whole_end < end:
        tile = load_tile(KC, VC, KS, KZ, VS, VZ, whole_end, end, K_ROW, V_ROW, K_BITS, V_BITS, True, PACK)
        state = _tile_step(state, tile, q, score_scale, whole_end, end, V_UNPACK, True, PACK, K_BITS)
    m_i, l_part, w_part, wz_part, acc0, acc1, acc2, acc3 = state
    if TIMED:
        gl.store(TIMES + 6, _clock(gl.max(m_i, axis=0)))
    _store_partials(
        PM,
        PL,
        PACC,
        head_stride,
        m_i,
        head_total(l_part),
        head_total(w_part),
        head_total(wz_part),
        acc0,
        acc1,
        acc2,
        acc3,
        GROUP,
        PACK,
        V_BITS,
    )


@gluon.jit
def _fixed_point_dots(raw_k, k_zero, q, PACK: gl.constexpr, K_BITS: gl.constexpr):
    """``[rows m, PACK, heads]`` of ``q . (c - zero)`` in q's fixed-point units (float32): per column
    block two int8 MMAs a half (q's high and low halves, exact int32 sums), joined as ``256 hi + lo``."""
    q_hi, q_lo, neg_q_sum, unit = q
    c0, c1, c2, c3 = unpack_k(raw_k, K_BITS)
    hi = gl.full([64 // PACK, 8], 0, gl.int32, MMA)
    hi, lo = _block_dots(c0, q_hi[0], q_lo[0], hi, hi, PACK)
    hi, lo = _block_dots(c1, q_hi[1], q_lo[1], hi, lo, PACK)
    hi, lo = _block_dots(c2, q_hi[2], q_lo[2], hi, lo, PACK)
    hi, lo = _block_dots(c3, q_hi[3], q_lo[3], hi, lo, PACK)
    dots = by_half((hi * 256 + lo).to(gl.float32), PACK)
    return dots + key_rows(k_zero, PACK)[:, :, None] * broadcast_heads(neg_q_sum, dots)


@gluon.jit
def _block_dots(codes, q_hi, q_lo, hi, lo, PACK: gl.constexpr):
    """One column block's MMAs into ``hi`` and ``lo``: each half's keys against its q operand."""
    a = k_operands(codes, PACK)
    hi, lo = mma_v2(a[0], q_hi[0], hi), mma_v2(a[0], q_lo[0], lo)
    if PACK == 2:
        hi, lo = mma_v2(a[1], q_hi[1], hi), mma_v2(a[1], q_lo[1], lo)
    return hi, lo


@gluon.jit
def _tile_step(
    state,
    tile,
    q,
    score_scale,
    block,
    end,
    V_UNPACK: gl.constexpr,
    MASKED: gl.constexpr,
    PACK: gl.constexpr,
    K_BITS: gl.constexpr,
):
    """The online softmax over one 64-key tile, as ``[64 // PACK rows, PACK halves, heads]``: ``state``
    (m, three lane-partial sums, four accumulators) updated. ``MASKED``: keys from ``end`` on score -inf."""
    m_i, l_part, w_part, wz_part, acc0, acc1, acc2, acc3 = state
    raw_k, raw_v, meta = tile
    k_scale, k_zero, v_scale, v_zero = widen(meta[0]), widen(meta[1]), widen(meta[2]), widen(meta[3])
    unit = q[3]
    # scores in q's fixed-point units; the unit (a head's factor > 0) enters the max and the exponent
    scores = _fixed_point_dots(raw_k, k_zero, q, PACK, K_BITS) * (key_rows(k_scale, PACK) * score_scale)[:, :, None]
    if MASKED:
        keys = block + gl.arange(0, 64, layout=META_PAIRS if PACK == 2 else META)
        scores = gl.where(key_rows(keys < end, PACK)[:, :, None], scores, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(gl.max(scores, axis=0), axis=0) * unit)
    m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_new)
    m_i = m_new
    lanes = broadcast_heads(alpha, l_part)
    l_part, w_part, wz_part = l_part * lanes, w_part * lanes, wz_part * lanes
    p = gl.exp2(scores * broadcast_heads(unit, scores) - broadcast_heads(m_i, scores))
    weights = narrow(p * key_rows(v_scale, PACK)[:, :, None])
    w = widen(weights)
    l_part = l_part + lane_sum(p)
    w_part = w_part + lane_sum(w)
    wz_part = wz_part + lane_sum(w * key_rows(v_zero, PACK)[:, :, None])
    w_op = weights_operand(as_columns(weights))
    v0, v1, v2, v3 = unpack_v(raw_v, V_UNPACK)
    if PACK == 2:
        first, second = half_columns(w_op, 0), half_columns(w_op, 1)
        acc0 = _value_mmas(v_operands(v0, PACK), first, second, _rescaled(acc0, alpha, PACK))
        acc1 = _value_mmas(v_operands(v1, PACK), first, second, _rescaled(acc1, alpha, PACK))
        acc2 = _value_mmas(v_operands(v2, PACK), first, second, _rescaled(acc2, alpha, PACK))
        acc3 = _value_mmas(v_operands(v3, PACK), first, second, _rescaled(acc3, alpha, PACK))
    else:
        acc0 = mma_v2(v_operands(v0, PACK)[0], w_op, _rescaled(acc0, alpha, PACK))
        acc1 = mma_v2(v_operands(v1, PACK)[0], w_op, _rescaled(acc1, alpha, PACK))
        acc2 = mma_v2(v_operands(v2, PACK)[0], w_op, _rescaled(acc2, alpha, PACK))
        acc3 = mma_v2(v_operands(v3, PACK)[0], w_op, _rescaled(acc3, alpha, PACK))
    return m_i, l_part, w_part, wz_part, acc0, acc1, acc2, acc3


@gluon.jit
def _value_mmas(codes, first, second, acc):
    """Both halves' value MMAs: each half's codes against its weights, zero in the other's columns."""
    return mma_v2(codes[1], second, mma_v2(codes[0], first, acc))


@gluon.jit
def _rescaled(acc, alpha, PACK: gl.constexpr):
    """An accumulator ``[32 dims, 8 columns]`` times each column's head's ``alpha``."""
    acc = by_half(acc, PACK)
    return as_columns(acc * broadcast_heads(alpha, acc))


@gluon.jit
def _store_partials(
    PM,
    PL,
    PACC,
    head_stride,
    m_i,
    l_i,
    w_sum,
    wz_sum,
    acc0,
    acc1,
    acc2,
    acc3,
    GROUP: gl.constexpr,
    PACK: gl.constexpr,
    V_BITS: gl.constexpr,
):
    """m, l and ``acc[h, dim] = acc_j[m, h] / f_j - sum(w * zero) - OFFSET / f_j * sum(w)`` (``f_j`` the
    block's code factor, ``value_factors(V_BITS)``; dim ``32j + 4*(m % 8) + m // 8``; ``acc_j`` summed
    over its halves)."""
    acc0, acc1, acc2, acc3 = (
        _over_halves(acc0, PACK),
        _over_halves(acc1, PACK),
        _over_halves(acc2, PACK),
        _over_halves(acc3, PACK),
    )
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
    LAST: gl.constexpr = 1.0 if V_BITS == 2 else 0.015625  # 1 / f_3
    gl.store(out + 96, acc3 * LAST - wz_sum - (OFFSET * LAST) * w_sum, mask=ok)


@gluon.jit
def _over_halves(acc, PACK: gl.constexpr):
    """An accumulator ``[32 dims, 8 columns]`` as ``[32 dims, heads]``, its halves summed."""
    return gl.sum(by_half(acc, PACK), axis=1)
