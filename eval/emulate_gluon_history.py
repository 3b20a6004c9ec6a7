"""The Gluon history span's index algebra, emulated in torch on the CPU (branch gluon-tile's debugging aid).

    python eval/emulate_gluon_history.py

Every layout conversion of ``kernels/decode_history_gluon.py`` is an identity and its reshape /
permute / join / split are logical operations, so its program can be replayed with torch tensors:
the same unpacked code values (``word_unpack_asm``'s elementwise meaning), relabellings, q gather,
affine scores, online softmax, value corrections and output scatter, for one KV head and one split.
It is compared with ``decode_attention_reference`` in float32. A GPU failure of
``tests/test_gluon_history.py`` with this passing points at layouts or the asm, not the algebra.
Measured 2026-12-01: max abs difference 1.1e-4 at outputs up to 2.9.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oscar_hf.kernels.decode_attention import decode_attention_reference
from tests.test_kernels import _decode_inputs

torch.manual_seed(0)
GROUP, OFFSET = 4, 128.0
args, options = _decode_inputs(1, GROUP, 1, 128, 0, 200, 0, 0, torch.bfloat16, 2, 2, seed=3)
q, _, _, kc, ks, kz, vc, vs, vz, *_ = args
sm = 0.088
want = decode_attention_reference(args[0].float(), *[a.float() if a.dtype == torch.bfloat16 and a.dim() == 4 and a.shape[-1] == 128 else a for a in args[1:]], sm_scale=sm, **options).float()[0]
L = kc.shape[2]
words_k = kc[0, 0].contiguous().view(torch.int32)  # [L, 8]
words_v = vc[0, 0].contiguous().view(torch.int32)
bf = lambda x: x

def unpack(words):  # o[4j+b][key, w] = 128 + f_j * code (block j of byte b of word w)
    out = []
    for j in range(4):
        for b in range(4):
            byte = (words >> (8 * b)) & 0xFF
            code = (byte >> (2 * j)) & 3
            f = 4 ** j if j < 3 else 1
            out.append(OFFSET + f * code.float())
    return out

def bytes_of(b0, b1, b2, b3):
    codes = torch.stack([torch.stack([b0, b1], -1), torch.stack([b2, b3], -1)], -1)  # join(join) -> [k, w, x, y]
    return codes.permute(0, 1, 3, 2).reshape(codes.shape[0], 32)

def k_operand(c):  # [64 keys, 32 bytes] -> [32 k, 64 N]
    c = c.reshape(4, 8, 2, 4, 4, 2).permute(1, 0, 2, 4, 3, 5).reshape(64, 32)
    return c.permute(1, 0)

def v_operand(c):  # -> [32 m, 64 K]
    return c.reshape(4, 8, 2, 8, 4).permute(4, 3, 1, 0, 2).reshape(32, 64)

def key_vector(v):
    return v.reshape(4, 8, 2).permute(1, 0, 2).reshape(64)

k = torch.arange(32)
byte = 8 * ((k // 2) % 4) + 2 * (k // 8) + k % 2
qf = torch.zeros(16, 128); qf[:GROUP] = q[0].float()
qb = [bf(qf[:, 32 * j + byte] / (4 ** j if j < 3 else 1)) for j in range(4)]  # [16, 32]
s = [qf[:, 32 * j: 32 * j + 32].sum(1)[:8] for j in range(4)]
q_sum = s[0] + s[1] + s[2] + s[3]
bias = OFFSET * (s[0] + 0.25 * s[1] + 0.0625 * s[2] + s[3])
m_i = torch.full((8,), float('-inf')); l_i = torch.zeros(8); w_sum = torch.zeros(8); wz_sum = torch.zeros(8)
acc = [torch.zeros(32, 8) for _ in range(4)]
score_scale = sm * 1.4426950408889634
for block in range(0, L, 64):
    rows = block + torch.arange(64); ok = rows < L
    def tile(words):
        w = torch.zeros(64, 8, dtype=torch.int32); w[ok] = words[rows[ok]]; return w
    wk, wv = tile(words_k), tile(words_v)
    meta = lambda t: torch.where(ok, torch.nn.functional.pad(t[0, 0, :, 0].float(), (0, 64))[rows], torch.zeros(64))
    kscale, kzero, vscale, vzero = meta(ks), meta(kz), meta(vs), meta(vz)
    o = unpack(wk)
    cb = [bytes_of(*o[4 * j: 4 * j + 4]) for j in range(4)]
    dots = sum(qb[j] @ k_operand(cb[j]) for j in range(4))[:8]  # [8, 64 N]
    scale = key_vector(kscale) * score_scale; zero = key_vector(kzero)
    scores = scale[None] * (dots - bias[:, None] - zero[None] * q_sum[:, None])
    scores = torch.where(key_vector(ok)[None], scores, torch.tensor(float('-inf')))
    m_new = torch.maximum(m_i, scores.max(1).values)
    alpha = torch.exp2(m_i - m_new); p = torch.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + p.sum(1); m_i = m_new
    w = bf(p * key_vector(vscale)[None])
    w_sum = w_sum * alpha + w.sum(1); wz_sum = wz_sum * alpha + (w * key_vector(vzero)[None]).sum(1)
    ov = unpack(wv)
    vb = [bytes_of(*ov[4 * j: 4 * j + 4]) for j in range(4)]
    for j in range(4):
        acc[j] = acc[j] * alpha[None] + v_operand(vb[j]) @ w.permute(1, 0)
out = torch.zeros(8, 128)
rows = torch.arange(32); dims = 4 * (rows % 8) + rows // 8
for j in range(4):
    f = 4 ** j if j < 3 else 1
    out[:, 32 * j + dims] = (acc[j] / f - wz_sum[None] - OFFSET / f * w_sum[None]).permute(1, 0)
got = out[:GROUP] / l_i[:GROUP, None]
print("max abs diff", (got - want).abs().max().item(), "scale", want.abs().max().item())
