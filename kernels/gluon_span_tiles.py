"""Tiles of the Gluon history span (:mod:`.gluon_span_kernel`) in registers: 64 rows of K and V code words
and their four metadata vectors, loaded straight from global memory (:func:`load_tile`) or staged through
shared memory while the tile before computes (:func:`copy_tile`, :func:`staged_tile`).

The words arrive in the layouts the MMAs' operands relabel for free (:mod:`.gluon_span_layouts`); 3- and
4-bit keys and 1-bit values are read into the 2-bit words' order as they load (:func:`_key_words`,
:func:`_value_words`), so all that follows is the same.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .gluon_span_layouts import (
    COPY_K,
    COPY_V,
    K_STAGES,
    META,
    META_COPY,
    META_PAIRS,
    META_STAGES,
    V_STAGES,
    WORDS_K,
    WORDS_V,
)

# Triton 3.6 names this async_copy_global_to_shared; later versions async_load.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _word_offsets(LAYOUT: gl.constexpr, ROW_WORDS: gl.constexpr):
    """A tile's rows ``[64]`` and its words' offsets ``[64, 8]`` (rows ``ROW_WORDS`` words apart) in ``LAYOUT``."""
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, LAYOUT))
    return rows, rows[:, None] * ROW_WORDS + gl.arange(0, 8, layout=gl.SliceLayout(0, LAYOUT))[None, :]


@gluon.jit
def _words(P, ok, MASKED: gl.constexpr):
    """The words at ``P``; ``MASKED``: 0 where not ``ok``."""
    if MASKED:
        return gl.load(P, mask=ok, other=0)
    else:
        return gl.load(P)


@gluon.jit
def _key_words(KC, offsets, ok, K_BITS: gl.constexpr, MASKED: gl.constexpr):
    """K's words as :func:`.gluon_span_operands.unpack_k` takes them: 2-bit words, or for 4-bit keys the
    pair of 4-bit words ``w`` and ``w + 8`` that 2-bit word ``w``'s blocks lie in. A 3-bit row is a 2-bit
    row (words 0-7) and a 1-bit plane (words 8-11) whose word ``w % 4`` shifted right by ``w // 4`` holds
    the third bits of 2-bit word ``w``, as :func:`_value_words` reads 1-bit rows."""
    if K_BITS == 4:
        return _words(KC + offsets, ok, MASKED), _words(KC + 8 + offsets, ok, MASKED)
    elif K_BITS == 3:
        words = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS_K))[None, :]
        high = _words((KC + (8 - 4 * (words // 4))) + offsets, ok, MASKED) >> (words // 4)
        return _words(KC + offsets, ok, MASKED), high
    else:
        return _words(KC + offsets, ok, MASKED)


@gluon.jit
def _value_words(VC, rows, V_ROW: gl.constexpr, ok, V_BITS: gl.constexpr, MASKED: gl.constexpr):
    """V's 2-bit words ``[64, 8]`` in WORDS_V, made from 1-bit rows where ``V_BITS`` is 1: dim ``32j + c``
    is bit ``2j + c // 16`` of byte ``c % 16``, so 2-bit word ``w`` is word ``w % 4`` of the row shifted
    right by ``w // 4``, each field's low bit its code (``value_unpack_asm(1)`` masks that bit alone)."""
    words = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS_V))[None, :]
    if V_BITS == 1:
        # The lane's word goes into the pointer before the rows' offsets: summed with them first, it
        # takes the compiler an address register for each odd row.
        return _words((VC + words % 4) + rows[:, None] * V_ROW, ok, MASKED) >> (words // 4)
    else:
        return _words(VC + (rows[:, None] * V_ROW + words), ok, MASKED)


@gluon.jit
def load_tile(
    KC,
    VC,
    KS,
    KZ,
    VS,
    VZ,
    block,
    end,
    K_ROW: gl.constexpr,
    V_ROW: gl.constexpr,
    K_BITS: gl.constexpr,
    V_BITS: gl.constexpr,
    MASKED: gl.constexpr,
    PACK: gl.constexpr,
):
    """One tile's K and V code words (:func:`_key_words`, :func:`_value_words`) and its four metadata
    vectors; ``MASKED``: rows from ``end`` on read as 0. A row's words are contiguous (K's rows ``K_ROW``
    words apart, V's ``V_ROW``), its scale or zero one element: constant strides let loads be 8 and 16
    bytes wide, which a mask allows only where it is known constant over 8 rows (not for a length read
    on the device). Offsets are taken from the tile's first row, so each address is a base plus a
    constant."""
    k_rows, k_offsets = _word_offsets(gl.constexpr(WORDS_K), K_ROW)
    v_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, WORDS_V))
    rows = gl.arange(0, 64, layout=META_PAIRS if PACK == 2 else META)
    KC, VC = KC + block * K_ROW, VC + block * V_ROW
    KS, KZ, VS, VZ = KS + block, KZ + block, VS + block, VZ + block
    n = end - block
    raw_k = _key_words(KC, k_offsets, (k_rows < n)[:, None], K_BITS, MASKED)
    raw_v = _value_words(VC, v_rows, V_ROW, (v_rows < n)[:, None], V_BITS, MASKED)
    if MASKED:
        ok = rows < n
        meta = (
            gl.load(KS + rows, mask=ok, other=0.0),
            gl.load(KZ + rows, mask=ok, other=0.0),
            gl.load(VS + rows, mask=ok, other=0.0),
            gl.load(VZ + rows, mask=ok, other=0.0),
        )
    else:
        meta = (gl.load(KS + rows), gl.load(KZ + rows), gl.load(VS + rows), gl.load(VZ + rows))
    return raw_k, raw_v, meta


@gluon.jit
def stage_buffers(KS):
    """Two stages of a tile's K and V words and of its four metadata vectors, in shared memory."""
    meta = KS.dtype.element_ty
    return (
        gl.allocate_shared_memory(gl.int32, [2, 64, 8], K_STAGES),
        gl.allocate_shared_memory(gl.int32, [2, 64, 8], V_STAGES),
        gl.allocate_shared_memory(meta, [2, 64], META_STAGES),
        gl.allocate_shared_memory(meta, [2, 64], META_STAGES),
        gl.allocate_shared_memory(meta, [2, 64], META_STAGES),
        gl.allocate_shared_memory(meta, [2, 64], META_STAGES),
    )


@gluon.jit
def copy_tile(buffers, stage, KC, VC, KS, KZ, VS, VZ, block, K_ROW: gl.constexpr, V_ROW: gl.constexpr):
    """Start copying the whole tile at row ``block`` into ``stage`` (no registers held meanwhile), each
    instruction whole rows (COPY_K, COPY_V) of 2-bit K and V; the metadata go in the copy's own layout."""
    k_buf, v_buf, ks_buf, kz_buf, vs_buf, vz_buf = buffers
    _, k_offsets = _word_offsets(gl.constexpr(COPY_K), K_ROW)
    _, v_offsets = _word_offsets(gl.constexpr(COPY_V), V_ROW)
    rows = gl.arange(0, 64, layout=META_COPY)
    _async_load(k_buf.index(stage), KC + block * K_ROW + k_offsets)
    _async_load(v_buf.index(stage), VC + block * V_ROW + v_offsets)
    _async_load(ks_buf.index(stage), KS + block + rows)
    _async_load(kz_buf.index(stage), KZ + block + rows)
    _async_load(vs_buf.index(stage), VS + block + rows)
    _async_load(vz_buf.index(stage), VZ + block + rows)


@gluon.jit
def staged_tile(buffers, stage, PACK: gl.constexpr):
    """A copied tile read back from ``stage`` in the layouts :func:`load_tile` gives."""
    k_buf, v_buf, ks_buf, kz_buf, vs_buf, vz_buf = buffers
    layout: gl.constexpr = META_PAIRS if PACK == 2 else META
    meta = (
        ks_buf.index(stage).load(layout),
        kz_buf.index(stage).load(layout),
        vs_buf.index(stage).load(layout),
        vz_buf.index(stage).load(layout),
    )
    return k_buf.index(stage).load(WORDS_K), v_buf.index(stage).load(WORDS_V), meta
