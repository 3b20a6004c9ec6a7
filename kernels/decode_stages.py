"""The Triton kernels of split-K decode attention (:mod:`.decode_attention`): stage 1 and the merge.

Stage 1 (one launch for all tiers): program ``(b, kv head [x head block], slot)`` handles one split
of one tier for all ``Hq/Hkv`` query heads of its KV head, so every KV tile is read once per group.
History tiles are loaded as contiguous packed bytes and never dequantized: with one (scale, zero) per
row and group, dequantization is affine, so ``q·k = scale * (q·c - zero * sum(q))`` moves it from the
``N x D`` key tile to the ``H x N`` scores, and ``sum_n p_n (c_n - zero_n) scale_n`` becomes a dot of
the weights ``p * scale`` with the codes minus one correction per head. How codes enter the dots
(exact 16-bit floats, as column blocks) is :mod:`.decode_unpack`'s; a tile's work, :mod:`.decode_tiles`'.
Each slot stores its running max ``m``, sum ``l`` and unnormalised accumulator ``acc`` (float32).
Stage 2 merges the slots with exact log-sum-exp weights: one softmax over the union of the tiers.

:mod:`.decode_launch` plans and launches both; the kernels' names are what the profiling tools
(``kernels/tools/``, ``eval/gpu_session.sh``) match.
"""

from __future__ import annotations

from ._triton import tl, to_dtype, triton
from .decode_tiles import dense_span, load_parts, packed_span, store_new_rows


@triton.jit
def _decode_stage1_kernel(
    Q,
    q_st,
    SK,
    sk_st,
    SV,
    sv_st,
    n_sink,
    chunk_sink,
    RK,
    rk_st,
    RV,
    rv_st,
    n_recent,
    chunk_recent,
    NK,
    nk_st,
    NV,
    nv_st,
    n_new,
    chunk_new,
    KC,
    kc_st,
    KS,
    ks_st,
    KZ,
    kz_st,
    VC,
    vc_st,
    VS,
    vs_st,
    VZ,
    vz_st,
    n_hist,
    chunk_hist,
    MASK,
    mask_stride_b,
    PM,
    PL,
    PACC,
    score_scale,
    hist_splits,
    dense_splits,
    n_slots,
    first_slot,
    LENGTHS,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DENSE_BLOCK_N: tl.constexpr,
    D: tl.constexpr,
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
    RING: tl.constexpr,
    INTERPRETED: tl.constexpr,
    AFTER_SPAN: tl.constexpr,
):
    if AFTER_SPAN:
        # Launched while the Gluon span still runs (programmatic dependent launch), on slots it does not
        # touch. The merge may launch as soon as every program here has started: it waits for this grid,
        # which completes only after the span has (below). Released at the end instead, the merge's launch
        # would wait behind the last dense program's work (kernels/DESIGN.md).
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
    q0, q1, q2, q3 = load_parts(Q + b * q_st[0], q_st[1], heads, head_ok, D, K_PARTS)
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
        m_i, l_i, a0, a1, a2, a3 = packed_span(
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
            KC + b * kc_st[0] + kv_head * kc_st[1],
            kc_st[2],
            KS + b * ks_st[0] + kv_head * ks_st[1],
            ks_st[2],
            KZ + b * kz_st[0] + kv_head * kz_st[1],
            kz_st[2],
            VC + b * vc_st[0] + kv_head * vc_st[1],
            vc_st[2],
            VS + b * vs_st[0] + kv_head * vs_st[1],
            vs_st[2],
            VZ + b * vz_st[0] + kv_head * vz_st[1],
            vz_st[2],
            start,
            tl.minimum(start + chunk_hist, n_hist),
            MASK,
            n_sink,
            score_scale,
            D,
            BLOCK_N,
            K_BITS,
            K_GROUPS,
            V_BITS,
            V_GROUPS,
            MAGIC,
            OFFSET,
            K_FREE,
            V_FREE,
            K_UNPACK,
            V_UNPACK,
            TIER_MASK,
            INTERPRETED,
        )
    else:
        tier = (slot - hist_splits) // dense_splits
        split = (slot - hist_splits) % dense_splits
        if tier == 0:
            start = split * chunk_sink
            m_i, l_i, a0, a1, a2, a3 = dense_span(
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
                SK + b * sk_st[0] + kv_head * sk_st[1],
                sk_st[2],
                SV + b * sv_st[0] + kv_head * sv_st[1],
                sv_st[2],
                start,
                tl.minimum(start + chunk_sink, n_sink),
                MASK,
                0,
                score_scale,
                0,
                0,
                1,
                D,
                DENSE_BLOCK_N,
                K_PARTS,
                V_PARTS,
                HAS_MASK,
                False,
                INTERPRETED,
            )
        elif tier == 1:
            start = split * chunk_recent
            m_i, l_i, a0, a1, a2, a3 = dense_span(
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
                RK + b * rk_st[0] + kv_head * rk_st[1],
                rk_st[2],
                RV + b * rv_st[0] + kv_head * rv_st[1],
                rv_st[2],
                start,
                tl.minimum(start + chunk_recent, n_recent),
                MASK,
                n_sink + n_hist,
                score_scale,
                ring_start,
                ring_rows,
                n_recent,
                D,
                DENSE_BLOCK_N,
                K_PARTS,
                V_PARTS,
                TIER_MASK,
                RING,
                INTERPRETED,
            )
        else:
            start = split * chunk_new
            if RING and tl.program_id(1) % HEAD_BLOCKS == 0:
                store_new_rows(
                    NK + b * nk_st[0] + kv_head * nk_st[1],
                    nk_st[2],
                    NV + b * nv_st[0] + kv_head * nv_st[1],
                    nv_st[2],
                    RK + b * rk_st[0] + kv_head * rk_st[1],
                    rk_st[2],
                    RV + b * rv_st[0] + kv_head * rv_st[1],
                    rv_st[2],
                    start,
                    tl.minimum(start + chunk_new, n_new),
                    ring_start + ring_rows,
                    n_recent,
                    D,
                )
            m_i, l_i, a0, a1, a2, a3 = dense_span(
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
                NK + b * nk_st[0] + kv_head * nk_st[1],
                nk_st[2],
                NV + b * nv_st[0] + kv_head * nv_st[1],
                nv_st[2],
                start,
                tl.minimum(start + chunk_new, n_new),
                MASK,
                n_sink + n_hist + n_recent,
                score_scale,
                0,
                0,
                1,
                D,
                DENSE_BLOCK_N,
                K_PARTS,
                V_PARTS,
                TIER_MASK,
                False,
                INTERPRETED,
            )

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
    PM,
    PL,
    PACC,
    O,
    o_st,
    n_slots,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOTS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
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
