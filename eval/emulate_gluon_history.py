"""The Gluon history span's index algebra, emulated in torch on the CPU (a debugging aid).

    python eval/emulate_gluon_history.py

Every layout conversion of ``kernels/decode_history_gluon.py`` is an identity and its reshape /
permute / join are logical operations, so its program can be replayed with torch tensors: the same
unpacked code values (``K_UNPACK``'s and ``value_unpack_asm``'s elementwise meaning), relabellings,
q's fixed point, scores,
online softmax with lane-partial sums, value corrections and output scatter, for one KV head and
one split. The one non-elementwise step, ``movmatrix``, is replayed by where its values land: the
register that held ``W[8i + g, 2t + e]`` of the scores' accumulator holds ``W[8i + 2t + e, g]``.
The result is compared with ``decode_attention_reference`` in float32. A GPU failure of
``tests/test_gluon_history.py`` with this passing points at layouts or the asm, not the algebra.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oscar_hf.kernels.decode_attention import decode_attention_reference  # noqa: E402
from tests.test_kernels import _decode_inputs  # noqa: E402

GROUP, OFFSET, SM_SCALE = 4, 128.0, 0.088
V_FACTORS = (1.0, 4.0, 16.0, 1.0)  # V's column block j as bf16 OFFSET + f_j * code (block 3 shifted)
K_FACTORS, Q_RANGE = (1, 4, 16, 16), 32000.0  # K's block j as int8 f_j * code; q's fixed-point range


def code_values(words: torch.Tensor, byte: int, block: int, offset: float, factor: float) -> torch.Tensor:
    """``offset + f_j * code`` of one byte and column block of every word, as the asm makes them."""
    return offset + factor * ((words >> (8 * byte + 2 * block)) & 3).float()


def v_codes(words: torch.Tensor, block: int) -> torch.Tensor:
    """``_unpack_v`` then ``_v_operand``: the value MMA's A operand ``[32 dims m, 64 K]``."""
    b0, b1, b2, b3 = (code_values(words, b, block, OFFSET, V_FACTORS[block]) for b in range(4))
    codes = torch.stack([torch.stack([b0, b1], -1), torch.stack([b2, b3], -1)], -1)  # _bytes_of
    codes = codes.permute(0, 1, 3, 2).reshape(64, 32)
    return codes.reshape(4, 2, 8, 8, 4).permute(4, 3, 2, 0, 1).reshape(32, 64)


def k_codes(words: torch.Tensor, block: int) -> torch.Tensor:
    """``_unpack_k`` then ``_k_operand``: the scores' int8 A operand ``[64 rows m, 32 k]``."""
    shift = 2 * block - (2 if block == 3 else 0)  # block 3 shifted down by 2 before its mask
    codes = torch.stack([((words >> (8 * b + 2 * block)) & 3) << shift for b in range(4)], -1).reshape(64, 32)
    return codes.reshape(8, 8, 4, 2, 4).permute(1, 0, 3, 2, 4).reshape(64, 32).long()


def q_int8(q: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``_q_int8``: per column block the fixed point ``256 hi + lo`` ``[32 k, 8 heads]`` (as int64),
    per head ``-sum(q)`` in fixed-point units and the unit."""
    k = torch.arange(32)
    byte = 8 * ((k // 4) % 4) + 4 * (k // 16) + k % 4
    padded = torch.zeros(8, 128)
    padded[:GROUP] = q
    blocks = [padded[:, 32 * j + byte].T for j in range(4)]
    amax = torch.stack([b.abs().amax(0) for b in blocks]).amax(0).clamp(min=1e-30)
    scale = Q_RANGE / amax
    fixed = [torch.round(b * (scale / f)[None, :]) for b, f in zip(blocks, K_FACTORS)]  # to nearest even, as cvt.rni
    hi = [torch.floor((x + 128) / 256) for x in fixed]
    assert all(h.abs().max() <= 127 for h in hi) and all((x - 256 * h).abs().max() <= 128 for x, h in zip(fixed, hi))
    neg_q_sum = -sum(f * x.sum(0) for f, x in zip(K_FACTORS, fixed))
    return [x.long() for x in fixed], neg_q_sum, amax / Q_RANGE


def key_vector(values: torch.Tensor) -> torch.Tensor:
    """Key ``8g + i`` -> score row ``8i + g``."""
    return values.reshape(8, 8).permute(1, 0).reshape(64)


def weights_operand(weights: torch.Tensor) -> torch.Tensor:
    """movmatrix by where its values land, then ``_weights_operand``'s relabelling."""
    moved = torch.empty_like(weights)
    for i in range(8):
        for g in range(8):
            for t in range(4):
                for e in range(2):
                    moved[8 * i + g, 2 * t + e] = weights[8 * i + 2 * t + e, g]
    return moved.reshape(8, 8, 4, 2).permute(0, 2, 3, 1).reshape(64, 8)


def lane_sum(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(8, 8, 8).sum(0)


def span(q: torch.Tensor, words_k, words_v, k_scale, k_zero, v_scale, v_zero) -> torch.Tensor:
    """The kernel's program for one KV head over its whole history; returns ``[GROUP, 128]``."""
    rows_total = words_k.shape[0]
    fixed, neg_q_sum, unit = q_int8(q)
    m_i = torch.full((8,), float("-inf"))
    l_part, w_part, wz_part = torch.zeros(8, 8), torch.zeros(8, 8), torch.zeros(8, 8)
    acc = [torch.zeros(32, 8) for _ in range(4)]
    for block in range(0, rows_total, 64):
        rows = block + torch.arange(64)
        ok = rows < rows_total
        safe = rows.clamp(max=rows_total - 1)
        wk = torch.where(ok[:, None], words_k[safe], 0)
        wv = torch.where(ok[:, None], words_v[safe], 0)
        meta = [torch.where(ok, t[safe], 0.0) for t in (k_scale, k_zero, v_scale, v_zero)]
        dots = sum(k_codes(wk, j) @ fixed[j] for j in range(4)).float()  # exact: int64 here, int32 there
        dots = (dots + key_vector(meta[1])[:, None] * neg_q_sum[None, :]) * unit[None, :]
        scores = dots * (key_vector(meta[0]) * SM_SCALE * 1.4426950408889634)[:, None]
        scores = torch.where(key_vector(ok)[:, None], scores, float("-inf"))
        m_new = torch.maximum(m_i, scores.amax(0))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp2(m_i - m_safe)
        p = torch.exp2(scores - m_safe[None, :])
        m_i = m_new
        w = (p * key_vector(meta[2])[:, None]).bfloat16().float()
        l_part = l_part * alpha + lane_sum(p)
        w_part = w_part * alpha + lane_sum(w)
        wz_part = wz_part * alpha + lane_sum(w * key_vector(meta[3])[:, None])
        w_op = weights_operand(w)
        acc = [a * alpha[None, :] + v_codes(wv, j) @ w_op for j, a in enumerate(acc)]
    l_i, w_sum, wz_sum = l_part.sum(0), w_part.sum(0), wz_part.sum(0)
    out = torch.zeros(8, 128)
    m = torch.arange(32)
    for j, f in enumerate(V_FACTORS):
        out[:, 32 * j + 4 * (m % 8) + m // 8] = (acc[j] / f - wz_sum[None, :] - OFFSET / f * w_sum[None, :]).T
    return out[:GROUP] / l_i[:GROUP, None]


def main() -> None:
    torch.manual_seed(0)
    args, options = _decode_inputs(1, GROUP, 1, 128, 0, 200, 0, 0, torch.bfloat16, 2, 2, seed=3)
    q, _, _, kc, ks, kz, vc, vs, vz, *_ = args
    want = decode_attention_reference(*[a.float() if a.is_floating_point() else a for a in args], sm_scale=SM_SCALE,
                                      **options)[0].float()  # fmt: skip
    words = [c[0, 0].contiguous().view(torch.int32) for c in (kc, vc)]
    meta = [t[0, 0, :, 0].float() for t in (ks, kz, vs, vz)]
    got = span(q[0].float(), words[0], words[1], *meta)
    print(f"max abs difference {(got - want).abs().max().item():.2e} at outputs up to {want.abs().max().item():.2f}")


if __name__ == "__main__":
    main()
