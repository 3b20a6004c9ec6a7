"""PROTOTYPE (branch ``gluon-tile``, not wired in, not yet run on a GPU): the packed-history span of
decode attention with explicit layouts (Gluon), for INT2 K and V, one (scale, zero) per row, bf16,
head_dim 128, 4 query heads per KV head, 64-key tiles on one warp.

Why (``kernels/NOTES.md``, "Next steps"): the Triton tile lets ``tl.dot`` derive its layouts, which
costs 4 heads padded to 16 MMA rows in the value accumulator, codes that reach the MMA one byte at a
time through shared memory, and ``p`` converted through shared memory. Here every layout is stated:

* scores ``S [16 heads (4 real), 64 keys] = q · K^T``: K's codes are the B operand, heads pad the A
  side as before, but ``P`` then *is* the value MMA's B operand (the accumulator fragment of S holds
  exactly the keys and the head a thread needs), so no conversion;
* values ``out^T [128 dims, 8 heads] = V^T · P^T``: dims are the MMA's rows, heads pad 4 -> 8 only,
  a 32-register accumulator (the Triton tile: 64);
* codes are loaded straight into registers as whole words (8 bytes of a K row, 4 of a V row a
  thread) and the MMA's K index is *relabelled* to match what each thread holds: a reshape/permute
  of register dimensions that ``convert_layout(..., assert_trivial=True)`` proves free. q is gathered
  once into the same order and the output is scattered back by pointer arithmetic; the cache's
  byte layout does not change.
* keys are relabelled too (``N = 8n + 2t + e`` for key ``16t + 2n + e``) so that the per-key scale
  and zero a thread needs are 16 contiguous keys (two 16-byte loads a vector).

``python kernels/decode_history_gluon.py`` compiles it for sm_90 on any machine and prints its
registers and the instructions of its loop (``eval/sass_count.py``'s compile without a GPU).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

D = gl.constexpr(128)
PREFETCH = False  # load tile i+1 during tile i: 253 registers (8 programs an SM) instead of 167 (12)
PROGRAMS_PER_SM = 8 if PREFETCH else 12

MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
# The scores' first 8 rows (heads 0-7; the MMA's rows 8-15 are dropped after it): lane 4g+t holds
# row g and columns 2t + 8n + e.
SCORES: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[], block_bases=[], shape=[8, 64],
)  # fmt: skip
HEAD_ROWS: gl.constexpr = gl.SliceLayout(1, SCORES)  # a [8] vector per score row (query head)
KEY_COLS: gl.constexpr = gl.SliceLayout(0, SCORES)  # a [64] vector per score column (key, relabelled)
# Codes travel as 32-bit words (4 bytes of a row; bytes would be carried one register each).
# K words [64 keys, 8 words]: lane 4g+t holds keys 16(g>>1) + 2n + (g&1) (n = 0..7), words 2t, 2t+1.
WORDS_K: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [2, 0], [4, 0], [8, 0]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [16, 0], [32, 0]], warp_bases=[], block_bases=[], shape=[64, 8],
)  # fmt: skip
# V words [64 keys, 8 words]: lane 4g+t holds keys 16t..16t+15 and word g.
WORDS_V: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0]],
    lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[], block_bases=[], shape=[64, 8],
)  # fmt: skip
# Per-key metadata [64]: lane 4g+t holds keys 16t..16t+15 (all g alike).
META: gl.constexpr = gl.DistributedLinearLayout(
    reg_bases=[[1], [2], [4], [8]], lane_bases=[[16], [32], [0], [0], [0]], warp_bases=[], block_bases=[], shape=[64],
)  # fmt: skip


@gluon.jit
def _bytes_of(b0, b1, b2, b3):
    """Four ``[keys, words]`` tensors of a word's bytes as one ``[keys, bytes]`` (byte ``4w + b``)."""
    codes = gl.join(gl.join(b0, b1), gl.join(b2, b3))  # [keys, words, b & 1, b >> 1]
    return gl.reshape(gl.permute(codes, (0, 1, 3, 2)), [64, 32])


@gluon.jit
def _k_operand(codes):
    """K codes ``[keys, bytes]`` as the scores' B operand ``[dims k, keys N]``, for free.

    Byte ``8t + 2*i2 + i0`` becomes dim ``k = 8*i2 + 2t + i0``; key ``16t' + 2n + e`` becomes ``N = 8n + 2t' + e``.
    """
    codes = gl.reshape(codes, [4, 8, 2, 4, 4, 2])
    codes = gl.permute(codes, (1, 0, 2, 4, 3, 5))
    codes = gl.reshape(codes, [64, 32])
    return gl.convert_layout(gl.permute(codes, (1, 0)), B_OP, assert_trivial=True)


@gluon.jit
def _v_operand(codes):
    """V codes ``[keys, bytes]`` as the value MMA's A operand ``[dims m, keys K]``, for free.

    Byte ``4g + i`` becomes row ``m = 8i + g``; key ``16t + 2s + e`` becomes ``K = 8s + 2t + e``.
    """
    codes = gl.reshape(codes, [4, 8, 2, 8, 4])
    codes = gl.permute(codes, (4, 3, 1, 0, 2))
    codes = gl.reshape(codes, [32, 64])
    return gl.convert_layout(codes, A_OP, assert_trivial=True)


@gluon.jit
def _first_rows(dots):
    """Rows 0-7 of the scores' MMA accumulator ``[16, 64]`` (SCORES), for free."""
    first_eight, _ = gl.split(gl.permute(gl.reshape(dots, [2, 8, 64]), (1, 2, 0)))
    return gl.convert_layout(first_eight, SCORES, assert_trivial=True)


@gluon.jit
def _weights_operand(weights):
    """Score-shaped weights ``[8 heads, 64 N]`` (SCORES) as the value MMA's B operand ``[64 K, 8 heads]``."""
    return gl.convert_layout(gl.permute(weights, (1, 0)), B_OP, assert_trivial=True)


@gluon.jit
def _key_vector(values):
    """A per-key vector (META, natural key order) in the scores' column order N."""
    values = gl.permute(gl.reshape(values, [4, 8, 2]), (1, 0, 2))
    return gl.convert_layout(gl.reshape(values, [64]), KEY_COLS, assert_trivial=True)


def word_unpack_asm(pair: bool) -> str:
    """PTX: 2-bit codes of 32-bit words as bf16 ``128 + f_j * code`` (``f_j = 4**j`` for blocks j < 3,
    1 for j = 3: the factors of ``decode_attention._unpack_asm``), output ``4j + b`` holding block j
    of byte b.

    One word (K, ``pair=False``): each output is one 16-bit value. Two words of two keys (V,
    ``pair=True``): each output is a 32-bit register with the two keys' codes of that byte, the pair
    the value MMA's A operand wants.
    """
    lines = [".reg .b32 t, u, x;"]
    # t: per 16-bit half, the byte(s) whose codes this step unpacks in its low byte
    steps = [(b, f"prmt.b32 t, $16, $17, {b | b << 4 | (4 + b) << 8 | (4 + b) << 12:#x};") for b in range(4)] if pair else [
        (b, f"prmt.b32 t, $16, 0, {b | b << 4 | (b + 1) << 8 | (b + 1) << 12:#x};") for b in (0, 2)]  # fmt: skip
    for b, gather in steps:
        lines.append(gather)
        for j in range(4):
            source, mask = ("t", 0x00030003 << (2 * j)) if j < 3 else ("u", 0x00030003)
            if j == 3:
                lines.append("shr.b32 u, t, 6;")
            if pair:  # key a's code in the low half, key b's in the high half
                lines.append(f"lop3.b32 ${4 * j + b}, {source}, {mask:#x}, 0x43004300, 0xEA;")
            else:  # bytes b and b+1, one 16-bit output each
                lines.append(f"lop3.b32 x, {source}, {mask:#x}, 0x43004300, 0xEA;")
                lines.append(f"mov.b32 {{${4 * j + b}, ${4 * j + b + 1}}}, x;")
    return "{ " + " ".join(lines) + " }"


@gluon.jit
def _unpack_words(words, UNPACK: gl.constexpr, PAIR: gl.constexpr):
    """Per column block j the ``[keys, bytes]`` codes of ``[keys, words]`` (see :func:`word_unpack_asm`)."""
    if PAIR:
        o = gl.inline_asm_elementwise(UNPACK, "=r," * 16 + "r,r", [words], dtype=(gl.bfloat16,) * 16,
                                      is_pure=True, pack=2)  # fmt: skip
    else:
        o = gl.inline_asm_elementwise(UNPACK, "=h," * 16 + "r", [words], dtype=(gl.bfloat16,) * 16,
                                      is_pure=True, pack=1)  # fmt: skip
    return (_bytes_of(o[0], o[1], o[2], o[3]), _bytes_of(o[4], o[5], o[6], o[7]),
            _bytes_of(o[8], o[9], o[10], o[11]), _bytes_of(o[12], o[13], o[14], o[15]))  # fmt: skip


@gluon.jit
def _load_tile(KC, VC, KS, KZ, VS, VZ, block, end):
    """One tile's K and V code words and its four metadata vectors (rows from ``end`` on read as 0).
    Rows are contiguous (8 words, one scale or zero): constant strides let loads be 8 and 16 bytes wide."""
    k_rows = block + gl.arange(0, 64, layout=gl.SliceLayout(1, WORDS_K))
    k_words = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS_K))
    raw_k = gl.load(KC + k_rows[:, None] * 8 + k_words[None, :], mask=(k_rows < end)[:, None], other=0)
    v_rows = block + gl.arange(0, 64, layout=gl.SliceLayout(1, WORDS_V))
    v_words = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS_V))
    raw_v = gl.load(VC + v_rows[:, None] * 8 + v_words[None, :], mask=(v_rows < end)[:, None], other=0)
    rows = block + gl.arange(0, 64, layout=META)
    ok = rows < end
    k_scale = gl.load(KS + rows, mask=ok, other=0.0)
    k_zero = gl.load(KZ + rows, mask=ok, other=0.0)
    v_scale = gl.load(VS + rows, mask=ok, other=0.0)
    v_zero = gl.load(VZ + rows, mask=ok, other=0.0)
    return raw_k, raw_v, k_scale, k_zero, v_scale, v_zero


@gluon.jit
def _q_block(Q, J: gl.constexpr, GROUP: gl.constexpr):
    """q's dims ``32J + byte(k)`` as the scores' A operand ``[16 heads, 32 k]`` (heads >= GROUP are 0)."""
    heads = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))
    k = gl.arange(0, 32, layout=gl.SliceLayout(0, A_OP))
    byte = 8 * ((k // 2) % 4) + 2 * (k // 8) + k % 2
    return gl.load(Q + heads[:, None] * D + (32 * J + byte)[None, :], mask=(heads < GROUP)[:, None], other=0.0)


@gluon.jit
def _head_vector(Q, GROUP: gl.constexpr):
    """Per head (HEAD_ROWS, 0 from ``GROUP`` on): the float32 sum of q's 32 dims from ``Q`` on."""
    heads = gl.arange(0, 8, layout=HEAD_ROWS)
    total = gl.full([8], 0.0, gl.float32, HEAD_ROWS)
    for d in range(32):
        total += gl.load(Q + heads * D + d, mask=heads < GROUP, other=0.0).to(gl.float32)
    return total


@gluon.jit
def history_kernel(
    Q, q_b, KW, kw_b, kw_h, VW, vw_b, vw_h, KS, KZ, VS, VZ, meta_b, meta_h,
    n_hist, chunk, PM, PL, PACC, n_slots, score_scale, LENGTHS,
    GROUP: gl.constexpr, UNPACK: gl.constexpr, V_UNPACK: gl.constexpr, OFFSET: gl.constexpr,
    PREFETCH: gl.constexpr, RING: gl.constexpr,
):  # fmt: skip
    """Program ``(b, kv head, split)``: history rows ``[split*chunk, (split+1)*chunk)`` of one KV head for
    its ``GROUP`` query heads, into partial slot ``split`` (``PM``/``PL`` ``[B, Hq, n_slots]``, ``PACC``
    ``[B, Hq, n_slots, D]``, as the Triton stage 1 writes its history slots). Codes come as 32-bit words
    ``[B, Hkv, L, 8]``; scale/zero ``[B, Hkv, L]`` (one group). ``PREFETCH``: load tile i+1 while tile i
    computes (more registers, fewer programs an SM). ``RING`` (static decoding): the valid history rows
    are ``LENGTHS[0]`` (device memory), split in ``num_programs(2)`` chunks as the Triton stage 1 does."""
    b = gl.program_id(0).to(gl.int64)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    if RING:
        n_hist = gl.load(LENGTHS).to(gl.int32)
        chunk = gl.cdiv(gl.cdiv(n_hist, gl.num_programs(2)), 64) * 64
    start = split * chunk
    end = gl.minimum(start + chunk, n_hist)
    head0 = b * (gl.num_programs(1) * GROUP) + kv_head * GROUP
    _history_span(
        Q + b * q_b + kv_head * GROUP * D, KW + b * kw_b + kv_head * kw_h, VW + b * vw_b + kv_head * vw_h,
        KS + b * meta_b + kv_head * meta_h, KZ + b * meta_b + kv_head * meta_h,
        VS + b * meta_b + kv_head * meta_h, VZ + b * meta_b + kv_head * meta_h, start, end,
        PM + head0 * n_slots + split, PL + head0 * n_slots + split, PACC + (head0 * n_slots + split) * D, n_slots,
        score_scale, GROUP, UNPACK, V_UNPACK, OFFSET, PREFETCH,
    )  # fmt: skip


@gluon.jit
def _history_span(
    Q, KC, VC, KS, KZ, VS, VZ, start, end, PM, PL, PACC, head_stride, score_scale,
    GROUP: gl.constexpr, UNPACK: gl.constexpr, V_UNPACK: gl.constexpr, OFFSET: gl.constexpr,
    PREFETCH: gl.constexpr,
):  # fmt: skip
    """Rows ``[start, end)`` of one KV head's packed history for its ``GROUP`` query heads: running max,
    sum and unnormalised accumulator (float32). Codes enter the MMAs as ``OFFSET + 4**j * c`` for
    blocks j = 0..2 and ``OFFSET + c`` for j = 3; q is divided by the same factors."""
    q0 = (_q_block(Q, 0, GROUP).to(gl.float32)).to(gl.bfloat16)
    q1 = (_q_block(Q, 1, GROUP).to(gl.float32) * 0.25).to(gl.bfloat16)
    q2 = (_q_block(Q, 2, GROUP).to(gl.float32) * 0.0625).to(gl.bfloat16)
    q3 = _q_block(Q, 3, GROUP)
    # Per head: sum(q) and what the codes' offset adds to the dots (rows of the scores).
    s0, s1 = _head_vector(Q, GROUP), _head_vector(Q + 32, GROUP)
    s2, s3 = _head_vector(Q + 64, GROUP), _head_vector(Q + 96, GROUP)
    q_sum = s0 + s1 + s2 + s3
    bias = OFFSET * (s0 + 0.25 * s1 + 0.0625 * s2 + s3)
    m_i = gl.full([8], float("-inf"), gl.float32, HEAD_ROWS)
    l_i = gl.full([8], 0.0, gl.float32, HEAD_ROWS)
    w_sum = gl.full([8], 0.0, gl.float32, HEAD_ROWS)  # per head: sum(w), sum(w * zero)
    wz_sum = w_sum
    acc0 = gl.full([32, 8], 0.0, gl.float32, MMA)
    acc1, acc2, acc3 = acc0, acc0, acc0
    tile = _load_tile(KC, VC, KS, KZ, VS, VZ, start, end)
    for block in range(start, end, 64):
        if PREFETCH:
            raw_k, raw_v, k_scale, k_zero, v_scale, v_zero = tile
            tile = _load_tile(KC, VC, KS, KZ, VS, VZ, block + 64, end)
        else:
            raw_k, raw_v, k_scale, k_zero, v_scale, v_zero = _load_tile(KC, VC, KS, KZ, VS, VZ, block, end)
        c0, c1, c2, c3 = _unpack_words(raw_k, UNPACK, False)
        dots = gl.full([16, 64], 0.0, gl.float32, MMA)
        dots = mma_v2(q0, _k_operand(c0), dots)
        dots = mma_v2(q1, _k_operand(c1), dots)
        dots = mma_v2(q2, _k_operand(c2), dots)
        dots = mma_v2(q3, _k_operand(c3), dots)
        scale = _key_vector(k_scale.to(gl.float32)) * score_scale
        zero = _key_vector(k_zero.to(gl.float32))
        scores = scale[None, :] * (_first_rows(dots) - bias[:, None] - zero[None, :] * q_sum[:, None])
        keys = block + gl.arange(0, 64, layout=META)
        scores = gl.where(_key_vector(keys < end)[None, :], scores, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        weights = (p * _key_vector(v_scale.to(gl.float32))[None, :]).to(gl.bfloat16)
        w = weights.to(gl.float32)
        w_sum = w_sum * alpha + gl.sum(w, axis=1)
        wz_sum = wz_sum * alpha + gl.sum(w * _key_vector(v_zero.to(gl.float32))[None, :], axis=1)
        w_op = _weights_operand(weights)
        # The accumulators' columns are heads: alpha moves from the score rows to them (8 values).
        alpha_cols = _head_columns(alpha)
        v0, v1, v2, v3 = _unpack_words(raw_v, V_UNPACK, True)
        acc0 = mma_v2(_v_operand(v0), w_op, acc0 * alpha_cols[None, :])
        acc1 = mma_v2(_v_operand(v1), w_op, acc1 * alpha_cols[None, :])
        acc2 = mma_v2(_v_operand(v2), w_op, acc2 * alpha_cols[None, :])
        acc3 = mma_v2(_v_operand(v3), w_op, acc3 * alpha_cols[None, :])
    _store_partials(PM, PL, PACC, head_stride, m_i, l_i, w_sum, wz_sum, acc0, acc1, acc2, acc3, GROUP, OFFSET)


@gluon.jit
def _store_partials(PM, PL, PACC, head_stride, m_i, l_i, w_sum, wz_sum, acc0, acc1, acc2, acc3,
                    GROUP: gl.constexpr, OFFSET: gl.constexpr):  # fmt: skip
    """m, l and ``acc[h, dim] = acc_j[m, h] / f_j - sum(w * zero) - OFFSET / f_j * sum(w)`` (``f_j`` the
    block's code factor; dim ``32j + 4*(m % 8) + m // 8``)."""
    heads = gl.arange(0, 8, layout=HEAD_ROWS)
    gl.store(PM + heads * head_stride, m_i, mask=heads < GROUP)
    gl.store(PL + heads * head_stride, l_i, mask=heads < GROUP)
    w_sum, wz_sum = _head_columns(w_sum)[None, :], _head_columns(wz_sum)[None, :]
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    out = PACC + cols[None, :] * (head_stride * D) + (4 * (rows % 8) + rows // 8)[:, None]
    ok = (cols < GROUP)[None, :]
    gl.store(out, acc0 - wz_sum - OFFSET * w_sum, mask=ok)
    gl.store(out + 32, acc1 * 0.25 - wz_sum - (OFFSET * 0.25) * w_sum, mask=ok)
    gl.store(out + 64, acc2 * 0.0625 - wz_sum - (OFFSET * 0.0625) * w_sum, mask=ok)
    gl.store(out + 96, acc3 - wz_sum - OFFSET * w_sum, mask=ok)


@gluon.jit
def _head_columns(per_row):
    """A per-head vector of the score rows (HEAD_ROWS) as the value accumulators' columns."""
    return gl.convert_layout(per_row, gl.SliceLayout(0, MMA))


def history_into(
    q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, v_codes: torch.Tensor,
    v_scale: torch.Tensor, v_zero: torch.Tensor, sm_scale: float, partial_m: torch.Tensor, partial_l: torch.Tensor,
    partial_acc: torch.Tensor, splits: int, chunk: int, lengths: torch.Tensor | None = None,
    prefetch: bool = PREFETCH,
) -> None:
    """Write the packed history's partial results into slots ``[0, splits)`` of the decode kernel's
    buffers (``partial_m``/``partial_l`` ``[B, Hq, n_slots]``, ``partial_acc`` ``[B, Hq, n_slots, D]``;
    m and l in base-2 units): ``chunk`` rows a split, or with ``lengths`` (static decoding) the first
    ``lengths[0]`` rows split on the device."""
    from oscar_hf.kernels.decode_attention import _CODE_MAGIC, _LOG2E

    batch, q_heads, head_dim = q.shape
    kv_heads = k_codes.shape[1]
    group = q_heads // kv_heads
    if (head_dim, k_codes.shape[-1], v_codes.shape[-1], k_scale.shape[-1], q.dtype) != (128, 32, 32, 1, torch.bfloat16):
        raise ValueError("the prototype covers INT2 K and V, head_dim 128, one group, bf16 only")
    if group > 8:
        raise ValueError(f"the prototype covers at most 8 query heads per KV head, got {group}")
    q = q.contiguous()
    words_k, words_v = (codes.contiguous().view(torch.int32) for codes in (k_codes, v_codes))
    meta = [t.contiguous() for t in (k_scale, k_zero, v_scale, v_zero)]
    history_kernel[(batch, kv_heads, splits)](
        q, q.stride(0), words_k, *words_k.stride()[:2], words_v, *words_v.stride()[:2], *meta,
        *meta[0].stride()[:2], k_codes.shape[2], chunk, partial_m, partial_l, partial_acc, partial_m.shape[-1],
        sm_scale * _LOG2E, q if lengths is None else lengths,  # unread without RING
        GROUP=group, UNPACK=word_unpack_asm(False), V_UNPACK=word_unpack_asm(True), OFFSET=_CODE_MAGIC[q.dtype][1],
        PREFETCH=prefetch, RING=lengths is not None, num_warps=1,
    )  # fmt: skip


def history_partials(
    q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, v_codes: torch.Tensor,
    v_scale: torch.Tensor, v_zero: torch.Tensor, sm_scale: float, splits: int, prefetch: bool = PREFETCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The span over the whole packed history in ``splits`` chunks: ``(m, l, acc)`` per (batch, query
    head, split), as :func:`merge_partials` (or the decode kernel's stage 2) merges them."""
    batch, q_heads, head_dim = q.shape
    n_hist = k_codes.shape[2]
    chunk = -(-(-(-n_hist // splits)) // 64) * 64
    splits = -(-n_hist // chunk)
    m = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=q.device)
    l, acc = torch.empty_like(m), torch.empty(batch, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    history_into(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, sm_scale, m, l, acc, splits, chunk,
                 prefetch=prefetch)  # fmt: skip
    return m, l, acc


def merge_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Attention output ``[B, Hq, D]`` from partial slots (base-2 log-sum-exp), as stage 2 merges them."""
    weight = torch.exp2(m - m.amax(dim=-1, keepdim=True)).nan_to_num(0.0)
    return (weight[..., None] * acc).sum(-2) / (weight * l).sum(-1, keepdim=True)


def compile_for_sm90() -> None:
    """Compile the kernel for an H100/H200 without a GPU and print registers and loop instructions."""
    import os
    import sys
    from pathlib import Path

    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
    import sass_count
    from triton.runtime import driver

    from oscar_hf.kernels.decode_attention import _CODE_MAGIC

    driver.set_active(sass_count._Sm90Driver())
    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    history, words, meta = 100_000, (8 * 100_000 * 8, 100_000 * 8), (8 * 100_000, 100_000)
    for prefetch in (False, True):
        compiled = history_kernel.warmup(
            bf16, 32 * 128, i32, *words, i32, *words, bf16, bf16, bf16, bf16, *meta, history, 768,
            f32, f32, f32, 137, 0.1275, bf16, GROUP=4, UNPACK=word_unpack_asm(False), V_UNPACK=word_unpack_asm(True),
            OFFSET=_CODE_MAGIC[bf16][1], PREFETCH=prefetch, RING=False, grid=(1,), num_warps=1,
        )  # fmt: skip
        ops = sass_count.history_loop(sass_count.sass_of(compiled))
        print(f"prefetch={prefetch}: {_resource_usage(compiled)}; {sum(ops.values())} instructions per 64-key tile")
        print("  " + ", ".join(f"{op} {count}" for op, count in ops.most_common(16)))


def _resource_usage(compiled) -> str:
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    return " ".join(re.findall(r"REG:\d+|STACK:\d+|LOCAL:\d+", usage))


if __name__ == "__main__":
    compile_for_sm90()
