"""The Gluon history span's index algebra, emulated in torch on the CPU (a debugging aid).

    python kernels/tools/emulate_gluon_history.py

Every layout conversion of the span (``kernels/gluon_span_*.py``) is an identity and its reshape /
permute / join are logical operations, so its program can be replayed with torch tensors: the same
unpacked code values (``K_UNPACK``'s and ``value_unpack_asm``'s elementwise meaning), relabellings,
q's fixed point, scores,
online softmax with lane-partial sums, value corrections and output scatter, for one KV head and
one split. The one non-elementwise step, ``movmatrix``, is replayed by where its values land: the
register that held ``W[8i + g, 2t + e]`` of the scores' accumulator holds ``W[8i + 2t + e, g]``.
3- and 4-bit keys and 1-bit values are read as the kernel reads them (``_key_words``, ``K3_UNPACK``,
``K4_UNPACK``, ``_value_words``): as the 2-bit words' blocks. The result is compared with
``decode_attention_reference`` in float32 for each K/V width the span reads. A GPU failure of
``tests/test_gluon_history.py`` with this passing points at layouts or the asm, not the algebra.
"""

import torch

from oscar_hf.kernels.decode_attention import DecodeTiers, decode_attention_reference
from oscar_hf.kernels.gluon_span_variant import BIT_WIDTHS
from oscar_hf.kernels.testing import decode_inputs

OFFSET, SM_SCALE = 128.0, 0.088
# V's column block j as bf16 OFFSET + f_j * code (2-bit block 3 shifted down), value_factors(bits)
V_FACTORS = {2: (1.0, 4.0, 16.0, 1.0), 1: (1.0, 4.0, 16.0, 64.0)}
# K's block j as int8 f_j * code (K_FACTORS, K3_FACTORS, K4_FACTORS); q's fixed-point range
K_FACTORS, Q_RANGE = {2: (1, 4, 16, 16), 3: (1, 1, 16, 16), 4: (1, 1, 1, 1)}, 32000.0


def value_words(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """``_value_words``: V's code rows as int32 words ``[L, 4 * bits]`` to 2-bit words ``[L, 8]``; 2-bit word w
    of 1-bit rows is their word ``w % 4`` shifted right by ``w // 4``."""
    if bits == 2:
        return rows
    return torch.stack([rows[:, w % 4] >> (w // 4) for w in range(8)], dim=1)


def code_values(words: torch.Tensor, byte: int, block: int, offset: float, factor: float, bits: int) -> torch.Tensor:
    """``offset + f_j * code`` of one byte and column block of every word, as the asm makes them from
    the low ``bits`` of each 2-bit field."""
    return offset + factor * ((words >> (8 * byte + 2 * block)) & ((1 << bits) - 1)).float()


def v_codes(words: torch.Tensor, block: int, pack: int, bits: int) -> list[torch.Tensor]:
    """``_unpack_v`` then ``_v_operands``: the value MMA's A operands ``[32 dims m, 64 // pack K]``, one a half."""
    factor = V_FACTORS[bits][block]
    b0, b1, b2, b3 = (code_values(words, b, block, OFFSET, factor, bits) for b in range(4))
    codes = torch.stack([torch.stack([b0, b1], -1), torch.stack([b2, b3], -1)], -1)  # _bytes_of
    codes = codes.permute(0, 1, 3, 2).reshape(64, 32).reshape(4, 2, pack, 8 // pack, 8, 4)  # [t, e, h, c, g, b]
    halves = codes.permute(0, 1, 3, 4, 5, 2).unbind(-1)
    return [half.permute(4, 3, 2, 0, 1).reshape(32, 64 // pack) for half in halves]  # _v_rows


def key_bytes(words: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """``_key_words`` then ``unpack_k``: block j's int8 ``f_j * code`` ``[keys, 8 words, 4 bytes]`` of K's code
    rows as int32 words ``[keys, 4 * bits]``. 4-bit: 2-bit word w's blocks are the low nibbles of words w
    (j = 0) and w + 8 (j = 1), then their high nibbles (j = 2, 3), factor 1. 3-bit: the 2-bit words (0-7)
    give the low bits, word ``8 + w % 4`` shifted right by ``w // 4`` the third bit."""
    if bits == 4:
        source = words[:, 8:] if block % 2 else words[:, :8]
        return torch.stack([(source >> (8 * b + 4 * (block // 2))) & 15 for b in range(4)], -1)
    if bits == 3:
        high = torch.stack([words[:, 8 + w % 4] >> (w // 4) for w in range(8)], dim=1)
        fields = [
            (words[:, :8] >> (8 * b + 2 * block)) & 3 | ((high >> (8 * b + 2 * block)) & 1) << 2 for b in range(4)
        ]
        return torch.stack(fields, -1) * K_FACTORS[3][block]
    shift = 2 * block - (2 if block == 3 else 0)  # block 3 shifted down by 2 before its mask
    return torch.stack([((words >> (8 * b + 2 * block)) & 3) << shift for b in range(4)], -1)


def k_codes(words: torch.Tensor, block: int, pack: int, bits: int) -> list[torch.Tensor]:
    """``_unpack_k`` then ``_k_operands``: the scores' int8 A operands ``[64 // pack rows m, 32 k]``, one a half."""
    codes = key_bytes(words, block, bits).reshape(64, 32)
    halves = codes.reshape(8, pack, 8 // pack, 4, 2, 4).permute(0, 2, 3, 4, 5, 1).unbind(-1)  # [g, i, t, e, b]
    return [half.permute(1, 0, 3, 2, 4).reshape(64 // pack, 32).long() for half in halves]  # _k_rows


def q_int8(q: torch.Tensor, pack: int, bits: int) -> tuple[list[list[torch.Tensor]], torch.Tensor, torch.Tensor]:
    """``_q_int8``: per column block the fixed point ``256 hi + lo`` ``[32 k, 8 columns]`` (as int64), one
    operand a half (half 1's: half 0's with columns n and n ^ 4 swapped), and per head ``-sum(q)`` in
    fixed-point units and the unit."""
    k = torch.arange(32)
    byte = 8 * ((k // 4) % 4) + 4 * (k // 16) + k % 4
    padded = torch.zeros(8, 128)
    padded[: q.shape[0]] = q
    blocks = [padded[:, 32 * j + byte].T for j in range(4)]
    amax = torch.stack([b.abs().amax(0) for b in blocks]).amax(0).clamp(min=1e-30)
    scale = Q_RANGE / amax
    # to nearest even, as cvt.rni
    fixed = [torch.round(b * (scale / f)[None, :]) for b, f in zip(blocks, K_FACTORS[bits])]
    hi = [torch.floor((x + 128) / 256) for x in fixed]
    assert all(h.abs().max() <= 127 for h in hi) and all((x - 256 * h).abs().max() <= 128 for x, h in zip(fixed, hi))
    neg_q_sum = -sum(f * x.sum(0) for f, x in zip(K_FACTORS[bits], fixed))
    swapped = torch.arange(8) ^ 4
    operands = [[x.long()] + ([x[:, swapped].long()] if pack == 2 else []) for x in fixed]  # _halves_of
    # _per_head: columns past the group hold 0 and a unit of 1e-30 / Q_RANGE
    return operands, neg_q_sum.reshape(pack, -1).sum(0), (amax / Q_RANGE).reshape(pack, -1).amax(0)


def key_rows(values: torch.Tensor, pack: int) -> torch.Tensor:
    """``_key_rows``: key ``8g + (8 // pack) h + i`` -> row ``8i + g`` of half h, ``[64 // pack, pack]``."""
    return values.reshape(8, pack, 8 // pack).permute(2, 0, 1).reshape(64 // pack, pack)


def weights_operand(weights: torch.Tensor) -> torch.Tensor:
    """movmatrix by where its values land, then ``_weights_operand``'s relabelling."""
    rows = weights.shape[0]
    moved = torch.empty_like(weights)
    for i in range(rows // 8):
        for g in range(8):
            for t in range(4):
                for e in range(2):
                    moved[8 * i + g, 2 * t + e] = weights[8 * i + 2 * t + e, g]
    return moved.reshape(rows // 8, 8, 4, 2).permute(0, 2, 3, 1).reshape(rows, 8)


def half_columns(operand: torch.Tensor, half: int, pack: int) -> torch.Tensor:
    """``_half_columns``: the other half's columns zeroed (with one half, all columns)."""
    if pack == 1:
        return operand
    return torch.where((torch.arange(8) // 4 == half)[None, :], operand, 0.0)


def lane_sum(values: torch.Tensor) -> torch.Tensor:
    """``[rows, halves, heads]`` summed over the rows a lane holds."""
    return values.reshape(values.shape[0] // 8, 8, *values.shape[1:]).sum(0)


def span(q: torch.Tensor, words_k, words_v, k_scale, k_zero, v_scale, v_zero, k_bits=2, v_bits=2) -> torch.Tensor:
    """The kernel's program for one KV head over its whole history (code rows as int32 words
    ``[L, 4 * bits]``); returns ``[group, 128]``."""
    group = q.shape[0]
    pack = 2 if group <= 4 else 1
    heads, rows = 8 // pack, 64 // pack
    rows_total = words_k.shape[0]
    words_v = value_words(words_v, v_bits)
    fixed, neg_q_sum, unit = q_int8(q, pack, k_bits)
    m_i = torch.full((heads,), float("-inf"))
    l_part = w_part = wz_part = torch.zeros(8, pack, heads)
    acc = [torch.zeros(32, 8) for _ in range(4)]
    for block in range(0, rows_total, 64):
        keys = block + torch.arange(64)
        ok = keys < rows_total
        safe = keys.clamp(max=rows_total - 1)
        wk = torch.where(ok[:, None], words_k[safe], 0)
        wv = torch.where(ok[:, None], words_v[safe], 0)
        meta = [key_rows(torch.where(ok, t[safe], 0.0), pack)[:, :, None] for t in (k_scale, k_zero, v_scale, v_zero)]
        dots = sum(a @ b for j in range(4) for a, b in zip(k_codes(wk, j, pack, k_bits), fixed[j])).float()
        dots = (dots.reshape(rows, pack, heads) + meta[1] * neg_q_sum) * unit  # _by_half
        scores = dots * meta[0] * (SM_SCALE * 1.4426950408889634)
        scores = torch.where(key_rows(ok, pack)[:, :, None], scores, float("-inf"))
        m_new = torch.maximum(m_i, scores.amax((0, 1)))
        m_new = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha, m_i = torch.exp2(m_i - m_new), m_new
        p = torch.exp2(scores - m_i)
        w = (p * meta[2]).bfloat16().float()
        l_part = l_part * alpha + lane_sum(p)
        w_part = w_part * alpha + lane_sum(w)
        wz_part = wz_part * alpha + lane_sum(w * meta[3])
        w_op = weights_operand(w.reshape(rows, 8))  # _columns
        acc = [
            (a.reshape(32, pack, heads) * alpha).reshape(32, 8)
            + sum(codes @ half_columns(w_op, h, pack) for h, codes in enumerate(v_codes(wv, j, pack, v_bits)))
            for j, a in enumerate(acc)
        ]
    l_i, w_sum, wz_sum = (x.sum((0, 1)) for x in (l_part, w_part, wz_part))
    out = torch.zeros(heads, 128)
    m = torch.arange(32)
    for j, f in enumerate(V_FACTORS[v_bits]):
        total = acc[j].reshape(32, pack, heads).sum(1)  # _over_halves
        out[:, 32 * j + 4 * (m % 8) + m // 8] = (total / f - wz_sum[None, :] - OFFSET / f * w_sum[None, :]).T
    return out[:group] / l_i[:group, None]


def emulated_and_reference(group: int, k_bits: int, v_bits: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The emulated span and ``decode_attention_reference`` (float32) on one KV head's random history of
    200 rows (3 whole tiles and a partial one), ``[group, 128]`` each."""
    q, tiers = decode_inputs(1, group, 1, 128, 0, 200, 0, 0, torch.bfloat16, k_bits, v_bits, seed=seed)
    _, _, kc, ks, kz, vc, vs, vz, *_ = tiers.flat()
    exact = DecodeTiers.from_flat([t.float() if t.is_floating_point() else t for t in tiers.flat()], k_bits, v_bits)
    want = decode_attention_reference(q.float(), exact, sm_scale=SM_SCALE)[0].float()
    words = [c[0, 0].contiguous().view(torch.int32) for c in (kc, vc)]
    meta = [t[0, 0, :, 0].float() for t in (ks, kz, vs, vz)]
    return span(q[0].float(), words[0], words[1], *meta, k_bits=k_bits, v_bits=v_bits), want


def main() -> None:
    torch.manual_seed(0)
    for k_bits, v_bits in BIT_WIDTHS:
        for group in (4, 8):  # two halves of 32 keys a tile, and one of 64
            got, want = emulated_and_reference(group, k_bits, v_bits)
            print(
                f"K{k_bits} V{v_bits}, {group} query heads: max abs difference {(got - want).abs().max().item():.2e} "
                f"at outputs up to {want.abs().max().item():.2f}"
            )


if __name__ == "__main__":
    main()
