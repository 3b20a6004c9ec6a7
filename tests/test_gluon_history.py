"""The explicit-layout (Gluon) history span, the GPU default, against the torch reference.

Gluon has no interpreter mode, so the tests that run it skip without CUDA; CI keeps testing the
Triton kernel. Without a GPU, CI still compiles the span for sm_90: its layouts must be proven
register-only (``assert_trivial``) and its register budget held.
"""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_hf.core.storage import RowBuffer
from oscar_hf.kernels.decode_attention import DecodeTiers, decode_attention_reference
from oscar_hf.kernels.gluon_span_variant import BIT_WIDTHS
from oscar_hf.kernels.testing import decode_inputs, reference_partials
from tests.kernel_checks import TOLERANCE, run_ptx


def _flat_inputs(*shape, **kwargs):
    """``decode_inputs`` as flat tensors ``[q, sink K, sink V, K codes, K scale, ...]`` and the options
    ``k_bits``, ``v_bits``, ``key_mask``, as the span's own functions take them."""
    q, tiers = decode_inputs(*shape, **kwargs, device="cuda" if torch.cuda.is_available() else "cpu")
    return [q, *tiers.flat()], dict(k_bits=tiers.k_bits, v_bits=tiers.v_bits, key_mask=tiers.key_mask)


def reference(q, *tensors, k_bits, v_bits, sm_scale=None, key_mask=None, lengths=None):
    tiers = DecodeTiers.from_flat(tensors, k_bits, v_bits, key_mask, lengths)
    return decode_attention_reference(q, tiers, sm_scale=sm_scale)


def exact_reference(args, options, sm_scale):
    """:func:`reference` on float32 copies of bf16 inputs: the span's oracle. ``decode_attention_reference`` in
    bf16 rounds its scores and weights itself, by more than the span (which keeps float32 scores and rounds only
    its weights): a bf16 reference strays from the exact output by up to ~4e-2 where the span stays near 6e-3."""
    return reference(*[a.float() if a.is_floating_point() else a for a in args], sm_scale=sm_scale, **options).float()


def attend(q, *tensors, k_bits, v_bits, sm_scale=None, key_mask=None, lengths=None, history_settled=False):
    from oscar_hf.kernels.decode_attention import decode_attention

    tiers = DecodeTiers.from_flat(tensors, k_bits, v_bits, key_mask, lengths)
    return decode_attention(q, tiers, sm_scale=sm_scale, history_settled=history_settled)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels need a CUDA GPU")
TOOLS = Path(__file__).resolve().parents[1] / "kernels" / "tools"


WIDTHS = tuple(f"{k}/{v}" for k, v in BIT_WIDTHS)  # K/V bits the span reads, 2/2 first


def test_the_span_compiles_for_sm90_within_its_register_budget():
    """``python kernels/tools/sass_count.py --span`` in its own process (it swaps Triton's driver for a
    fake sm_90 one): each variant (the length as an argument or on the device, tiles staged or not; 3- and
    4-bit keys and 1-bit values direct only) of each K/V width within 128 registers, no local memory, under
    700 instructions before the loop and, a tile, 680 (760 with 3-bit keys, whose words take a second
    plane and two more masks)."""
    pytest.importorskip("triton.experimental.gluon")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(TOOLS / "sass_count.py"), "--span", "--bits", *WIDTHS],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(
        r"ring=(\w+) pipeline=(\w+): REG:(\d+) STACK:\d+ LOCAL:(\d+); shared \d+ B; (\d+) instructions"
        r" per 64-key tile, (\d+) before the loop",
        done.stdout,
    )
    direct = [("False", "False"), ("True", "False")]
    assert re.findall(r"^K(\d) V(\d)$", done.stdout, re.MULTILINE) == [tuple(w.split("/")) for w in WIDTHS]
    assert [(ring, pipeline) for ring, pipeline, *_ in rows] == [
        *direct,
        ("False", "True"),
        ("True", "True"),
        *direct * (len(WIDTHS) - 1),
    ], done.stdout
    tile_limits = [680] * 4 + [680 if w[0] != "3" else 760 for w in WIDTHS[1:] for _ in direct]
    for (_, _, registers, local, instructions, prologue), limit in zip(rows, tile_limits, strict=True):
        assert int(registers) <= 128 and int(local) == 0 and int(instructions) < limit, done.stdout
        assert int(prologue) < 700, done.stdout  # 496-640 (Triton 3.9), the first tile's copy included


def _halves(register: int, dtype: torch.dtype) -> list[float]:
    """The two 16-bit floats of a 32-bit register, low half first."""
    return torch.tensor([register & 0xFFFF, register >> 16], dtype=torch.int32).to(torch.int16).view(dtype).tolist()


def _code(word: int, byte: int, block: int, bits: int = 2) -> int:
    """The low ``bits`` of the 2-bit field of ``block`` in ``byte`` of ``word``."""
    return (word >> (8 * byte + 2 * block)) & ((1 << bits) - 1)


@pytest.mark.parametrize("bits", [2, 1])
def test_the_span_unpacks_value_words_as_offset_plus_factor_times_code(bits):
    """``value_unpack_asm(bits)`` executed on the CPU over every byte value, against its docstring:
    blocks j < 3 of both keys' byte b are bf16 ``128 + 4**j c``, block 3 ``128 + c`` (2-bit) or
    ``128 + 64 c`` (1-bit), c the field's low ``bits``."""
    pytest.importorskip("triton.experimental.gluon")
    from oscar_hf.kernels.gluon_span_operands import value_factors, value_unpack_asm

    assert value_factors(bits) == (1, 4, 16, 1 if bits == 2 else 64)
    for first in range(0, 256, 4):
        word = int.from_bytes(bytes([first, first + 1, first + 2, first + 3]), "little")
        other = word ^ 0xA5C3_3C5A  # the second key's word
        registers = run_ptx(value_unpack_asm(bits), {"$16": word, "$17": other})
        for j, factor in enumerate(value_factors(bits)):
            for b in range(4):
                want = [128.0 + factor * _code(w, b, j, bits) for w in (word, other)]
                assert _halves(registers[f"${4 * j + b}"], torch.bfloat16) == want, (j, b, first)


def test_the_span_unpacks_key_words_as_int8_factor_times_code():
    """``K_UNPACK`` executed on the CPU over every byte value: output j's byte b is the int8
    ``f_j * c`` of byte b's block j, f = 1, 4, 16, 16 (all below 128)."""
    pytest.importorskip("triton.experimental.gluon")
    from oscar_hf.kernels.gluon_span_operands import K_FACTORS, K_UNPACK

    for first in range(0, 256, 4):
        word = int.from_bytes(bytes([first, first + 1, first + 2, first + 3]), "little")
        registers = run_ptx(K_UNPACK.value, {"$4": word})
        for j, factor in enumerate(K_FACTORS):
            want = bytes(int(factor) * _code(word, b, j) for b in range(4))
            assert registers[f"${j}"].to_bytes(4, "little") == want, (j, first)


def test_the_span_unpacks_4_bit_key_word_pairs_as_int8_codes():
    """``K4_UNPACK`` executed on the CPU over every byte value of both words: outputs 0 and 1 are the low
    nibbles of the first and second word, 2 and 3 their high nibbles, as int8 (factor 1, below 16)."""
    pytest.importorskip("triton.experimental.gluon")
    from oscar_hf.kernels.gluon_span_operands import K4_FACTORS, K4_UNPACK

    assert K4_FACTORS == (1, 1, 1, 1)
    for first in range(0, 256, 4):
        low = int.from_bytes(bytes([first, first + 1, first + 2, first + 3]), "little")
        high = low ^ 0x5AC3_3CA5
        registers = run_ptx(K4_UNPACK.value, {"$4": low, "$8": high})
        for j, word in enumerate((low, high, low >> 4, high >> 4)):
            assert registers[f"${j}"] == word & 0x0F0F0F0F, (j, first)


def test_3_bit_keys_unpack_to_the_reference_codes():
    """``K3_UNPACK`` executed on the CPU on quantized 3-bit rows: with 2-bit word w (the row's low-bit
    plane) and the high-bit plane's word ``w % 4`` shifted right by ``w // 4`` (``_key_words``), output j's
    byte b is ``f_j`` times the code of dim ``4w + b + 32j`` as ``quant.unpack`` gives it."""
    pytest.importorskip("triton.experimental.gluon")
    from oscar_hf.kernels.gluon_span_operands import K3_FACTORS, K3_UNPACK
    from oscar_hf.quant import quantize, unpack

    generator = torch.Generator().manual_seed(12)
    keys = quantize(torch.randn(8, 128, generator=generator), 3, 128)
    codes, words = unpack(keys.codes, 3), keys.codes.view(torch.int32).tolist()
    assert codes.unique().tolist() == list(range(8))
    for row in range(8):
        for w in range(8):
            high = (words[row][8 + w % 4] >> (w // 4)) & 0xFFFFFFFF  # int32's arithmetic shift
            registers = run_ptx(K3_UNPACK.value, {"$4": words[row][w] & 0xFFFFFFFF, "$8": high})
            for j, factor in enumerate(K3_FACTORS):
                got = list(registers[f"${j}"].to_bytes(4, "little"))
                want = codes[row, 4 * w + 32 * j : 4 * w + 32 * j + 4] * int(factor)
                assert got == want.tolist(), (row, w, j)


def test_4_bit_keys_and_1_bit_values_unpack_to_the_reference_codes():
    """The span's reading of other widths on quantized rows, the asm run on the CPU: 2-bit word w's
    block j of 4-bit keys (``K4_UNPACK`` on words w and w + 8) is the code of dim ``4w + b + 32j`` as
    ``quant.unpack`` gives it, and 1-bit values made 2-bit words (``_value_words``, replayed by the
    emulator) dequantize through ``value_unpack_asm(1)`` to exactly ``quant.dequantize``'s values."""
    pytest.importorskip("triton.experimental.gluon")
    from oscar_hf.kernels.gluon_span_operands import K4_UNPACK, value_factors, value_unpack_asm
    from oscar_hf.quant import dequantize, quantize, unpack

    generator = torch.Generator().manual_seed(11)
    keys = quantize(torch.randn(6, 128, generator=generator), 4, 128)
    codes, words = unpack(keys.codes, 4), keys.codes.view(torch.int32).tolist()
    for row in range(6):
        for w in range(8):
            registers = run_ptx(
                K4_UNPACK.value, {"$4": words[row][w] & 0xFFFFFFFF, "$8": words[row][w + 8] & 0xFFFFFFFF}
            )
            for j in range(4):
                got = list(registers[f"${j}"].to_bytes(4, "little"))
                assert got == codes[row, 4 * w + 32 * j : 4 * w + 32 * j + 4].tolist(), (row, w, j)

    values = quantize(torch.randn(6, 128, generator=generator), 1, 128)
    want = dequantize(values, 1, 128, torch.float32)
    rows = values.codes.view(torch.int32)  # 2-bit word w of a 1-bit row: its word w % 4, shifted right by w // 4
    words = torch.stack([rows[:, w % 4] >> (w // 4) for w in range(8)], dim=1).tolist()
    scale, zero = values.scale.float(), values.zero.float()
    for row in range(0, 6, 2):  # the asm takes two keys' words
        for w in range(8):
            inputs = {"$16": words[row][w] & 0xFFFFFFFF, "$17": words[row + 1][w] & 0xFFFFFFFF}
            registers = run_ptx(value_unpack_asm(1), inputs)
            for j, factor in enumerate(value_factors(1)):
                for b in range(4):
                    for key, code in zip((row, row + 1), _halves(registers[f"${4 * j + b}"], torch.bfloat16)):
                        got = ((torch.tensor(code) - 128.0) / factor - zero[key, 0]) * scale[key, 0]
                        assert got == want[key, 4 * w + b + 32 * j], (key, w, j, b)


def test_the_emulated_span_reads_each_width_as_the_reference():
    """``kernels/tools/emulate_gluon_history.py``, run as a developer runs it: the span's algebra replayed
    in torch, 4-bit keys and 1-bit values read as the kernel reads them, against
    ``decode_attention_reference`` (float32) with two halves a tile and one; off by the bf16 rounding of
    the weights alone."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = TOOLS / "emulate_gluon_history.py"
    out = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True, env=env, timeout=600, check=True)
    found = re.findall(r"K(\d) V(\d), (\d) query heads: max abs difference (\S+)", out.stdout)
    assert sorted({f"{k}/{v}" for k, v, _, _ in found}) == sorted(WIDTHS), out.stdout
    assert len(found) == 2 * len(WIDTHS) and all(float(error) < 4e-3 for *_, error in found), out.stdout


def test_the_reference_partials_merge_to_the_whole_softmax():
    """``reference_partials`` judges the span's slots (``kernels/tools/diagnose_gluon_history.py``): they must be right."""
    from oscar_hf.kernels.decode_history_gluon import merge_partials

    sm_scale = 0.088
    args, options = _flat_inputs(1, 4, 1, 128, 0, 300, 0, 0, torch.bfloat16, 2, 2, seed=3)
    q, _, _, *packed, _, _, _, _ = args
    want = exact_reference(args, options, sm_scale=sm_scale)
    partials = reference_partials(q, packed[:6], splits=3, sm_scale=sm_scale)
    assert partials[0].shape == (1, 4, 3)  # 300 rows in 3 splits of 128, 128 and 44
    torch.testing.assert_close(merge_partials(*partials), want, rtol=1e-5, atol=1e-5)


@GPU
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, history, splits",
    [
        (1, 32, 8, 4133, 16),  # Qwen3-8B attention shape, a partial last tile in the last split
        (2, 8, 2, 1000, 3),  # GQA 4, several splits
        (1, 8, 1, 64, 1),  # exactly one whole tile: no masked tile
        (1, 8, 1, 40, 1),  # only a masked tile
        (1, 4, 4, 256, 2),  # GQA 1, whole tiles only
        (1, 6, 2, 700, 3),  # GQA 3: two halves of 32 keys a tile, a head idle in each
        (3, 4, 2, 130, 2),  # GQA 2
        (2, 16, 2, 300, 4),  # GQA 8: every column of the MMAs is a head (one half of 64 keys a tile)
    ],
)
@pytest.mark.parametrize(
    "pipeline, stored",
    [(False, False), (False, True), (True, True)],
    ids=["direct", "direct-in-buffers", "staged-in-buffers"],
)
def test_history_span_matches_the_reference(batch, q_heads, kv_heads, history, splits, pipeline, stored):
    """``stored``: the history as a cache holds it, the first rows of buffers of aligned capacity (read
    in place; staging needs that alignment); otherwise plain tensors of ``history`` rows."""
    from oscar_hf.kernels.decode_history_gluon import history_partials, merge_partials

    args, options = _flat_inputs(batch, q_heads, kv_heads, 128, 0, history, 0, 0, torch.bfloat16, 2, 2, seed=3)
    args = [a.cuda() for a in args]
    want = exact_reference(args, options, sm_scale=0.088)
    q, _, _, *packed, _, _, _, _ = args
    if stored:
        packed = [_in_buffer(t) for t in packed]
    got = merge_partials(*history_partials(q, *packed, sm_scale=0.088, splits=splits, pipeline=pipeline))
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


@GPU
@pytest.mark.parametrize("widths", WIDTHS[1:])
@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, history, splits",
    [
        (1, 32, 8, 4133, 16),  # Qwen3-8B attention shape, a partial last tile in the last split
        (1, 8, 1, 40, 1),  # only a masked tile
        (2, 16, 2, 300, 4),  # GQA 8: one half of 64 keys a tile
        (3, 4, 2, 130, 2),  # GQA 2
    ],
)
@pytest.mark.parametrize("stored", [False, True], ids=["direct", "direct-in-buffers"])
def test_history_span_matches_the_reference_at_other_widths(widths, batch, q_heads, kv_heads, history, splits, stored):
    """4-bit keys and 1-bit values (tiles loaded directly: only 2-bit K and V are staged)."""
    from oscar_hf.kernels.decode_history_gluon import history_partials, merge_partials

    k_bits, v_bits = (int(b) for b in widths.split("/"))
    args, options = _flat_inputs(
        batch, q_heads, kv_heads, 128, 0, history, 0, 0, torch.bfloat16, k_bits, v_bits, seed=3
    )
    args = [a.cuda() for a in args]
    want = exact_reference(args, options, sm_scale=0.088)
    q, _, _, *packed, _, _, _, _ = args
    if stored:
        packed = [_in_buffer(t) for t in packed]
    got = merge_partials(*history_partials(q, *packed, sm_scale=0.088, splits=splits))
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


@GPU
@pytest.mark.parametrize("pipeline", [False, True], ids=["direct", "staged"])
def test_the_span_reads_key_and_value_rows_that_alternate_in_one_buffer(pipeline):
    """K's and V's code rows side by side in one buffer (rows 64 bytes apart) give the same partials as
    two packed buffers."""
    from oscar_hf.kernels.decode_history_gluon import history_partials

    args, _ = _flat_inputs(2, 8, 2, 128, 0, 1000, 0, 0, torch.bfloat16, 2, 2, seed=6)
    q, _, _, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, _, _, _, _ = [a.cuda() for a in args]
    metadata = [_in_buffer(t) for t in (k_scale, k_zero, v_scale, v_zero)]
    rows = _in_buffer(torch.cat([k_codes, v_codes], dim=-1))
    separate = history_partials(
        q,
        _in_buffer(k_codes),
        metadata[0],
        metadata[1],
        _in_buffer(v_codes),
        *metadata[2:],
        sm_scale=0.088,
        splits=3,
        pipeline=pipeline,
    )
    alternating = history_partials(
        q,
        rows[..., :32],
        metadata[0],
        metadata[1],
        rows[..., 32:],
        *metadata[2:],
        sm_scale=0.088,
        splits=3,
        pipeline=pipeline,
    )
    for a, b in zip(alternating, separate):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@GPU
def test_the_span_reads_4_bit_key_and_1_bit_value_rows_that_alternate_in_one_buffer():
    """K's 64-byte and V's 16-byte rows side by side (each 80 bytes apart): each has its own row stride."""
    from oscar_hf.kernels.decode_history_gluon import history_partials

    args, _ = _flat_inputs(2, 8, 2, 128, 0, 1000, 0, 0, torch.bfloat16, 4, 1, seed=6)
    q, _, _, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, _, _, _, _ = [a.cuda() for a in args]
    rows = _in_buffer(torch.cat([k_codes, v_codes], dim=-1))
    separate = history_partials(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, sm_scale=0.088, splits=3)
    alternating = history_partials(
        q, rows[..., :64], k_scale, k_zero, rows[..., 64:], v_scale, v_zero, sm_scale=0.088, splits=3
    )
    for a, b in zip(alternating, separate):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@GPU
@pytest.mark.parametrize("pipeline", [False, True], ids=["direct", "staged"])
def test_a_timed_span_records_each_program_once_and_computes_the_same(pipeline):
    """``timeline`` (kernels/tools/timeline_decode.py): one record a program, its phases in order, and the
    same partials as untimed (1000 rows in 3 splits: 6, 6 and 4 tiles, the last one masked)."""
    from oscar_hf.kernels.decode_history_gluon import history_partials
    from oscar_hf.kernels.gluon_span_kernel import TIMELINE_FIELDS, placement
    from oscar_hf.kernels.gluon_span_variant import SpanVariant

    args, _ = _flat_inputs(2, 8, 2, 128, 0, 1000, 0, 0, torch.bfloat16, 2, 2, seed=5)
    q, _, _, *packed, _, _, _, _ = [a.cuda() for a in args]
    packed = [_in_buffer(t) for t in packed]
    untimed = history_partials(q, *packed, sm_scale=0.088, splits=3, pipeline=pipeline)
    timeline = torch.zeros(2 * 2 * 3 + 1, int(TIMELINE_FIELDS), dtype=torch.int64, device="cuda")
    timed = history_partials(
        q, *packed, sm_scale=0.088, splits=3, pipeline=pipeline, variant=SpanVariant(timeline=timeline)
    )
    for a, b in zip(timed, untimed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    records = timeline.cpu()
    assert not records[-1].any()  # 12 programs, 12 records
    sm, _, tiles = placement(records[:-1])
    _, started, ended, *cycles = records[:-1].T
    assert (sm < torch.cuda.get_device_properties(0).multi_processor_count).all()
    assert tiles.tolist() == [6, 6, 4] * 4
    assert (started > 0).all() and (ended >= started).all()
    for earlier, later in zip(cycles, cycles[1:]):
        assert (later >= earlier).all()


@GPU
def test_the_span_variants_for_kernel_development_compute_the_same():
    """One half of 64 keys a tile instead of two of 32 (4 query heads a KV head), and a lower register
    cap (it spills): the production span's maxima and normalisers, and outputs as close to the reference.
    The one-half variant's value sums differ by 16-bit rounding (it weighs keys at other running maxima)."""
    from oscar_hf.kernels.decode_history_gluon import history_partials, merge_partials
    from oscar_hf.kernels.gluon_span_variant import SpanVariant

    args, options = _flat_inputs(2, 8, 2, 128, 0, 1000, 0, 0, torch.bfloat16, 2, 2, seed=8)
    args = [a.cuda() for a in args]
    want = reference(*args, sm_scale=0.088, **options).float()
    q, _, _, *packed, _, _, _, _ = args
    packed = [_in_buffer(t) for t in packed]
    m, l, _ = history_partials(q, *packed, sm_scale=0.088, splits=3, pipeline=True)
    for variant in (SpanVariant(two_halves=False), SpanVariant(registers=96)):
        got = history_partials(q, *packed, sm_scale=0.088, splits=3, pipeline=True, variant=variant)
        torch.testing.assert_close(got[0], m, rtol=0, atol=1e-6, msg=str(variant))
        torch.testing.assert_close(got[1], l, rtol=1e-5, atol=1e-5, msg=str(variant))
        torch.testing.assert_close(merge_partials(*got), want, **TOLERANCE[torch.bfloat16], msg=str(variant))


@GPU
@pytest.mark.parametrize("q_heads", [4, 8], ids=["two-halves", "one-half"])
@pytest.mark.parametrize("rising", [True, False], ids=["max-moves-every-tile", "max-set-by-the-first-tile"])
def test_the_span_follows_scores_that_rise_or_fall_far(q_heads, rising):
    """Key scales growing 30-fold along the history make each tile's max pass the running one by far,
    so every tile rescales what came before; falling, the first tile's max stands and later weights
    underflow. Both against the reference."""
    from oscar_hf.kernels.decode_history_gluon import history_partials, merge_partials

    args, options = _flat_inputs(1, q_heads, 1, 128, 0, 1000, 0, 0, torch.bfloat16, 2, 2, seed=7)
    args = [a.cuda() for a in args]
    ramp = torch.linspace(0.2, 6.0, 1000, device="cuda")
    ramp = ramp if rising else ramp.flip(0)
    args[4] = (args[4].float() * ramp[None, None, :, None]).to(torch.bfloat16)  # K's scales
    want = exact_reference(args, options, sm_scale=0.088)  # a bf16 reference is off by up to 0.11 here
    q, _, _, *packed, _, _, _, _ = args
    packed = [_in_buffer(t) for t in packed]  # staged, as in a cache
    got = merge_partials(*history_partials(q, *packed, sm_scale=0.088, splits=2, pipeline=True))
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


def _in_buffer(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` copied into a RowBuffer, as a view of its first rows (capacity aligned, garbage after)."""
    buffer = RowBuffer(rows.shape[0], rows.shape[1], tuple(rows.shape[3:]), rows.dtype, rows.device)
    buffer.append(rows)
    buffer.data[:, :, rows.shape[2] :] = 7  # unread rows past the history
    return buffer.view()


def test_a_cache_history_is_aligned_for_staging():
    """The span stages tiles (its default) only where each head's metadata rows start 16 bytes aligned:
    always for a cache's buffers (capacities of whole ROW_ALIGNMENT rows), not for arbitrary tensors."""
    pytest.importorskip("triton.experimental.gluon")
    from oscar_hf.core.storage import PackedHistory
    from oscar_hf.kernels.decode_history_gluon import staging_aligned

    history = PackedHistory(2, 8, 128, 2, 128, torch.bfloat16, torch.device("cpu"))
    for rows in (1, 99, 1000):  # the buffers grow in between
        history.extend(rows)
        stored = history.packed()
        assert staging_aligned([stored.scale, stored.zero])
    plain = torch.zeros(2, 8, 1099, 1, dtype=torch.bfloat16)
    assert not staging_aligned([plain])


@GPU
def test_staging_refuses_unaligned_metadata():
    from oscar_hf.kernels.decode_history_gluon import history_partials

    args, _ = _flat_inputs(1, 4, 1, 128, 0, 99, 0, 0, torch.bfloat16, 2, 2, seed=3)
    q, _, _, *packed, _, _, _, _ = [a.cuda() for a in args]
    packed[1] = packed[1][:, :, 1:]  # every head's rows one element off
    with pytest.raises(ValueError, match="16-row aligned"):
        history_partials(q, *[t[:, :, :98] for t in packed], sm_scale=0.088, splits=1, pipeline=True)


@GPU
def test_history_span_refuses_what_it_does_not_cover():
    """4-bit values, and staging for a width other than 2-bit K and V."""
    from oscar_hf.kernels.decode_history_gluon import history_partials

    args, _ = _flat_inputs(1, 4, 1, 128, 0, 64, 0, 0, torch.bfloat16, 2, 4, seed=3)
    q, _, _, *packed, _, _, _, _ = [a.cuda() for a in args]
    with pytest.raises(ValueError, match="2-, 3- or 4-bit K with 2- or 1-bit V.*got 2-bit K and 4-bit V"):
        history_partials(q, *packed, sm_scale=0.088, splits=1)
    args, _ = _flat_inputs(1, 4, 1, 128, 0, 64, 0, 0, torch.bfloat16, 4, 2, seed=3)
    q, _, _, *packed, _, _, _, _ = [a.cuda() for a in args]
    packed = [_in_buffer(t) for t in packed]
    with pytest.raises(ValueError, match="stages 2-bit K and V only"):
        history_partials(q, *packed, sm_scale=0.088, splits=1, pipeline=True)


@GPU
@pytest.mark.parametrize("widths", WIDTHS)
@pytest.mark.parametrize("pads", [None, [0, 3]], ids=["no-mask", "padded-sink"])
def test_decode_attention_takes_its_history_slots_from_the_span(monkeypatch, pads, widths):
    """``OSCAR_DECODE_HISTORY=gluon``: all four tiers through ``decode_attention``, the history from
    the Gluon span and the dense tiers from the Triton stage 1, merged by one stage 2."""

    monkeypatch.setenv("OSCAR_DECODE_HISTORY", "gluon")
    k_bits, v_bits = (int(b) for b in widths.split("/"))
    args, options = _flat_inputs(2, 32, 8, 128, 64, 3000, 260, 1, torch.bfloat16, k_bits, v_bits, pads=pads, seed=4)
    args = [a.cuda() for a in args]
    options["key_mask"] = None if pads is None else options["key_mask"].cuda()
    want = reference(*args, sm_scale=0.088, **options)
    got = attend(*args, sm_scale=0.088, **options)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[torch.bfloat16])


@GPU
def test_a_settled_history_is_read_while_the_kernel_before_writes_q(monkeypatch):
    """``history_settled=True``: on Hopper the span starts while the kernel before it (here a matmul that
    writes q, as a decode step's rotation does) still runs, copying history rows meanwhile; it must read
    q only after that kernel ends. Several calls in a row, each after a new q, against the reference."""

    monkeypatch.setenv("OSCAR_DECODE_HISTORY", "gluon")
    args, options = _flat_inputs(1, 32, 8, 128, 64, 20_000, 260, 1, torch.bfloat16, 2, 2, seed=5)
    q, *tiers = [a.cuda() for a in args]
    generator = torch.Generator(device="cuda").manual_seed(0)
    features = torch.randn(32, 16384, device="cuda", dtype=torch.bfloat16, generator=generator)
    for step in range(4):
        projection = torch.randn(16384, 128, device="cuda", dtype=torch.bfloat16, generator=generator) / 128
        torch.mm(features, projection, out=q.view(32, 128))  # the kernel just before the span writes q
        got = attend(q, *tiers, sm_scale=0.088, history_settled=True, **options)
        want = reference(q, *tiers, sm_scale=0.088, **options)
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[torch.bfloat16], msg=f"call {step}")


@GPU
@pytest.mark.parametrize("widths", ["2/2", "4/1", "3/2"])
@pytest.mark.parametrize("history", [1000, 100], ids=["long", "short-history-many-empty-splits"])
def test_static_lengths_reach_the_span(monkeypatch, history, widths):
    """Static decoding: the span reads the history length from the device tensor, as the Triton kernel
    does; splits are sized for the capacity, so with a short history most of them are empty."""

    monkeypatch.setenv("OSCAR_DECODE_HISTORY", "gluon")
    capacity = 1600
    k_bits, v_bits = (int(b) for b in widths.split("/"))
    args, options = _flat_inputs(1, 32, 8, 128, 64, history, 7, 1, torch.bfloat16, k_bits, v_bits, seed=6)
    args = [a.cuda() for a in args]
    want = reference(*args, sm_scale=0.088, **options)
    q, sink_k, sink_v, *packed, recent_k, recent_v, new_k, new_v = args
    garbage = [
        torch.cat(
            [t, torch.randint(0, 255, (*t.shape[:2], capacity - history, t.shape[-1]), device="cuda").to(t.dtype)],
            dim=2,
        )
        for t in packed
    ]
    # the ring as static decoding leaves it: 7 rows, and a slot for the new row that the call fills
    ring = [torch.cat([rows, torch.full_like(new_k, 50.0)], dim=2) for rows in (recent_k, recent_v)]
    lengths = torch.tensor([history, 0, 8], device="cuda")
    got = attend(
        q, sink_k, sink_v, *garbage, *ring, new_k, new_v, k_bits=k_bits, v_bits=v_bits, sm_scale=0.088, lengths=lengths
    )
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[torch.bfloat16])
    assert torch.equal(ring[0][:, :, 7:], new_k) and torch.equal(ring[1][:, :, 7:], new_v)


def test_an_unknown_history_kernel_is_refused(monkeypatch):
    """``OSCAR_DECODE_HISTORY`` picks ``gluon`` (the default) or ``triton``; anything else is a typo,
    not a silent fallback."""
    from oscar_hf.kernels.decode_attention import decode_attention_triton

    monkeypatch.setenv("OSCAR_DECODE_HISTORY", "glunon")
    args, options = _flat_inputs(1, 4, 1, 128, 4, 64, 4, 1, torch.bfloat16, 2, 2, seed=0)
    with pytest.raises(ValueError, match="OSCAR_DECODE_HISTORY='glunon'"):
        decode_attention_triton(*args, options["key_mask"], 2, 2, 0.088)


@pytest.mark.parametrize(
    "choice, available, want",
    [
        (None, True, True),  # the default where Gluon loads
        (None, False, False),  # an older Triton: the Triton stage 1, logged once
        ("triton", True, False),
        ("gluon", False, RuntimeError),  # asked for explicitly: a clear error, not a silent fallback
    ],
)
def test_the_history_kernel_choice(monkeypatch, choice, available, want):
    """Which kernel reads the history for a covered shape (Qwen3-8B attention on a GPU; only shapes
    and the device flag matter, so q stands in without a GPU)."""
    import types

    from oscar_hf.kernels import decode_launch

    monkeypatch.delenv("OSCAR_DECODE_HISTORY", raising=False)
    if choice is not None:
        monkeypatch.setenv("OSCAR_DECODE_HISTORY", choice)
    monkeypatch.setattr(decode_launch, "INTERPRET", False)
    monkeypatch.setattr(decode_launch, "_gluon_unavailable", lambda: None if available else "triton 3.0: ImportError")
    q = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(1, 32, 128))
    codes, scale = torch.empty(1, 8, 1000, 32, dtype=torch.uint8), torch.empty(1, 8, 1000, 1)
    choose = functools.partial(decode_launch._gluon_history, q, codes, 2, 2, scale, scale, tuned=False)
    if want is RuntimeError:
        with pytest.raises(RuntimeError, match="cannot load here"):
            choose()
    else:
        assert choose() is want


@pytest.mark.parametrize(
    "k_bits, v_bits, span",
    [(4, 2, True), (2, 1, True), (4, 1, True), (3, 2, True), (3, 1, True), (3, 3, False), (2, 4, False), (1, 2, False)],
)
def test_bit_widths_take_the_span_or_the_triton_history(monkeypatch, k_bits, v_bits, span):
    """The span covers 2-, 3- or 4-bit K with 2- or 1-bit V (``BIT_WIDTHS``); other widths (3- or 4-bit
    values, 1-bit keys) go to the Triton stage 1 on the same shape, also under ``OSCAR_DECODE_HISTORY=gluon``."""
    import types

    from oscar_hf.kernels import decode_launch

    monkeypatch.delenv("OSCAR_DECODE_HISTORY", raising=False)
    monkeypatch.setattr(decode_launch, "INTERPRET", False)
    monkeypatch.setattr(decode_launch, "_gluon_unavailable", lambda: None)
    q = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(1, 32, 128))
    codes, scale = torch.empty(1, 8, 1000, 128 * k_bits // 8, dtype=torch.uint8), torch.empty(1, 8, 1000, 1)
    assert decode_launch._gluon_history(q, codes, 2, 2, scale, scale, tuned=False)
    assert decode_launch._gluon_history(q, codes, k_bits, v_bits, scale, scale, tuned=False) is span
    monkeypatch.setenv("OSCAR_DECODE_HISTORY", "gluon")
    assert decode_launch._gluon_history(q, codes, k_bits, v_bits, scale, scale, tuned=False) is span
    monkeypatch.setenv("OSCAR_DECODE_HISTORY", "triton")
    assert decode_launch._gluon_history(q, codes, k_bits, v_bits, scale, scale, tuned=False) is False
