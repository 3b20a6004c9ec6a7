"""Triton kernels against their torch references.

Without CUDA the kernels run in Triton's interpreter at small shapes: ``tests/conftest.py`` runs this
module in a pytest process of its own that starts with ``TRITON_INTERPRET=1`` (Triton reads it when
it is first imported). On a GPU the same tests run compiled, plus the large-shape tests.
The write path must match bit for bit; attention within float32 / bfloat16 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install triton): the kernels are untested")

import oscar_hf.kernels._triton as _triton  # noqa: E402
import oscar_hf.kernels.decode_attention as _decode  # noqa: E402
import oscar_hf.kernels.decode_launch as _launch  # noqa: E402
import oscar_hf.kernels.quantize as _quantize  # noqa: E402
import oscar_hf.kernels.quantize_many as _many  # noqa: E402
import oscar_hf.kernels.rotate as _rotate  # noqa: E402
from oscar_hf.kernels.testing import decode_inputs  # noqa: E402
from oscar_hf.quant import QuantizedRows, quantize  # noqa: E402
from tests.kernel_checks import TOLERANCE, run_ptx  # noqa: E402

CUDA = torch.cuda.is_available()
quantize_pack, quantize_pack_reference = _quantize.quantize_pack, _quantize.quantize_pack_reference
quantize_pack_into = _many.quantize_pack_into
decode_attention, decode_attention_reference = _decode.decode_attention, _decode.decode_attention_reference
DecodeTiers = _decode.DecodeTiers

DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="large shapes need a CUDA GPU (compiled Triton)")


def test_kernels_are_selected():
    """Guard against comparing the reference with itself: these tensors must take the Triton path."""
    assert _triton.runs_triton(torch.empty(1, device=DEVICE))


# ------------------------------------------------------------------------------------ write path


def _rows(count: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with heavy-ish tails plus the awkward ones: constant, zero, ties at the clip threshold."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(count, head_dim, generator=generator) * torch.rand(count, 1, generator=generator) * 4
    rows[:, :3] *= 6  # a few outlier channels, as rotated K has before clipping
    rows[1] = 0.75  # constant row: range 0, scale at its floor
    rows[2] = 0.0
    rows[3, : head_dim // 2] = 2.0  # many equal magnitudes around the order statistic
    rows[3, head_dim // 2 :] = -2.0
    return rows.to(dtype).to(DEVICE)


def _assert_same(got, want) -> None:
    assert torch.equal(got.codes, want.codes), f"{(got.codes != want.codes).sum().item()} code bytes differ"
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(got.zero, want.zero)


def test_launch_traits_separate_what_triton_specialises_on():
    """Arguments that would get different binaries from Triton never share a cached one."""
    traits = _triton._argument_traits
    data = torch.zeros(64, dtype=torch.uint8)
    assert traits((data, 32)) == traits((data, 48))  # same alignment and divisibility: one binary
    assert traits((data,)) != traits((data[1:],))  # 16-byte alignment of a pointer
    assert traits((32,)) != traits((33,)) != traits((1,))  # divisibility by 16, the value 1
    assert traits((2**31,)) != traits((2**31 - 16,)) and traits((2**63,)) != traits((2**62,))  # widths
    assert traits((data.float(),)) != traits((data,))  # dtypes
    assert traits((True,)) != traits((1,)) and traits((None,)) != traits((0,))
    assert traits(((32, 48),)) == traits(((32, 48),)) != traits(((32, 47),))  # tuples (strides) by value
    assert traits((0.5,)) != traits((0.25,))  # floats by value too: finer than Triton, never coarser
    keyable = _triton._keyable
    assert keyable((data, 3, (1, 2), 0.5, True, None)) and not keyable(("text",)) and not keyable(((1, "text"),))


@gpu_only
def test_cached_launches_follow_alignment_and_lengths():
    """Launches that reuse a binary and launches that need another both match the reference."""
    flat = (torch.randn(1024 * 128 + 8, device=DEVICE) * 3).bfloat16()
    aligned, shifted = flat[: 1024 * 128].view(1024, 128), flat[1 : 1 + 1024 * 128].view(1024, 128)  # 2 bytes off
    for view in (aligned, aligned, shifted, aligned[:997], shifted[:997], aligned):
        _assert_same(quantize_pack(view, 2, 128, clip_ratio=0.96), quantize(view, 2, 128, clip_ratio=0.96))
    assert len(_triton._COMPILED[_quantize._quantize_pack_kernel]) >= 3


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("clip_ratio", [0.0, 0.5, 0.92])  # 0.5: bisection; 0.92: peeling (256: bisection)
@pytest.mark.parametrize("groups", [1, 2])
def test_quantize_pack_bit_exact(head_dim, bits, symmetric, clip_ratio, groups):
    rows = _rows(19, head_dim, torch.bfloat16, seed=head_dim + bits)  # 19 rows: a partial second program
    group_size = head_dim // groups
    got = quantize_pack(rows, bits, group_size, symmetric=symmetric, clip_ratio=clip_ratio)
    want = quantize_pack_reference(rows, bits, group_size, symmetric=symmetric, clip_ratio=clip_ratio)
    _assert_same(got, want)


@pytest.mark.parametrize("head_dim, clip_ratio, groups", [(64, 0.0, 1), (128, 0.92, 2), (16, 0.0, 1)])
def test_quantize_pack_1bit_bit_exact(head_dim, clip_ratio, groups):
    """Sigma levels: the kernel's pairwise sums, square root and metadata equal the torch reference's."""
    rows = _rows(19, head_dim, torch.bfloat16, seed=head_dim + 1)
    group_size = head_dim // groups
    got = quantize_pack(rows, 1, group_size, clip_ratio=clip_ratio, metadata_dtype=torch.float32)
    want = quantize_pack_reference(rows, 1, group_size, clip_ratio=clip_ratio, metadata_dtype=torch.float32)
    assert got.codes.shape == (19, head_dim // 8)
    _assert_same(got, want)
    _assert_same(
        quantize_pack(rows, 1, group_size, clip_ratio=clip_ratio), quantize(rows, 1, group_size, clip_ratio=clip_ratio)
    )


# A constant group has scale 1e-8/3, so its zero-point overflows float16 to -inf, in the reference too.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize(
    "dtype, metadata_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)],
)
def test_quantize_pack_dtypes_and_leading_dims(dtype, metadata_dtype):
    rows = _rows(2 * 3 * 5, 128, dtype, seed=7).view(2, 3, 5, 128)  # [B, H, T, D], as the cache passes them
    got = quantize_pack(rows, 2, 32, clip_ratio=0.96, metadata_dtype=metadata_dtype)
    want = quantize(rows, 2, 32, clip_ratio=0.96, metadata_dtype=metadata_dtype)
    assert got.codes.shape == (2, 3, 5, 32) and got.scale.dtype == metadata_dtype
    _assert_same(got, want)


def test_quantize_pack_strided_and_empty_rows():
    window = _rows(12, 64, torch.bfloat16, seed=3).view(2, 6, 64)[:, 1:4]  # a view, like RowBuffer.view()
    _assert_same(quantize_pack(window, 4, 64, clip_ratio=0.96), quantize(window, 4, 64, clip_ratio=0.96))
    empty = quantize_pack(window[:, :0], 2, 64)
    assert empty.codes.shape == (2, 0, 16) and empty.scale.shape == (2, 0, 1)


def test_quantize_pack_falls_back_and_validates():
    rows = _rows(4, 96, torch.bfloat16, seed=1)  # 96 is no power of two: the torch reference runs
    _assert_same(quantize_pack(rows, 2, 96, clip_ratio=0.96), quantize(rows, 2, 96, clip_ratio=0.96))
    with pytest.raises(ValueError, match="group_size"):
        quantize_pack(rows, 2, 40)
    with pytest.raises(ValueError, match="bit width"):
        quantize_pack(rows, 5, 96)


@pytest.mark.parametrize(
    "bits, groups, symmetric", [(2, 1, False), (4, 2, False), (2, 2, True), (3, 2, False), (1, 1, False)]
)
def test_quantize_pack_into_many_views_bit_exact(bits, groups, symmetric, monkeypatch):
    """One launch over strided views of several buffers (every layer's demoted rows) = quantize per job."""
    monkeypatch.setattr(_many, "quantize_pack_many_reference", None)  # the kernel must serve these jobs
    head_dim, group_size = 64, 64 // groups
    generator = torch.Generator().manual_seed(bits + groups)
    buffers = [(torch.randn(2, 3, 11, head_dim, generator=generator) * 3).bfloat16().to(DEVICE) for _ in range(3)]
    sources = [buffer[:, :, start : start + 5] for buffer, start in zip(buffers, (0, 4, 6))]  # windows' oldest rows
    ratios = [0.9, 0.0, 0.96]

    def history(capacity):  # destinations: views in the middle of larger history buffers
        codes = torch.zeros(2, 3, capacity, head_dim * bits // 8, dtype=torch.uint8, device=DEVICE)
        meta = torch.zeros(2, 3, capacity, groups, dtype=torch.bfloat16, device=DEVICE)
        return codes, meta, meta.clone()

    stores = [history(9 + i) for i in range(3)]
    targets = [QuantizedRows(c[:, :, 2:7], s[:, :, 2:7], z[:, :, 2:7]) for c, s, z in stores]
    quantize_pack_into(sources, targets, bits, group_size, symmetric=symmetric, clip_ratios=ratios)
    for source, target, ratio, (codes, scale, _) in zip(sources, targets, ratios, stores):
        _assert_same(target, quantize(source, bits, group_size, symmetric=symmetric, clip_ratio=ratio))
        assert not codes[:, :, :2].any() and not codes[:, :, 7:].any() and not scale[:, :, 7:].any()  # only its rows


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "reference"])
def test_window_quantizer_reads_its_rows_on_the_device(use_kernel, monkeypatch):
    """Static decoding's demotion: rows and whether anything happens come from a device tensor."""
    if not use_kernel:
        monkeypatch.setattr(_many, "runs_triton", lambda tensor: False)
    generator = torch.Generator().manual_seed(3)
    rings = [(torch.randn(2, 3, 16, 64, generator=generator) * 3).bfloat16().to(DEVICE) for _ in range(2)]
    histories = [
        QuantizedRows(
            torch.zeros(2, 3, 20, 16, dtype=torch.uint8, device=DEVICE),
            *(torch.zeros(2, 3, 20, 1, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)),
        )
        for _ in range(2)
    ]
    window = torch.tensor([0, 8, 12], device=DEVICE)
    demote = _many.WindowQuantizer(rings, histories, 4, window, 2, 64, clip_ratios=[0.9, 0.0])
    assert (demote.table is not None) == use_kernel
    demote()  # inactive: nothing written
    assert not any(h.codes.any() or h.scale.any() for h in histories)
    window.copy_(torch.tensor([1, 8, 12]))
    demote()
    for ring, history, ratio in zip(rings, histories, [0.9, 0.0]):
        want = quantize(ring[:, :, 8:12], 2, 64, clip_ratio=ratio)
        _assert_same(QuantizedRows(*(t[:, :, 12:16] for t in (history.codes, history.scale, history.zero))), want)
        assert not history.codes[:, :, :12].any() and not history.scale[:, :, 16:].any()


def _feedback_factor(heads: int | None, head_dim: int, seed: int) -> torch.Tensor:
    """A factor of a random query covariance with a few strong channels, ``[D, D]`` or ``[heads, D, D]``."""
    from oscar_hf.quant import feedback_factor

    generator = torch.Generator().manual_seed(seed)
    shape = (heads or 1, head_dim, head_dim)
    queries = torch.randn(*shape, generator=generator) * torch.linspace(4, 0.2, head_dim)
    factor = feedback_factor(queries @ queries.mT / head_dim)
    return (factor if heads else factor[0]).to(DEVICE).contiguous()


@pytest.mark.parametrize("bits, groups, per_head", [(2, 1, True), (3, 2, False), (4, 1, True)])
def test_quantize_pack_feedback_bit_exact(bits, groups, per_head, monkeypatch):
    """Error feedback in one launch (views of several buffers, a factor per job and KV head) = the torch quantizer."""
    monkeypatch.setattr(_many, "quantize_pack_many_reference", None)  # the kernel must serve these jobs
    head_dim, group_size = 32, 32 // groups
    generator = torch.Generator().manual_seed(bits)
    buffers = [(torch.randn(2, 3, 9, head_dim, generator=generator) * 3).bfloat16().to(DEVICE) for _ in range(2)]
    sources = [buffer[:, :, start : start + 5] for buffer, start in zip(buffers, (0, 3))]
    factors = [_feedback_factor(3 if per_head else None, head_dim, seed) for seed in (1, 2)]
    targets = [quantize_pack(source, bits, group_size) for source in sources]  # right shapes, overwritten
    quantize_pack_into(sources, targets, bits, group_size, clip_ratios=[0.9, 0.0], feedback=factors)
    for source, target, ratio, factor in zip(sources, targets, [0.9, 0.0], factors):
        want = quantize(source, bits, group_size, clip_ratio=ratio, feedback=factor)
        _assert_same(target, want)
        assert not torch.equal(target.codes, quantize(source, bits, group_size, clip_ratio=ratio).codes)
    rows = sources[0].float()  # one call (what calibration's round trips take) runs the same launch
    _assert_same(
        quantize_pack(rows, bits, group_size, clip_ratio=0.9, feedback=factors[0]),
        quantize(rows, bits, group_size, clip_ratio=0.9, feedback=factors[0]),
    )


def test_window_quantizer_feeds_errors_forward():
    """Static decoding's demotion with key feedback writes what the eager cache's quantizer writes."""
    generator = torch.Generator().manual_seed(4)
    ring = (torch.randn(1, 2, 16, 32, generator=generator) * 3).bfloat16().to(DEVICE)
    history = quantize_pack(torch.zeros(1, 2, 12, 32, device=DEVICE), 2, 32)
    factor = _feedback_factor(2, 32, 5)
    window = torch.tensor([1, 4, 8], device=DEVICE)
    _many.WindowQuantizer([ring], [history], 4, window, 2, 32, clip_ratios=[0.9], feedback=[factor])()
    want = quantize(ring[:, :, 4:8], 2, 32, clip_ratio=0.9, feedback=factor)
    _assert_same(QuantizedRows(*(t[:, :, 8:12] for t in (history.codes, history.scale, history.zero))), want)


def test_quantize_pack_into_validates_jobs():
    rows = torch.randn(1, 2, 4, 64, device=DEVICE)
    target = QuantizedRows(
        torch.empty(1, 2, 4, 16, dtype=torch.uint8, device=DEVICE),
        *(torch.empty(1, 2, 4, 1, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)),
    )
    with pytest.raises(ValueError, match="one entry per job"):
        quantize_pack_into([rows], [target], 2, 64, clip_ratios=[])
    with pytest.raises(ValueError, match="does not fit"):
        quantize_pack_into([rows], [target], 4, 64, clip_ratios=[0.0])
    with pytest.raises(ValueError, match="share shape"):
        quantize_pack_into([rows, rows[:, :, :2]], [target, target], 2, 64, clip_ratios=[0.0, 0.0])
    with pytest.raises(ValueError, match="one factor per job"):
        quantize_pack_into([rows], [target], 2, 64, clip_ratios=[0.0], feedback=[])
    with pytest.raises(ValueError, match="does not fit rows"):
        quantize_pack_into([rows], [target], 2, 64, clip_ratios=[0.0], feedback=[torch.eye(64, device=DEVICE)[None]])
    with pytest.raises(ValueError, match="float32 and contiguous"):
        quantize_pack_into([rows], [target], 2, 64, clip_ratios=[0.0], feedback=[torch.eye(64, device=DEVICE).double()])


# -------------------------------------------------------------------------------------- rotation


def _rotation(head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))[0]
        .to(dtype)
        .to(DEVICE)
    )


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch, q_heads, kv_heads", [(1, 4, 1), (3, 9, 3), (2, 32, 8)])  # 9 rows: a partial block
def test_rotate_rows_matches_torch(head_dim, dtype, batch, q_heads, kv_heads):
    """q (a transposed projection), K into a window row of a larger buffer, V by a transposed R."""
    generator = torch.Generator().manual_seed(head_dim + q_heads)
    query = torch.randn(batch, 1, q_heads, head_dim, generator=generator).to(dtype).to(DEVICE).transpose(1, 2)
    keys, values = (torch.randn(batch, kv_heads, 1, head_dim, generator=generator).to(dtype).to(DEVICE) for _ in "kv")
    key_rotation, value_rotation = _rotation(head_dim, dtype, 1), _rotation(head_dim, dtype, 2).T
    window = torch.full((batch, kv_heads, 7, head_dim), 5.0, dtype=dtype, device=DEVICE)
    jobs = [
        (query, key_rotation, torch.empty(batch, q_heads, head_dim, dtype=dtype, device=DEVICE)),
        (keys, key_rotation, window[:, :, 3:4]),
        (values, value_rotation, torch.empty_like(values)),
    ]
    _rotate.rotate_rows(jobs)
    for rows, rotation, got in jobs:
        want = (rows.double() @ rotation.double()).view(got.shape)
        # one rounding to the output dtype (float32 accumulation in another order: a last bit at most)
        tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=2**-7)
        torch.testing.assert_close(got.double(), want, **tolerance)
    untouched = torch.cat([window[:, :, :3], window[:, :, 4:]], dim=2)
    assert bool((untouched == 5.0).all())


def test_rotate_rows_one_job_and_validation():
    rows = torch.randn(2, 3, 64, device=DEVICE)
    rotation, out = _rotation(64, torch.float32, 3), torch.empty(2, 3, 64, device=DEVICE)
    _rotate.rotate_rows([(rows, rotation, out)])
    torch.testing.assert_close(out, rows @ rotation, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="1 to 3 jobs"):
        _rotate.rotate_rows([(rows, rotation, out)] * 4)
    with pytest.raises(ValueError, match="does not match"):
        _rotate.rotate_rows([(rows, rotation.double(), out)])
    with pytest.raises(ValueError, match="same B, H, D"):
        _rotate.rotate_rows([(rows, rotation, out[:1])])
    odd = torch.randn(2, 3, 80, device=DEVICE)  # not a power of two: the torch reference
    odd_out = torch.empty_like(odd)
    _rotate.rotate_rows([(odd, _rotation(80, torch.float32, 4), odd_out)])
    torch.testing.assert_close(odd_out, odd @ _rotation(80, torch.float32, 4))


@pytest.mark.parametrize("per_head_mean", [True, False])
def test_key_centering_through_the_kernels(per_head_mean):
    """A cache's centered keys through the rotate and decode kernels: attention unchanged before quantization."""
    from tests.test_key_centering import assert_centering_invariant

    assert_centering_invariant(DEVICE, per_head_mean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_rotate_rows_subtracts_a_center_before_rounding(dtype, per_head):
    """A job with a center writes ``rows @ R - center`` (one center row per head, or one for all), rounded
    once, as the reference; the other jobs of the launch are untouched by it."""
    batch, q_heads, kv_heads, head_dim = 2, 6, 3, 64
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(batch, q_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    keys = torch.randn(batch, kv_heads, 1, head_dim, generator=generator).to(dtype).to(DEVICE)
    rotations = torch.stack([_rotation(head_dim, dtype, 30 + h) for h in range(kv_heads)])
    rotation = rotations if per_head else rotations[0]  # a center per head with either
    center = (torch.randn(kv_heads, head_dim, generator=generator) * 5).to(dtype).to(DEVICE)

    def run(rotate):
        jobs = [
            (query, rotation, torch.empty_like(query)),
            (keys, rotation, torch.empty_like(keys), center),
        ]
        rotate(jobs)
        return [job[2] for job in jobs]

    (query_out, keys_out), (query_ref, keys_ref) = run(_rotate.rotate_rows), run(_rotate.rotate_rows_reference)
    per_row = rotation if per_head else rotation.expand(kv_heads, -1, -1)
    want = torch.stack([keys[:, h, 0].double() @ per_row[h].double() - center[h].double() for h in range(kv_heads)], 1)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=2**-7)
    torch.testing.assert_close(keys_out[:, :, 0].double(), want, **tolerance)
    torch.testing.assert_close(keys_out.double(), keys_ref.double(), **tolerance)
    torch.testing.assert_close(query_out.double(), query_ref.double(), **tolerance)
    shared = torch.empty_like(keys)
    _rotate.rotate_rows([(keys, rotation, shared, center[1])])  # one center for every head
    torch.testing.assert_close(shared[:, 1].double(), keys_out[:, 1].double(), **tolerance)
    with pytest.raises(ValueError, match="center"):
        _rotate.rotate_rows([(keys, rotation, torch.empty_like(keys), center[..., :32])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch, q_heads, kv_heads", [(1, 9, 3), (3, 4, 2), (2, 8, 8)])  # group 3, 2 and 1
def test_rotate_rows_per_kv_head(dtype, batch, q_heads, kv_heads):
    """Per-KV-head rotations: row (b, h) uses R[h // group], in one launch; equal to the reference, and
    heads that all hold one R give exactly the shared R's results (a transposed R_V^T view included)."""
    head_dim, generator = 64, torch.Generator().manual_seed(q_heads)
    query = torch.randn(batch, 1, q_heads, head_dim, generator=generator).to(dtype).to(DEVICE).transpose(1, 2)
    keys, values = (torch.randn(batch, kv_heads, 1, head_dim, generator=generator).to(dtype).to(DEVICE) for _ in "kv")
    key_rotation = torch.stack([_rotation(head_dim, dtype, 10 + h) for h in range(kv_heads)])
    value_rotation = torch.stack([_rotation(head_dim, dtype, 20 + h) for h in range(kv_heads)]).mT

    def run(rotate, k_rotation, v_rotation):
        jobs = [
            (query, k_rotation, torch.empty(batch, q_heads, head_dim, dtype=dtype, device=DEVICE)),
            (keys, k_rotation, torch.empty_like(keys)),
            (values, v_rotation, torch.empty_like(values)),
        ]
        rotate(jobs)
        return [out for _, _, out in jobs]

    got = run(_rotate.rotate_rows, key_rotation, value_rotation)
    group = q_heads // kv_heads
    direct = [
        torch.stack([query[:, h] @ key_rotation[h // group] for h in range(q_heads)], dim=1),
        torch.stack([keys[:, h] @ key_rotation[h] for h in range(kv_heads)], dim=1),
        torch.stack([values[:, h] @ value_rotation[h] for h in range(kv_heads)], dim=1),
    ]
    reference = run(_rotate.rotate_rows_reference, key_rotation, value_rotation)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=2**-7)
    for out, want, ref in zip(got, direct, reference):
        torch.testing.assert_close(out.double(), want.view(out.shape).double(), **tolerance)
        torch.testing.assert_close(out.double(), ref.double(), **tolerance)
    shared_k, shared_v = key_rotation[0], value_rotation[0]
    equal_heads = run(_rotate.rotate_rows, shared_k.expand(kv_heads, -1, -1), shared_v.expand(kv_heads, -1, -1))
    for out, want in zip(equal_heads, run(_rotate.rotate_rows, shared_k, shared_v)):
        if dtype == torch.bfloat16:
            assert torch.equal(out, want)
        else:  # a row sits elsewhere in its block, and numpy's float32 matmul (interpreter) may then round it
            torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)  # differently in its last bit
    with pytest.raises(ValueError, match="H_r dividing the heads"):
        _rotate.rotate_rows([(query, torch.stack([shared_k] * 2 * q_heads), torch.empty_like(query))])


# ------------------------------------------------------------------------------ decode attention


def _decode_inputs(*shape, **options):
    """:func:`oscar_hf.kernels.testing.decode_inputs` on this module's device."""
    return decode_inputs(*shape, **options, device=DEVICE)


def _op(q, tiers, sm_scale, splits, block_n=16, num_warps=0):
    """``torch.ops.oscar.decode_attention``: the kernels with the launch knobs the dispatcher picks itself."""
    return torch.ops.oscar.decode_attention(
        q,
        *tiers.flat(),
        tiers.key_mask,
        tiers.k_bits,
        tiers.v_bits,
        sm_scale,
        splits,
        block_n,
        num_warps,
        0,
        tiers.lengths,
    )


# (batch, q heads, kv heads, head_dim, sink, history, recent, new, splits, block_n, pads, k/v bits, k/v groups)
DECODE_CASES = {
    "empty-history-mha": (1, 2, 2, 64, 4, 0, 3, 1, 0, 16, None, (4, 2), (1, 1)),
    "history-below-one-block-gqa3": (2, 6, 2, 64, 5, 7, 9, 1, 0, 16, None, (4, 2), (1, 1)),
    "several-splits-gqa4-padded-sink": (3, 8, 2, 64, 8, 150, 20, 1, 3, 16, [0, 5, 8], (4, 2), (1, 2)),
    "multi-block-splits-gqa8": (1, 16, 2, 128, 4, 100, 5, 1, 2, 16, None, (4, 2), (2, 1)),
    "auto-splits-int2-both-block64": (2, 8, 2, 128, 3, 40, 17, 1, 0, 64, [2, 0], (2, 2), (1, 1)),
    "no-sink-no-recent": (1, 4, 1, 64, 0, 33, 0, 1, 0, 16, None, (2, 4), (2, 2)),
    "head-dim-256": (1, 4, 1, 256, 4, 20, 6, 1, 2, 16, [1], (4, 2), (1, 2)),
    # block_n 0: the launcher's tiles (128 keys), here with a partial last tile
    "default-tiles-int2-gqa4": (2, 8, 2, 128, 4, 300, 9, 1, 0, 0, None, (2, 2), (1, 1)),
    "default-tiles-int4-head-dim-256": (1, 8, 2, 256, 4, 200, 5, 1, 0, 0, [1], (4, 4), (1, 1)),
    # 3-bit codes: a 2-bit plane and a 1-bit plane, unpacked in 4 column blocks like 2-bit codes
    "int3-keys-head-dim-64-padded": (2, 6, 2, 64, 5, 70, 9, 1, 2, 16, [0, 3], (3, 2), (1, 1)),
    "int3-keys-default-tiles-gqa4": (2, 8, 2, 128, 4, 300, 9, 1, 0, 0, None, (3, 2), (1, 1)),
    "int3-both-grouped-no-windows": (1, 4, 1, 64, 0, 33, 0, 1, 0, 16, None, (3, 3), (2, 4)),
    "int3-keys-int4-values-gqa8": (1, 16, 2, 128, 4, 100, 5, 1, 2, 16, [1], (3, 4), (4, 2)),
    # 1-bit codes: one plane, unpacked in 4 column blocks like the 3-bit codes' high plane
    "int4-keys-int1-values-padded": (2, 6, 2, 64, 5, 70, 9, 1, 2, 16, [0, 3], (4, 1), (1, 1)),
    "int1-keys-grouped-int1-values-default-tiles": (1, 8, 2, 128, 4, 150, 9, 1, 0, 0, None, (1, 1), (4, 2)),
}


def _run_decode_case(case, dtype, num_warps=0):
    batch, hq, hkv, dim, sink, hist, recent, new, splits, block_n, pads, (kb, vb), (kg, vg) = case
    q, tiers = _decode_inputs(batch, hq, hkv, dim, sink, hist, recent, new, dtype, kb, vb, kg, vg, pads)
    scale = dim**-0.5
    got = _op(q, tiers, scale, splits, block_n, num_warps)
    want = decode_attention_reference(q, tiers, sm_scale=scale)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_attention_matches_reference(name, dtype):
    got, want = _run_decode_case(DECODE_CASES[name], dtype)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_unpack_ptx_gives_offset_plus_factor_times_code(bits, dtype):
    """The compiled kernels' PTX unpack (GPU only) against its specification, on every byte value:
    block j of byte i (bits j*S.., S = block_shift: 4 for 4-bit codes, else 2; 3-bit codes add bit j*S
    of the high plane's byte as their bit 2) comes out as OFFSET + 2**(j*S) * code for the shift-free
    blocks, else OFFSET + code, in output register 2j (bytes 0, 1) or 2j + 1 (bytes 2, 3). 1- and 3-bit
    codes take the 1-bit plane's bytes shifted right by one where the ``odd`` operand is 1."""
    from oscar_hf.kernels.decode_unpack import CODE_MAGIC, block_shift, shift_free_blocks, unpack_asm

    ptx, free, offset = unpack_asm(bits, dtype), shift_free_blocks(bits, dtype), CODE_MAGIC[dtype][1]
    shift, low_bits = block_shift(bits), 2 if bits == 3 else bits
    blocks, planes = 8 // shift, 2 if bits == 3 else 1
    assert free >= 1 and ptx.count("shr") == (bits in (1, 3)) + 2 * (blocks - free) * planes
    for first, odd in itertools.product(range(0, 256, 4), [0, 1] if bits in (1, 3) else [0]):
        low = bytes([first, first + 1, first + 2, first + 3])
        for high in [b"\x00" * 4, b"\xff" * 4, b"\x55\xaa\x0f\xf0", low[::-1]] if bits == 3 else [low]:
            words = [low] + ([high] if bits == 3 else []) + ([bytes([odd] * 4)] if bits in (1, 3) else [])
            registers = run_ptx(ptx, {f"${2 * blocks + k}": int.from_bytes(w, "little") for k, w in enumerate(words)})
            plane = bytes(byte >> odd for byte in (high if bits == 3 else low))
            for j in range(blocks):
                halves = [
                    registers[f"${2 * j}"] & 0xFFFF,
                    registers[f"${2 * j}"] >> 16,
                    registers[f"${2 * j + 1}"] & 0xFFFF,
                    registers[f"${2 * j + 1}"] >> 16,
                ]
                got = torch.tensor(halves, dtype=torch.int32).to(torch.int16).view(dtype).float()
                source = plane if bits == 1 else low
                codes = [(source[i] >> (j * shift)) & ((1 << low_bits) - 1) for i in range(4)]
                if bits == 3:
                    codes = [code | ((plane[i] >> (j * shift)) & 1) << 2 for i, code in enumerate(codes)]
                factor = 2 ** (j * shift) if j < free else 1
                assert torch.equal(got, offset + factor * torch.tensor(codes).float()), (j, first, high, odd)


@pytest.mark.parametrize("num_warps", [1, 2])
@pytest.mark.parametrize("name", ["several-splits-gqa4-padded-sink", "head-dim-256"])
def test_decode_attention_with_fewer_warps(name, num_warps):
    # the launcher's default is 4 warps (tuning knob); the layouts change with the warp count
    got, want = _run_decode_case(DECODE_CASES[name], torch.bfloat16, num_warps)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("k_bits, v_bits", [(3, 1), (2, 1)])
def test_decode_attention_copies_code_rows_that_start_off_their_alignment(k_bits, v_bits):
    """The kernel takes packed rows to start a multiple of head_dim / 8 bytes apart (so that rows of 8 or
    24 bytes load as vectors); a codes view whose rows are a byte further apart is copied first, with
    the same result."""
    q, tiers = _decode_inputs(1, 4, 2, 64, 4, 90, 6, 1, torch.float32, k_bits=k_bits, v_bits=v_bits)

    def padded(rows: QuantizedRows) -> QuantizedRows:
        wide = torch.zeros(*rows.codes.shape[:-1], rows.codes.shape[-1] + 1, dtype=torch.uint8, device=DEVICE)
        wide[..., :-1] = rows.codes
        return dataclasses.replace(rows, codes=wide[..., :-1])

    odd = dataclasses.replace(tiers, history_k=padded(tiers.history_k), history_v=padded(tiers.history_v))
    assert odd.history_v.codes.stride(-2) % 8
    torch.testing.assert_close(_op(q, odd, 0.125, 3), _op(q, tiers, 0.125, 3), atol=0, rtol=0)


def test_decode_attention_splits_do_not_change_the_result():
    """The log-sum-exp merge is exact: 1 split and 5 splits agree to float32 rounding."""
    q, tiers = _decode_inputs(1, 4, 2, 64, 4, 90, 6, 1, torch.float32, pads=[2])
    one, five = _op(q, tiers, 0.125, 1), _op(q, tiers, 0.125, 5)
    # float32 rounding, amplified a little by the zero-point corrections of the packed tiles
    torch.testing.assert_close(one, five, atol=5e-6, rtol=1e-4)


def test_a_launch_variant_changes_how_the_merge_runs_not_its_result():
    """``decode_launch.LaunchVariant`` (kernels/tools/time_gluon_history.py): a smaller merge tile splits
    the merge into narrower blocks of dims (8 here instead of 32), the same output."""
    q, tiers = _decode_inputs(1, 4, 2, 64, 4, 90, 6, 1, torch.float32, pads=[2])
    args, knobs = (q, *tiers.flat()), (tiers.key_mask, 4, 2, 0.125, 5, 16, 0, 0)
    default = _launch.decode_attention_triton(*args, *knobs)
    narrow = _launch.decode_attention_triton(
        *args, *knobs, launch_variant=_launch.LaunchVariant(merge_tile=64, merge_warps=1)
    )
    torch.testing.assert_close(narrow, default, atol=1e-6, rtol=1e-6)


def test_the_gluon_span_fills_its_wave_and_the_triton_history_is_capped(monkeypatch):
    """History splits on an H200 (132 SMs) at the kernel benchmark's 100K (99,679 rows) and 8 KV heads:
    the span's 16 programs an SM give 260 splits of 6 tiles (the old cap of 256 left 223 of 7); the
    Triton stage 1 stays within ``_MAX_SPLITS``."""
    monkeypatch.setattr(_launch, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert _launch._splits(99_679, 0, 8, cuda, 64, 16, None) == (260, 384)
    assert _launch._splits(99_679, 0, 8, cuda, 64, 16, 256) == (223, 448)
    assert _launch._splits(10**6, 0, 1, cuda, 64, 8, _launch._MAX_SPLITS)[0] <= _launch._MAX_SPLITS
    assert _launch._splits(10**6, 0, 1, cuda, 64, 8, None)[0] > _launch._MAX_SPLITS  # a wave of 1,056


def test_decode_attention_merges_more_than_256_slots():
    """Beyond 256 slots the merge narrows its block of dims (its tile stays 8,192 floats); still exact."""
    q, tiers = _decode_inputs(1, 2, 1, 64, 4, 16 * 270, 6, 1, torch.float32)
    many = _op(q, tiers, 0.125, 270)  # 270 + 3 slots: 512 in the merge
    want = decode_attention_reference(q, tiers, sm_scale=0.125)
    torch.testing.assert_close(many, want, **TOLERANCE[torch.float32])


@gpu_only
def test_eager_calls_of_one_shape_share_slot_buffers_not_outputs():
    """Consecutive eager calls reuse the partial buffers (_launch._partials) and keep their own outputs."""
    calls = [_decode_inputs(2, 8, 2, 128, 4, 3000, 9, 1, torch.bfloat16, 2, 2, seed=seed) for seed in (1, 2)]
    outputs = [decode_attention(q, tiers) for q, tiers in calls]
    assert outputs[0].data_ptr() != outputs[1].data_ptr() and len(_launch._PARTIALS) >= 1
    for (q, tiers), got in zip(calls, outputs):
        torch.testing.assert_close(got, decode_attention_reference(q, tiers), **TOLERANCE[torch.bfloat16])


def test_decode_attention_dispatcher_and_masked_rows():
    q, tiers = _decode_inputs(2, 4, 2, 64, 3, 10, 4, 1, torch.float32)
    mask = torch.ones(2, 18, dtype=torch.bool, device=DEVICE)
    mask[1] = False  # a row with nothing to attend to gives zeros, not NaN
    tiers = dataclasses.replace(tiers, key_mask=mask)
    got = decode_attention(q, tiers)
    torch.testing.assert_close(got, decode_attention_reference(q, tiers), **TOLERANCE[torch.float32])
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    with pytest.raises(ValueError, match="key_mask"):
        decode_attention(q, dataclasses.replace(tiers, key_mask=mask[:, 1:]))


@pytest.mark.parametrize("tier", ["sink", "history scale", "recent", "new"])
def test_a_non_finite_key_reaches_the_outputs_of_its_kv_head(tier):
    """A NaN in one key of KV head 0 makes the outputs of that head's query heads NaN, as SDPA's math
    does, on the kernel path and in its reference; the other KV head's stay finite."""
    q, tiers = _decode_inputs(1, 4, 2, 64, 3, 40, 4, 1, torch.float32, k_bits=2, v_bits=2)
    poisoned = {
        "sink": tiers.sink_k,
        "history scale": tiers.history_k.scale,
        "recent": tiers.recent_k,
        "new": tiers.new_k,
    }
    poisoned[tier][0, 0, 0] = float("nan")
    scale = 64**-0.5
    got = _op(q, tiers, scale, 3)
    want = decode_attention_reference(q, tiers, sm_scale=scale)
    for out in (got, want):
        assert out[0, :2].isnan().all() and out[0, 2:].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "history, capacity, ring_start, ring_rows, splits, pads, k_bits",
    [
        (40, 72, 5, 9, 3, [0, 3], 2),  # the ring wraps around its end
        (0, 16, 0, 4, 1, None, 2),  # nothing quantized yet
        (33, 33, 8, 11, 0, [2, 0], 2),  # history at capacity, ring full (with the new row)
        (40, 72, 5, 9, 3, [0, 3], 3),  # 3-bit keys
    ],
)
def test_decode_attention_reads_static_lengths_on_the_device(
    history, capacity, ring_start, ring_rows, splits, pads, k_bits, dtype
):
    """Static decoding: history allocated at capacity, recent rows in a ring, lengths in a device tensor.

    The same keys laid out plainly give the reference; garbage fills every slot past the lengths and
    the new row's slot, which the call fills (the ring's lengths count the new row).
    """
    batch, sink, ring_size = 2, 4, 12
    q, tiers = _decode_inputs(batch, 8, 2, 64, sink, history, ring_rows, 1, dtype, k_bits, 2, pads=pads, seed=5)
    sink_k, sink_v, *packed, recent_k, recent_v, new_k, new_v = tiers.flat()
    want = decode_attention_reference(q, tiers, sm_scale=0.125)

    garbage = torch.Generator().manual_seed(9)
    static_packed = []
    for tensor in packed:  # codes, scale, zero of K then V, padded with random rows up to the capacity
        filler = torch.randint(0, 255, (batch, 2, capacity - history, tensor.shape[-1]), generator=garbage)
        static_packed.append(torch.cat([tensor, filler.to(tensor.dtype).to(DEVICE)], dim=2))
    slots = ((ring_start + torch.arange(ring_rows)) % ring_size).to(DEVICE)
    new_slot = (ring_start + ring_rows) % ring_size  # the new token goes to the ring's newest row
    rings = []
    for rows in (recent_k, recent_v):
        ring = (torch.randn(batch, 2, ring_size, 64, generator=garbage) * 50).to(dtype).to(DEVICE)
        ring[:, :, slots] = rows
        rings.append(ring)
    lengths = torch.tensor([history, ring_start, ring_rows + 1], device=DEVICE)
    sink_mask = None if tiers.key_mask is None else tiers.key_mask[:, :sink].contiguous()
    for attend in (functools.partial(_op, splits=splits), decode_attention_reference):
        static_rings = [ring.clone() for ring in rings]
        static = DecodeTiers(
            sink_k,
            sink_v,
            QuantizedRows(*static_packed[:3]),
            QuantizedRows(*static_packed[3:]),
            *static_rings,
            new_k,
            new_v,
            k_bits,
            2,
            sink_mask,
            lengths,
        )
        got = attend(q, static, sm_scale=0.125)
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
        for ring, new in zip(static_rings, (new_k, new_v)):
            assert torch.equal(ring[:, :, new_slot], new[:, :, 0])  # stored by the call


# ------------------------------------------------------------------------------------ custom ops


def test_custom_ops_trace_under_torch_compile():
    rows = _rows(5, 64, torch.bfloat16, seed=2)
    q, tiers = _decode_inputs(1, 4, 2, 64, 2, 9, 3, 1, torch.bfloat16, pads=[1])

    def step(rows, q, tiers):
        packed = quantize_pack(rows * 2, 2, 64, clip_ratio=0.9)
        return packed.codes, packed.scale, decode_attention(q, tiers) + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(rows, q, tiers), step(rows, q, tiers)):
        assert torch.equal(got, want)


def test_custom_ops_pass_opcheck():
    rows = _rows(4, 64, torch.bfloat16, seed=4)
    torch.library.opcheck(torch.ops.oscar.quantize_pack.default, (rows, 4, 32, False, 0.5, torch.bfloat16))
    q, tiers = _decode_inputs(1, 2, 1, 64, 2, 5, 2, 1, torch.float32)
    torch.library.opcheck(torch.ops.oscar.decode_attention.default, (q, *tiers.flat(), None, 4, 2, 0.125, 0, 16, 0, 0))


@pytest.mark.parametrize("per_head", [False, True], ids=["hadamard", "per-head"])
def test_generation_through_the_kernels_matches_the_torch_path(monkeypatch, per_head):
    """A model decoding with OscarCache: kernels (write + decode) against the torch references, per step,
    with a shared Hadamard R or a random R per KV head.

    Also: a decoding step demotes every layer's K and V rows in a single quantize launch.
    """
    from conftest import generate, tiny_model

    import oscar_hf.core.layer
    import oscar_hf.core.layer_attention
    import oscar_hf.core.layer_rotation
    import oscar_hf.core.quantize_jobs
    from oscar_hf import OscarCache

    # oscar_hf bound the kernel functions when it was imported; point it at this module's (interpreted) ones.
    monkeypatch.setattr(oscar_hf.core.layer_attention, "decode_attention", decode_attention)
    monkeypatch.setattr(oscar_hf.core.quantize_jobs, "quantize_pack_into", quantize_pack_into)
    monkeypatch.setattr(oscar_hf.core.layer, "rotate_rows", _rotate.rotate_rows)
    monkeypatch.setattr(oscar_hf.core.layer_rotation, "rotate_rows", _rotate.rotate_rows)
    launches = []
    for module, name in ((_decode, "decode_attention_triton"), (_many, "quantize_pack_many_triton")):
        launcher = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _launch=launcher, _name=name: launches.append(_name) or _launch(*a)
        )
    from oscar_hf import RotationSet

    model = tiny_model("llama", hidden_size=128, head_dim=64, num_hidden_layers=2).to(DEVICE)
    prompt = torch.randint(3, 256, (2, 21), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    method, rotations = "quarot-int2", None
    if per_head:
        kv_heads = model.config.num_key_value_heads
        method, rotations = (
            "oscar-int2",
            RotationSet(
                64,
                *[
                    {
                        i: torch.stack(
                            [_rotation(64, torch.float32, 10 * i + h + offset).cpu() for h in range(kv_heads)]
                        )
                        for i in (0, 1)
                    }
                    for offset in (0, 50)
                ],
            ),
        )
    outputs = []
    for enabled in (True, False):
        monkeypatch.setattr(_triton, "ENABLED", enabled)
        cache = OscarCache(model, method, rotations=rotations, sink=4, recent=8, block=2, decode_graphs=False)
        outputs.append(
            generate(model, prompt, cache, max_new_tokens=12, output_scores=True, return_dict_in_generate=True)
        )
        if enabled:
            demoted_rows = cache.layers[0].history_length - (21 - 4 - 8)  # beyond the prompt's middle rows
            assert demoted_rows > 0 and all(
                layer.history_length == cache.layers[0].history_length for layer in cache.layers
            )
    kernel, torch_path = outputs
    assert launches.count("decode_attention_triton") == 11 * 2  # 11 decoding steps x 2 layers
    # the prompt's middle rows: one launch per layer; then one launch per demoting step for both layers
    assert launches.count("quantize_pack_many_triton") == 2 + demoted_rows // 2
    assert torch.equal(kernel.sequences, torch_path.sequences)
    torch.testing.assert_close(torch.stack(kernel.scores), torch.stack(torch_path.scores), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["quarot-int2", "k3v2", "mixed"])
def test_static_decoding_through_the_kernels_matches_the_eager_torch_path(monkeypatch, method):
    """Static decoding (device lengths, ring, windowed demotion) through the kernels = the eager torch path.

    Compiled on a GPU this is also what a captured graph replays (tests/test_static.py captures one).
    ``k3v2``: oscar-k3v2's 3-bit keys and 2-bit values, with Hadamard rotations. ``mixed``: per-layer
    widths, 4-bit keys in layer 0 and 1-bit values in both layers (oscar-int2's budget).
    """
    from conftest import generate, tiny_model

    import oscar_hf
    import oscar_hf.core.frozen_decoding
    import oscar_hf.core.layer
    import oscar_hf.core.layer_attention
    import oscar_hf.core.layer_rotation
    from oscar_hf import METHODS, OscarCache, RotationSet
    from oscar_hf.core.compat import cache_keyword

    formats, rotations = 1, None  # K and V rows of one format share a demotion launch
    if method == "k3v2":
        method, formats = METHODS["oscar-k3v2"].with_overrides(rotation="hadamard"), 2
    elif method == "mixed":
        method, formats, rotations = "oscar-int2", 3, RotationSet.hadamard(64, [0, 1])
        rotations.key_bits.update({0: 4})
        rotations.value_bits.update({0: 1, 1: 1})

    monkeypatch.setattr(oscar_hf.core.layer_attention, "decode_attention", decode_attention)
    monkeypatch.setattr(oscar_hf.core.layer, "rotate_rows", _rotate.rotate_rows)
    monkeypatch.setattr(oscar_hf.core.layer_rotation, "rotate_rows", _rotate.rotate_rows)
    monkeypatch.setattr(oscar_hf.core.frozen_decoding, "WindowQuantizer", _many.WindowQuantizer)
    launches = []
    launch_decode, launch_quantize = _decode.decode_attention_triton, _many._launch_many
    monkeypatch.setattr(_decode, "decode_attention_triton", lambda *a: launches.append("decode") or launch_decode(*a))
    monkeypatch.setattr(
        _many,
        "_launch_many",  # (on a GPU the prefill's quantize launches come here too)
        lambda *a: launches.append("windowed" if a[7] is not None else "plain") or launch_quantize(*a),
    )
    model = tiny_model("qwen3", hidden_size=128, head_dim=64, num_hidden_layers=2).to(DEVICE)
    prompt = torch.randint(3, 256, (2, 21), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    options = dict(
        max_new_tokens=12, min_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    cache = OscarCache(model, method, rotations=rotations, sink=4, recent=8, block=2)
    with torch.no_grad():
        static = oscar_hf.generate(model, prompt, capture=False, **{cache_keyword(model): cache}, **options)
    monkeypatch.setattr(_triton, "ENABLED", False)
    eager = generate(
        model,
        prompt,
        OscarCache(model, method, rotations=rotations, sink=4, recent=8, block=2, decode_graphs=False),
        **options,
    )
    assert launches.count("decode") == 11 * 2  # 11 static steps x 2 layers
    assert launches.count("windowed") == 11 * formats  # one demotion launch per static step and format (most idle)
    assert torch.equal(static.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(static.scores), torch.stack(eager.scores), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- GPU, large shapes


@gpu_only
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "bits, symmetric, clip_ratio, groups",
    [
        (2, False, 0.96, 1),
        (2, False, 0.92, 2),
        (4, False, 0.96, 1),
        (2, True, 0.0, 4),
        (3, False, 0.96, 1),
        (3, False, 0.0, 2),
        (1, False, 0.0, 1),
        (1, False, 0.0, 2),
    ],
)
def test_quantize_pack_bit_exact_large(head_dim, bits, symmetric, clip_ratio, groups):
    rows = (torch.randn(8, 8, 4096, head_dim, device=DEVICE) * 3).bfloat16()
    group_size = head_dim // groups
    got = quantize_pack(rows, bits, group_size, symmetric=symmetric, clip_ratio=clip_ratio)
    _assert_same(got, quantize(rows, bits, group_size, symmetric=symmetric, clip_ratio=clip_ratio))


@gpu_only
@pytest.mark.parametrize("batch, history", [(1, 100_000), (8, 32_768), (3, 4_099)])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(32, 8, 128), (24, 8, 128), (16, 16, 64), (16, 2, 256)])
def test_decode_attention_large(batch, history, q_heads, kv_heads, head_dim):
    pads = [index * 7 % 64 for index in range(batch)]
    q, tiers = _decode_inputs(batch, q_heads, kv_heads, head_dim, 64, history, 259, 1, torch.bfloat16, pads=pads)
    got = decode_attention(q, tiers)
    torch.testing.assert_close(got.float(), decode_attention_reference(q, tiers).float(), atol=2e-2, rtol=2e-2)


@gpu_only
@pytest.mark.parametrize("batch, history", [(1, 100_000), (3, 4_099)])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(32, 8, 128), (16, 16, 64)])
def test_decode_attention_large_int3_keys(batch, history, q_heads, kv_heads, head_dim):
    pads = [index * 7 % 64 for index in range(batch)]
    q, tiers = _decode_inputs(batch, q_heads, kv_heads, head_dim, 64, history, 259, 1, torch.bfloat16, 3, 2, pads=pads)
    got = decode_attention(q, tiers)
    torch.testing.assert_close(got.float(), decode_attention_reference(q, tiers).float(), atol=2e-2, rtol=2e-2)


@gpu_only
@pytest.mark.parametrize("batch, history", [(1, 100_000), (3, 4_099)])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(32, 8, 128), (16, 16, 64)])
@pytest.mark.parametrize("k_bits, v_bits", [(2, 1), (4, 1)])
def test_decode_attention_large_int1_values(batch, history, q_heads, kv_heads, head_dim, k_bits, v_bits):
    pads = [index * 7 % 64 for index in range(batch)]
    q, tiers = _decode_inputs(
        batch, q_heads, kv_heads, head_dim, 64, history, 259, 1, torch.bfloat16, k_bits, v_bits, pads=pads
    )
    got = decode_attention(q, tiers)
    torch.testing.assert_close(got.float(), decode_attention_reference(q, tiers).float(), atol=2e-2, rtol=2e-2)
