"""Split-K (flash-decoding) attention of one new query token over ``[sink | packed history | recent | new]``.

The key sequence of one layer is four tiers, in this order of positions:

* ``sink``    dense rows ``[B, Hkv, S, D]`` (the first real tokens; with left padding some are pads),
* history     packed INT2/INT4 codes ``[B, Hkv, L, D*bits/8]`` + scale/zero ``[B, Hkv, L, D/G]``,
              K and V with their own bit widths and groups (``oscar-k4v2``: K 4-bit, V 2-bit),
* ``recent``  dense rows ``[B, Hkv, R, D]``,
* ``new``     dense rows ``[B, Hkv, T, D]`` (the token being decoded, not stored yet).

Everything is in the rotated basis: ``q`` is ``q·R_K`` and the output is in the ``V·R_V`` basis
(the caller applies ``·R_V^T``).

Stage 1 (one launch for all tiers): program ``(b, kv head [x head block], slot)`` handles one split
of one tier for all ``Hq/Hkv`` query heads of its KV head, so every KV tile is read once per group.
History tiles are loaded as contiguous packed bytes and dequantized in registers, ``(code - zero) *
scale`` in float32 then cast to the query dtype, exactly as :func:`oscar_hf.quant.dequantize`;
nothing dense is written. Byte ``c`` of a packed row holds dims ``c, c + D/k, ...`` (k codes per
byte), so shift ``j`` of the byte tile is the column block ``j`` of the rows: every tile (q, K, V, the
accumulator) is handled as k column blocks, and ``q·k`` as a sum of k dots. Only loads, shifts and
``tl.dot`` are used: a first version that rebuilt full-width tiles with ``tl.interleave`` passed in
the interpreter but gave wrong results compiled on an H200 for some tile shapes.
Each slot stores its running max ``m``, sum ``l`` and unnormalised accumulator ``acc`` (float32).
Stage 2 merges the slots with exact log-sum-exp weights: one softmax over the union of the tiers.
"""

from __future__ import annotations

import functools
import sys

import torch

from oscar_hf.quant import QuantizedRows, check_bits, dequantize

from ._triton import INTERPRET, define_op, is_power_of_two, next_power_of_two, runs_triton, tl, to_dtype, triton

_DENSE_SPLIT_TOKENS = 256  # dense tiers are short (sink 64, recent <= 263): a couple of splits each
_MIN_SPLIT_TOKENS = 256  # below this a history split costs more in the merge than it saves
_MAX_SPLITS = 256  # bounds the stage-2 merge and the partial buffers

# ------------------------------------------------------------------------------------ jit helpers


@triton.jit
def _dot(a, b, INTERPRETED: tl.constexpr):
    # Triton 3.6's interpreter multiplies bfloat16 bit patterns as integers; upcasting there is exact
    # (products of bf16 values fit float32). Compiled float32 dots use IEEE, not TF32, precision.
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend(
    q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, m_i, l_i, a0, a1, a2, a3, sm_scale,
    K_PARTS: tl.constexpr, V_PARTS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of ``BLOCK_H`` query heads over a ``BLOCK_N``-row K/V tile.

    Tiles come as column blocks (``q_j``, ``k_j``: dims ``[j*D/K_PARTS, (j+1)*D/K_PARTS)``; ``v_j`` and
    the accumulators ``a_j`` likewise with ``V_PARTS``), the shape in which packed codes unpack, so
    ``q·k`` is a sum of per-block dots. Blocks 2 and 3 are unused when there are 2 parts.
    """
    scores = _dot(q0, tl.trans(k0), INTERPRETED) + _dot(q1, tl.trans(k1), INTERPRETED)
    if K_PARTS == 4:
        scores += _dot(q2, tl.trans(k2), INTERPRETED) + _dot(q3, tl.trans(k3), INTERPRETED)
    scores = tl.where(valid[None, :], scores * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A fully masked tile keeps m at -inf; subtracting 0 instead avoids exp(-inf - -inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = to_dtype(p, v0.dtype, INTERPRETED)
    a0 = a0 * alpha[:, None] + _dot(p, v0, INTERPRETED)
    a1 = a1 * alpha[:, None] + _dot(p, v1, INTERPRETED)
    if V_PARTS == 4:
        a2 = a2 * alpha[:, None] + _dot(p, v2, INTERPRETED)
        a3 = a3 * alpha[:, None] + _dot(p, v3, INTERPRETED)
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
def _dequantize_part(
    raw, J: tl.constexpr, SCALE, scale_stride_n, ZERO, zero_stride_n, rows, valid, row_scale, row_zero,
    DTYPE: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Column block ``J`` of packed rows: bits ``J*BITS..`` of each byte are dims ``J*D/k + c`` (k = 8/BITS).

    ``((code - zero) * scale).to(DTYPE)`` in float32, as :func:`oscar_hf.quant.dequantize` computes it.
    """
    DP: tl.constexpr = D * BITS // 8
    codes = ((raw >> (J * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    if GROUPS == 1:
        scale, zero = row_scale[:, None], row_zero[:, None]
    else:
        group = ((J * DP + tl.arange(0, DP)) // (D // GROUPS))[None, :]
        scale = tl.load(SCALE + rows[:, None] * scale_stride_n + group, mask=valid[:, None], other=0.0)
        zero = tl.load(ZERO + rows[:, None] * zero_stride_n + group, mask=valid[:, None], other=0.0)
        scale, zero = scale.to(tl.float32), zero.to(tl.float32)
    return to_dtype((codes - zero) * scale, DTYPE, INTERPRETED)


@triton.jit
def _packed_parts(
    CODES, codes_stride_n, SCALE, scale_stride_n, ZERO, zero_stride_n, rows, valid,
    DTYPE: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Packed rows as dequantized column blocks, like :func:`_load_parts`: one contiguous byte load."""
    DP: tl.constexpr = D * BITS // 8
    raw = tl.load(CODES + rows[:, None] * codes_stride_n + tl.arange(0, DP)[None, :], mask=valid[:, None], other=0)
    raw = raw.to(tl.int32)
    # Group 0 of each row; the whole row's metadata when there is one group (the default layout).
    row_scale = tl.load(SCALE + rows * scale_stride_n, mask=valid, other=0.0).to(tl.float32)
    row_zero = tl.load(ZERO + rows * zero_stride_n, mask=valid, other=0.0).to(tl.float32)
    x0 = _dequantize_part(raw, 0, SCALE, scale_stride_n, ZERO, zero_stride_n, rows, valid, row_scale, row_zero,
                          DTYPE, D, BITS, GROUPS, INTERPRETED)  # fmt: skip
    x1 = _dequantize_part(raw, 1, SCALE, scale_stride_n, ZERO, zero_stride_n, rows, valid, row_scale, row_zero,
                          DTYPE, D, BITS, GROUPS, INTERPRETED)  # fmt: skip
    if BITS == 2:
        x2 = _dequantize_part(raw, 2, SCALE, scale_stride_n, ZERO, zero_stride_n, rows, valid, row_scale, row_zero,
                              DTYPE, D, BITS, GROUPS, INTERPRETED)  # fmt: skip
        x3 = _dequantize_part(raw, 3, SCALE, scale_stride_n, ZERO, zero_stride_n, rows, valid, row_scale, row_zero,
                              DTYPE, D, BITS, GROUPS, INTERPRETED)  # fmt: skip
    else:
        x2, x3 = x0, x1
    return x0, x1, x2, x3


@triton.jit
def _dense_span(
    q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, K, k_stride_n, V, v_stride_n, start, end, MASK, position, sm_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, K_PARTS: tl.constexpr, V_PARTS: tl.constexpr,
    HAS_MASK: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Attend over dense rows ``[start, end)`` of one KV head (K/V point at that head's row 0)."""
    for block in range(start, end, BLOCK_N):
        rows = block + tl.arange(0, BLOCK_N)
        valid = _key_valid(rows, end, MASK, position, HAS_MASK)
        k0, k1, k2, k3 = _load_parts(K, k_stride_n, rows, valid, D, K_PARTS)
        v0, v1, v2, v3 = _load_parts(V, v_stride_n, rows, valid, D, V_PARTS)
        m_i, l_i, a0, a1, a2, a3 = _attend(
            q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, m_i, l_i, a0, a1, a2, a3, sm_scale,
            K_PARTS, V_PARTS, INTERPRETED,
        )  # fmt: skip
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _packed_span(
    q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, KC, kc_n, KS, ks_n, KZ, kz_n, VC, vc_n, VS, vs_n, VZ, vz_n,
    start, end, MASK, position, sm_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr, K_GROUPS: tl.constexpr,
    V_BITS: tl.constexpr, V_GROUPS: tl.constexpr, HAS_MASK: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Attend over packed history rows ``[start, end)`` of one KV head."""
    for block in range(start, end, BLOCK_N):
        rows = block + tl.arange(0, BLOCK_N)
        valid = _key_valid(rows, end, MASK, position, HAS_MASK)
        k0, k1, k2, k3 = _packed_parts(KC, kc_n, KS, ks_n, KZ, kz_n, rows, valid, q0.dtype, D, K_BITS, K_GROUPS,
                                       INTERPRETED)  # fmt: skip
        v0, v1, v2, v3 = _packed_parts(VC, vc_n, VS, vs_n, VZ, vz_n, rows, valid, q0.dtype, D, V_BITS, V_GROUPS,
                                       INTERPRETED)  # fmt: skip
        m_i, l_i, a0, a1, a2, a3 = _attend(
            q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, m_i, l_i, a0, a1, a2, a3, sm_scale,
            8 // K_BITS, 8 // V_BITS, INTERPRETED,
        )  # fmt: skip
    return m_i, l_i, a0, a1, a2, a3


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def _decode_stage1_kernel(
    Q, q_st,
    SK, sk_st, SV, sv_st, n_sink, chunk_sink,
    RK, rk_st, RV, rv_st, n_recent, chunk_recent,
    NK, nk_st, NV, nv_st, n_new, chunk_new,
    KC, kc_st, KS, ks_st, KZ, kz_st, VC, vc_st, VS, vs_st, VZ, vz_st, n_hist, chunk_hist,
    MASK, mask_stride_b, PM, PL, PACC, sm_scale, hist_splits, dense_splits, n_slots,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, K_BITS: tl.constexpr, K_GROUPS: tl.constexpr, V_BITS: tl.constexpr,
    V_GROUPS: tl.constexpr, HAS_MASK: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    # K tiles (and q) split in as many column blocks as K codes per byte, V tiles (and acc) as V's.
    K_PARTS: tl.constexpr = 8 // K_BITS
    V_PARTS: tl.constexpr = 8 // V_BITS
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    local = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = local < GROUP
    heads = kv_head * GROUP + local
    slot = tl.program_id(2)
    q0, q1, q2, q3 = _load_parts(Q + b * q_st[0], q_st[1], heads, head_ok, D, K_PARTS)
    MASK = MASK + b * mask_stride_b

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    a0 = tl.zeros((BLOCK_H, D // V_PARTS), tl.float32)
    a1, a2, a3 = a0, a0, a0
    # Slots: history splits first, then `dense_splits` for each of sink, recent and new.
    if slot < hist_splits:
        start = slot * chunk_hist
        m_i, l_i, a0, a1, a2, a3 = _packed_span(
            q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
            KC + b * kc_st[0] + kv_head * kc_st[1], kc_st[2], KS + b * ks_st[0] + kv_head * ks_st[1], ks_st[2],
            KZ + b * kz_st[0] + kv_head * kz_st[1], kz_st[2], VC + b * vc_st[0] + kv_head * vc_st[1], vc_st[2],
            VS + b * vs_st[0] + kv_head * vs_st[1], vs_st[2], VZ + b * vz_st[0] + kv_head * vz_st[1], vz_st[2],
            start, tl.minimum(start + chunk_hist, n_hist), MASK, n_sink, sm_scale,
            D, BLOCK_N, K_BITS, K_GROUPS, V_BITS, V_GROUPS, HAS_MASK, INTERPRETED,
        )  # fmt: skip
    else:
        tier = (slot - hist_splits) // dense_splits
        split = (slot - hist_splits) % dense_splits
        if tier == 0:
            start = split * chunk_sink
            m_i, l_i, a0, a1, a2, a3 = _dense_span(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, SK + b * sk_st[0] + kv_head * sk_st[1], sk_st[2],
                SV + b * sv_st[0] + kv_head * sv_st[1], sv_st[2], start, tl.minimum(start + chunk_sink, n_sink),
                MASK, 0, sm_scale, D, BLOCK_N, K_PARTS, V_PARTS, HAS_MASK, INTERPRETED,
            )  # fmt: skip
        elif tier == 1:
            start = split * chunk_recent
            m_i, l_i, a0, a1, a2, a3 = _dense_span(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, RK + b * rk_st[0] + kv_head * rk_st[1], rk_st[2],
                RV + b * rv_st[0] + kv_head * rv_st[1], rv_st[2], start, tl.minimum(start + chunk_recent, n_recent),
                MASK, n_sink + n_hist, sm_scale, D, BLOCK_N, K_PARTS, V_PARTS, HAS_MASK, INTERPRETED,
            )  # fmt: skip
        else:
            start = split * chunk_new
            m_i, l_i, a0, a1, a2, a3 = _dense_span(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, NK + b * nk_st[0] + kv_head * nk_st[1], nk_st[2],
                NV + b * nv_st[0] + kv_head * nv_st[1], nv_st[2], start, tl.minimum(start + chunk_new, n_new),
                MASK, n_sink + n_hist + n_recent, sm_scale, D, BLOCK_N, K_PARTS, V_PARTS, HAS_MASK, INTERPRETED,
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


@triton.jit
def _decode_stage2_kernel(
    PM, PL, PACC, O, o_st, n_slots,
    D: tl.constexpr, SLOTS: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Merge the slots of one (batch, query head): exact softmax over all tiers and splits."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slots = tl.arange(0, SLOTS)
    used = slots < n_slots
    dims = tl.arange(0, D)
    base = (b * tl.num_programs(1) + head) * n_slots
    m = tl.load(PM + base + slots, mask=used, other=float("-inf"))
    l = tl.load(PL + base + slots, mask=used, other=0.0)
    acc = tl.load(PACC + (base + slots)[:, None] * D + dims[None, :], mask=used[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty slots (m = -inf) weigh 0
    total = tl.sum(weight * l, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)  # all masked -> 0
    tl.store(O + b * o_st[0] + head * o_st[1] + dims, to_dtype(out, O.dtype.element_ty, INTERPRETED))


# --------------------------------------------------------------------------------------- launcher


@functools.lru_cache(maxsize=None)
def _device_programs(device: torch.device) -> int:
    """Stage-1 programs to aim for: 8 per SM on CUDA (the best of a first, untuned H200 sweep), else 4."""
    if device.type == "cuda":
        return 8 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _splits(
    length: int, requested: int, programs_per_split: int, device: torch.device, block_n: int
) -> tuple[int, int]:
    """``(splits, chunk)`` for a history of ``length`` rows; ``chunk`` is a multiple of ``block_n``."""
    if length == 0:
        return 0, block_n
    splits = requested or min(
        _MAX_SPLITS, triton.cdiv(length, _MIN_SPLIT_TOKENS), triton.cdiv(_device_programs(device), programs_per_split)
    )
    chunk = triton.cdiv(triton.cdiv(length, max(1, splits)), block_n) * block_n
    return triton.cdiv(length, chunk), chunk


def _dense_chunk(length: int, splits: int, block_n: int) -> int:
    return max(1, triton.cdiv(triton.cdiv(length, splits), block_n)) * block_n


def _block_sizes(group: int, block_n: int) -> tuple[int, int, int]:
    # tl.dot needs at least 16 rows, so small groups are padded to 16 (masked) query heads. 32 keys
    # a tile was the fastest first guess on an H200 (untuned: see the tuning knobs of the launcher).
    block_h = max(16, min(64, next_power_of_two(group)))
    return block_h, triton.cdiv(group, block_h), block_n or 32


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
) -> torch.Tensor:
    """Launch stage 1 and stage 2 (arguments as :func:`decode_attention`).

    ``num_splits``, ``block_n`` (keys per tile), ``num_warps`` and ``num_stages`` of stage 1 are tuning
    knobs, 0 meaning automatic. Software pipelining is kept at 2 stages (1 in float32): with 3, the
    tiles of both the packed and the dense paths overflow the H200's 227 KiB of shared memory.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = sink_k.shape[1]
    group = q_heads // kv_heads
    block_h, head_blocks, block_n = _block_sizes(group, block_n)
    num_stages = num_stages or (1 if q.dtype == torch.float32 else 2)
    n_sink, n_hist, n_recent, n_new = sink_k.shape[2], k_codes.shape[2], recent_k.shape[2], new_k.shape[2]
    hist_splits, chunk_hist = _splits(n_hist, num_splits, batch * kv_heads * head_blocks, q.device, block_n)
    dense_splits = max(1, triton.cdiv(max(n_sink, n_recent, n_new), _DENSE_SPLIT_TOKENS))
    n_slots = hist_splits + 3 * dense_splits

    partial_m = torch.empty(batch, q_heads, n_slots, dtype=torch.float32, device=q.device)
    partial_l = torch.empty_like(partial_m)
    partial_acc = torch.empty(batch, q_heads, n_slots, head_dim, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, q_heads, head_dim, dtype=q.dtype, device=q.device)
    # Masks travel as bytes (bool pointers are not portable across Triton versions); a dummy otherwise.
    if key_mask is None:
        mask = torch.ones(1, 1, dtype=torch.uint8, device=q.device)
    else:
        mask = key_mask.to(torch.uint8).contiguous()
    t = _last_dim_contiguous

    _decode_stage1_kernel[(batch, kv_heads * head_blocks, n_slots)](
        *t(q),
        *t(sink_k), *t(sink_v), n_sink, _dense_chunk(n_sink, dense_splits, block_n),
        *t(recent_k), *t(recent_v), n_recent, _dense_chunk(n_recent, dense_splits, block_n),
        *t(new_k), *t(new_v), n_new, _dense_chunk(n_new, dense_splits, block_n),
        *t(k_codes), *t(k_scale), *t(k_zero), *t(v_codes), *t(v_scale), *t(v_zero), n_hist, chunk_hist,
        mask, mask.stride(0), partial_m, partial_l, partial_acc, sm_scale, hist_splits, dense_splits, n_slots,
        GROUP=group, HEAD_BLOCKS=head_blocks, BLOCK_H=block_h, BLOCK_N=block_n, D=head_dim,
        K_BITS=k_bits, K_GROUPS=k_scale.shape[-1], V_BITS=v_bits, V_GROUPS=v_scale.shape[-1],
        HAS_MASK=key_mask is not None, INTERPRETED=INTERPRET, num_warps=num_warps or 4, num_stages=num_stages,
    )  # fmt: skip
    _decode_stage2_kernel[(batch, q_heads)](
        partial_m, partial_l, partial_acc, *t(out), n_slots,
        D=head_dim, SLOTS=next_power_of_two(n_slots), INTERPRETED=INTERPRET,
    )  # fmt: skip
    return out


def _last_dim_contiguous(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(tensor, strides of all but the last dim)``; kernels index the last dim with unit stride."""
    if tensor.stride(-1) != 1 and tensor.numel():
        tensor = tensor.contiguous()
    return tensor, tuple(tensor.stride()[:-1])


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
) -> torch.Tensor:
    """The torch reference and CPU fallback of :func:`decode_attention` (``num_splits`` is ignored).

    Dequantizes the history with :func:`oscar_hf.quant.dequantize` into the query dtype, concatenates
    the tiers and runs one float32 softmax, with the query heads of each KV head grouped (GQA).
    """
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
) -> torch.Tensor:
    launch = sys.modules[__name__].decode_attention_triton  # see quantize._quantize_pack_op
    return launch(
        q, sink_k, sink_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v,
        new_k, new_v, key_mask, k_bits, v_bits, sm_scale, num_splits, block_n, num_warps, num_stages,
    )  # fmt: skip


def _decode_attention_fake(q, *args):
    return torch.empty_like(q)


define_op("oscar::decode_attention", _decode_attention_op, _decode_attention_fake)


# ----------------------------------------------------------------------------------- dispatcher


def _check_inputs(q, dense, k_codes, k_scale, v_codes, v_scale, key_mask, k_bits, v_bits) -> None:
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
    total = dense[0].shape[2] + k_codes.shape[2] + dense[2].shape[2] + dense[4].shape[2]
    if key_mask is not None and tuple(key_mask.shape) != (batch, total):
        raise ValueError(f"key_mask has shape {tuple(key_mask.shape)}, expected [{batch}, {total}]")


def kernel_supports_decode(head_dim: int, k_bits: int = 2, v_bits: int = 2) -> bool:
    """Tiles are column blocks of ``D * bits / 8`` dims: a power of two, and at least 16 for ``tl.dot``."""
    return is_power_of_two(head_dim) and head_dim * min(k_bits, v_bits) // 8 >= 16


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
) -> torch.Tensor:
    """Attention of one query token per sequence over ``[sink | history | recent | new]``, rotated basis.

    Args:
        q: ``[B, Hq, D]`` query, already multiplied by R_K, in the dtype of the dense rows.
        sink_k, sink_v, recent_k, recent_v, new_k, new_v: dense rows ``[B, Hkv, n, D]`` (views are fine).
        k_codes, v_codes: packed history ``uint8 [B, Hkv, L, D*bits/8]`` (the layout of
            :func:`oscar_hf.quant.pack`); ``L`` may be 0.
        k_scale, k_zero, v_scale, v_zero: ``[B, Hkv, L, D/G]`` per-group metadata (any float dtype).
        k_bits, v_bits: 2 or 4 each.
        sm_scale: score scale, ``1/sqrt(D)`` by default.
        key_mask: optional ``bool [B, S+L+R+T]``, True where a key may be attended (left-padding pads
            are False).
        num_splits: history splits (0: chosen from the length and the device).

    Returns:
        ``[B, Hq, D]`` in the dtype of ``q`` and in the rotated V basis (the caller applies ``·R_V^T``).

    Runs the Triton kernels when :func:`~._triton.runs_triton` says so, else the torch reference.
    """
    dense = (sink_k, sink_v, recent_k, recent_v, new_k, new_v)
    _check_inputs(q, dense, k_codes, k_scale, v_codes, v_scale, key_mask, k_bits, v_bits)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    if not (runs_triton(q) and kernel_supports_decode(q.shape[-1], k_bits, v_bits)):
        return decode_attention_reference(
            q, sink_k, sink_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v,
            k_bits=k_bits, v_bits=v_bits, sm_scale=scale, key_mask=key_mask,
        )  # fmt: skip
    return torch.ops.oscar.decode_attention(
        q, sink_k, sink_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v,
        key_mask, k_bits, v_bits, scale, num_splits, 0, 0, 0,
    )  # fmt: skip

