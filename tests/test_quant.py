"""Property tests of the quantization math against its definition (the paper's clipping and INT2 format)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_hf.quant import SIGMA_STRETCH, clip_index, clip_rows, dequantize, pack, quantize, tree_sum, unpack

HEAD_DIMS = st.sampled_from([16, 32, 64, 128])
SEEDS = st.integers(0, 2**31 - 1)


def rows_for(seed: int, head_dim: int, count: int = 8, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, head_dim, generator=g) * scale
    x[:, 0] += 5 * scale  # an outlier channel and a non-zero mean, like real keys
    return x


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS, head_dim=HEAD_DIMS, bits=st.sampled_from([2, 3, 4]), scale=st.floats(1e-3, 1e3))
def test_asymmetric_error_is_at_most_half_a_step(seed, head_dim, bits, scale):
    rows = rows_for(seed, head_dim, scale=scale)
    q = quantize(rows, bits, head_dim, metadata_dtype=torch.float32)
    step = (rows.amax(-1, keepdim=True) - rows.amin(-1, keepdim=True)) / (2**bits - 1)
    error = (dequantize(q, bits, head_dim, torch.float32) - rows).abs()
    assert bool((error <= step / 2 * (1 + 1e-4) + 1e-6 * scale).all())


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, head_dim=HEAD_DIMS, group_div=st.sampled_from([1, 2, 4]))
def test_grouped_quantization_uses_each_groups_range(seed, head_dim, group_div):
    rows = rows_for(seed, head_dim)
    group = head_dim // group_div
    q = quantize(rows, 2, group, metadata_dtype=torch.float32)
    assert q.scale.shape == (8, group_div)
    groups = rows.unflatten(-1, (group_div, group))
    expected_scale = (groups.amax(-1) - groups.amin(-1)).clamp(min=1e-8) / 3
    torch.testing.assert_close(q.scale, expected_scale)
    torch.testing.assert_close(q.zero, -groups.amin(-1) / expected_scale)


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, head_dim=HEAD_DIMS)
def test_symmetric_grid_is_centred_and_covers_the_largest_magnitude(seed, head_dim):
    rows = rows_for(seed, head_dim)
    q = quantize(rows, 2, head_dim, symmetric=True, metadata_dtype=torch.float32)
    assert bool((q.zero == 1.5).all())
    amax = rows.abs().amax(-1)
    torch.testing.assert_close(q.scale[:, 0], 2 * amax / 3)
    error = (dequantize(q, 2, head_dim, torch.float32) - rows).abs()
    assert bool((error <= (q.scale / 2 + 1e-6)).all())


def test_codes_round_half_up_with_a_float_zero_point():
    # one row: min -1, max 2 -> scale 1, zero 1; x = -0.5 sits exactly between codes 0 and 1
    row = torch.tensor([[-1.0, -0.5, 0.5, 2.0] + [0.0] * 4])
    q = quantize(row, 2, 8, metadata_dtype=torch.float32)
    codes = unpack(q.codes, 2)
    assert codes[0, :4].tolist() == [0, 1, 2, 3]
    assert q.zero.item() == pytest.approx(1.0)


def test_constant_rows_use_the_scale_floor_and_survive():
    rows = torch.full((3, 16), 0.25)
    q = quantize(rows, 2, 16, metadata_dtype=torch.float32)
    assert bool((q.scale > 0).all())
    torch.testing.assert_close(dequantize(q, 2, 16, torch.float32), rows)


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS, head_dim=HEAD_DIMS, bits=st.sampled_from([1, 2, 3, 4]))
def test_pack_unpack_round_trip(seed, head_dim, bits):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (3, 5, head_dim), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, head_dim * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


def test_int2_uses_the_reference_quartered_layout():
    d = 16
    codes = torch.randint(0, 4, (d,), dtype=torch.uint8)
    packed = pack(codes, 2)
    for c in range(d // 4):
        expected = codes[c] | codes[c + d // 4] << 2 | codes[c + d // 2] << 4 | codes[c + 3 * d // 4] << 6
        assert packed[c] == expected


def test_int3_is_a_quartered_2bit_plane_then_a_1bit_plane():
    d = 16
    codes = torch.randint(0, 8, (d,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack(codes, 3)
    assert packed.shape == (6,)
    assert torch.equal(packed[:4], pack(codes & 3, 2))  # low bits: the INT2 layout
    for c in range(d // 8):  # high bits: byte c holds dims c, c + D/8, ..., c + 7D/8 from bit 0 up
        assert packed[4 + c] == sum(int(codes[c + j * d // 8] >> 2) << j for j in range(8))


def test_int4_packs_dims_c_and_c_plus_half():
    codes = torch.arange(16, dtype=torch.uint8) % 16
    packed = pack(codes, 4)
    assert packed[3] == codes[3] | codes[11] << 4


@settings(max_examples=60, deadline=None)
@given(seed=SEEDS, head_dim=HEAD_DIMS, ratio=st.sampled_from([0.5, 0.92, 0.96, 1.0]))
def test_clip_threshold_is_the_order_statistic(seed, head_dim, ratio):
    rows = rows_for(seed, head_dim)
    threshold = rows.abs().sort(dim=-1).values[:, clip_index(ratio, head_dim)]
    clipped = clip_rows(rows, ratio)
    torch.testing.assert_close(clipped, rows.clamp(-threshold[:, None], threshold[:, None]))
    # exactly the coordinates above the threshold change
    assert bool(((clipped != rows) == (rows.abs() > threshold[:, None])).all())


def test_clip_index_matches_the_reference_table():
    assert clip_index(0.96, 128) == 122 and clip_index(0.92, 128) == 117
    assert clip_index(0.96, 256) == 245 and clip_index(0.92, 256) == 235
    assert clip_index(1.0, 128) == 127


def test_clip_ratio_zero_is_off_and_out_of_range_is_refused():
    rows = rows_for(0, 16)
    assert clip_rows(rows, 0.0) is rows
    with pytest.raises(ValueError, match="clip ratio"):
        clip_rows(rows, 1.5)


def test_clipping_happens_before_the_scale():
    rows = rows_for(1, 64)
    q = quantize(rows, 2, 64, clip_ratio=0.92, metadata_dtype=torch.float32)
    clipped = clip_rows(rows, 0.92)
    torch.testing.assert_close(q.scale[:, 0], (clipped.amax(-1) - clipped.amin(-1)) / 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_metadata_dtype(dtype):
    rows = rows_for(2, 64)
    q = quantize(rows, 2, 64, metadata_dtype=dtype)
    assert q.scale.dtype == dtype and q.zero.dtype == dtype
    error = (dequantize(q, 2, 64, torch.float32) - rows).abs().amax()
    step = ((rows.amax(-1) - rows.amin(-1)) / 3).amax()
    assert error <= step * (0.5 + 0.02)


def test_unsupported_bits_raise():
    with pytest.raises(ValueError, match="unsupported bit width 5"):
        quantize(torch.zeros(2, 16), 5, 16)
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.zeros(2, 16), 2, 5)
    with pytest.raises(ValueError, match="multiple of 8"):  # 3-bit rows: whole bytes of the 1-bit plane
        pack(torch.zeros(2, 12, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="symmetric"):
        quantize(torch.zeros(2, 16), 1, 16, symmetric=True)


def test_bit_budget():
    # 2 bits per value + one 16-bit scale and zero per 128 channels = 2.25 bits per element
    q = quantize(torch.randn(10, 128), 2, 128)
    bits = 8 * (q.codes.numel() + q.scale.numel() * 2 + q.zero.numel() * 2) / (10 * 128)
    assert math.isclose(bits, 2.25)


def test_3bit_bit_budget():
    # 3 bits per value + one 16-bit scale and zero per 64 channels = 3.5 bits per element
    q = quantize(torch.randn(10, 64), 3, 64)
    bits = 8 * (q.codes.numel() + q.scale.numel() * 2 + q.zero.numel() * 2) / (10 * 64)
    assert math.isclose(bits, 3.5)


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, head_dim=HEAD_DIMS, group_div=st.sampled_from([1, 2]))
def test_1bit_rows_take_the_two_sigma_levels_of_each_group(seed, head_dim, group_div):
    rows = rows_for(seed, head_dim)
    group = head_dim // group_div
    q = quantize(rows, 1, group, metadata_dtype=torch.float32)
    groups = rows.unflatten(-1, (group_div, group))
    mu, sigma = groups.mean(-1, keepdim=True), groups.std(-1, unbiased=False, keepdim=True)
    # codes say which side of the group's mean each value lies on (away from float ties at the mean)
    codes = unpack(q.codes, 1).unflatten(-1, (group_div, group))
    away = (groups - mu).abs() > 1e-5 * sigma
    assert torch.equal(codes.bool()[away], (groups >= mu)[away])
    levels = dequantize(q, 1, group, torch.float32).unflatten(-1, (group_div, group))
    expected = mu + torch.where(codes.bool(), 1.0, -1.0) * SIGMA_STRETCH / 2 * sigma
    torch.testing.assert_close(levels, expected, atol=1e-5, rtol=1e-4)


def test_1bit_is_a_1bit_plane():
    d = 16
    codes = torch.randint(0, 2, (d,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack(codes, 1)
    assert packed.shape == (2,)
    assert torch.equal(packed, pack(codes << 2, 3)[4:])  # the high plane of 3-bit codes: one layout rule


def test_1bit_constant_rows_use_the_scale_floor():
    rows = torch.full((3, 16), 0.25)
    q = quantize(rows, 1, 16, metadata_dtype=torch.float32)
    assert bool((q.scale == 1e-8).all()) and bool((unpack(q.codes, 1) == 1).all())
    torch.testing.assert_close(dequantize(q, 1, 16, torch.float32), rows, atol=1e-6, rtol=0)


def test_tree_sum_halves_in_a_fixed_order():
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0]])  # (1e8 + -1e8) + (1 + 1) = 2; left to right gives 1
    assert tree_sum(x).item() == 2.0
    torch.testing.assert_close(tree_sum(torch.arange(12.0)), torch.tensor(66.0))  # odd remainder: summed last


def test_1bit_bit_budget():
    # 1 bit per value + one 16-bit scale and zero per 64 channels = 1.5 bits per element
    q = quantize(torch.randn(10, 64), 1, 64)
    bits = 8 * (q.codes.numel() + q.scale.numel() * 2 + q.zero.numel() * 2) / (10 * 64)
    assert math.isclose(bits, 1.5)
