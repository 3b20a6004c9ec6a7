"""Host side of split-K decode attention: plan the splits, choose the history kernel, launch.

:func:`decode_attention_triton` launches, for one call, the Gluon history span
(:mod:`.decode_history_gluon`) where it covers the shape, then the Triton stage 1 over the remaining
slots and the merge (:mod:`.decode_stages`). :mod:`.decode_attention` is the interface that calls it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable

import torch

from oscar_hf.log import get_logger

from ._triton import (
    INTERPRET,
    LOG2E,
    cdiv,
    launch_kernel,
    next_power_of_two,
    programmatic_launch,
    split_rows,
    triton,
)
from .decode_stages import _decode_stage1_kernel, _decode_stage2_kernel
from .decode_unpack import CODE_MAGIC, shift_free_blocks, unpack_asm
from .gluon_span_variant import BIT_WIDTHS, PRODUCTION, SpanVariant

logger = get_logger(__name__)

_DENSE_SPLIT_TOKENS = 256  # dense tiers are short (sink 64, recent <= 263): a couple of splits each
# Dense tiles stay small: the kernel's shared memory is sized by its largest branch, and wide dense
# tiles (pipelined) would cap how many history programs fit on a multiprocessor.
_DENSE_BLOCK_N = 16
_MIN_SPLIT_TOKENS = 256  # below this a history split costs more in the merge than it saves
# Bounds the Triton stage 1's splits (and so the merge's slots). The Gluon span's are not bounded, so
# that they fill their wave (kernels/DESIGN.md).
_MAX_SPLITS = 256
# One warp a program, no stage-1 barrier: each warp keeps its own softmax state over its tiles, and
# the metadata prefetch (see decode_tiles.packed_span) hides what latency is left; 64-key tiles on 1
# warp beat 128-key tiles on 4 at every batch (kernels/DESIGN.md).
_WARPS = 1
_STAGES = 2
_TILE_CODES = 8192  # keys x head_dim a tile: ~250 registers a thread on 1 warp, no spills up to head_dim 256
# Programs of one SM at once, by warps a program: registers bound them, 64K an SM (each warp count's
# registers a thread at its default tile are in kernels/DESIGN.md).
_PROGRAMS_PER_SM = {1: 8, 2: 6, 4: 4, 8: 1}
_MERGE_BLOCK_D = 32


@dataclasses.dataclass(frozen=True)
class LaunchVariant:
    """Variants of the launches around the Gluon span, for kernel development
    (``kernels/tools/time_gluon_history.py``); the defaults are production.

    Attributes:
        span_dense_split_tokens: rows a split of each dense tier beside the span. Beside it the dense
            tiers are a launch of their own, after it, so their time adds up: short splits keep it
            near one tile's latency.
        merge_tile: floats of a merge program's ``[slots, dims]`` tile (64 registers a thread at 4 warps).
        merge_warps: warps a merge program; the tile's size matters more than the warp count
            (``kernels/DESIGN.md``).
        programmatic: overlap the dense tiers and the merge with the span where the device can
            (programmatic dependent launch); False launches them one after another.
        merge_kernel: a kernel with the arguments of ``decode_stages._decode_stage2_kernel`` launched
            in its place, to time the call with a trivial merge (its output is whatever it writes);
            None: the merge.
    """

    span_dense_split_tokens: int = 32
    merge_tile: int = 8192
    merge_warps: int = 4
    programmatic: bool = True
    merge_kernel: Callable | None = None


PRODUCTION_LAUNCH = LaunchVariant()


def _device_programs(device: torch.device, programs_per_sm: int) -> int:
    """History programs that run at once on ``device`` (4 off CUDA). History splits fill one such
    wave: a partial second wave nearly doubles the time (kernels/DESIGN.md)."""
    return programs_per_sm * _multiprocessors(device) if device.type == "cuda" else 4


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(
    length: int,
    requested: int,
    programs_per_split: int,
    device: torch.device,
    block_n: int,
    programs_per_sm: int,
    cap: int | None,
) -> tuple[int, int]:
    """``(splits, chunk)`` for a history of ``length`` rows; ``chunk`` is a multiple of ``block_n``.

    The history programs fill one wave of :func:`_device_programs` where the batch allows, at most
    ``cap`` splits (the short dense-tier programs are scheduled after them and only add a short tail).
    """
    if length == 0:
        return 0, block_n
    wave = max(1, _device_programs(device, programs_per_sm) // programs_per_split)
    return split_rows(length, requested or min(cap or wave, cdiv(length, _MIN_SPLIT_TOKENS), wave), block_n)


def _dense_chunk(length: int, splits: int, block_n: int) -> int:
    return max(1, cdiv(cdiv(length, splits), block_n)) * block_n


def _block_sizes(group: int, head_dim: int, block_n: int) -> tuple[int, int, int]:
    """``(block_h, head_blocks, block_n)``: one row per query head of the group (Triton pads the
    MMA's 16 rows itself, and 4 real rows spend less on the softmax than 16 padded ones), and
    ``_TILE_CODES // head_dim`` keys a tile unless ``block_n`` is given."""
    block_h = min(64, next_power_of_two(group))
    return block_h, cdiv(group, block_h), block_n or min(128, _TILE_CODES // head_dim)


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
    lengths: torch.Tensor | None = None,
    history_settled: bool = False,
    *,
    span_variant: SpanVariant | None = None,
    launch_variant: LaunchVariant | None = None,
) -> torch.Tensor:
    """Launch stage 1 and stage 2 (arguments as :func:`.decode_attention.decode_attention`).

    ``num_splits``, ``block_n`` (keys per tile), ``num_warps`` and ``num_stages`` of stage 1 are tuning
    knobs, 0 meaning automatic (see :func:`_block_sizes`). ``span_variant`` (:class:`.gluon_span_variant.SpanVariant`)
    and ``launch_variant`` (:class:`LaunchVariant`) are for kernel development; None is production.
    """
    span_variant, launch_variant = span_variant or PRODUCTION, launch_variant or PRODUCTION_LAUNCH
    gluon = _gluon_history(q, k_codes, k_bits, v_bits, k_scale, v_scale, tuned=bool(num_splits or block_n or num_warps))
    batch, q_heads, head_dim = q.shape
    kv_heads = sink_k.shape[1]
    group = q_heads // kv_heads
    block_h, head_blocks, block_n = _block_sizes(group, head_dim, block_n)
    num_stages = num_stages or (1 if q.dtype == torch.float32 else _STAGES)
    n_sink, n_hist, n_recent, n_new = sink_k.shape[2], k_codes.shape[2], recent_k.shape[2], new_k.shape[2]
    dense_tokens = launch_variant.span_dense_split_tokens if gluon else _DENSE_SPLIT_TOKENS
    # One number of splits for all three tiers, which leaves some empty beside the span. Where the span
    # is less than a wave, those empty programs keep the next call's span programs from starting late
    # (kernels/DESIGN.md, "What bounds the decode call").
    dense_splits = max(1, cdiv(max(n_sink, n_recent, n_new), dense_tokens))
    programs_per_split = batch * kv_heads * head_blocks
    num_warps = num_warps or _WARPS
    if gluon:  # the explicit-layout span fills the history slots: one-warp programs of 64 keys, all heads
        hist_splits, chunk_hist = _splits(
            n_hist, 0, batch * kv_heads, q.device, 64, span_variant.programs_per_sm(), None
        )
    else:
        hist_splits, chunk_hist = _splits(
            n_hist, num_splits, programs_per_split, q.device, block_n, _PROGRAMS_PER_SM.get(num_warps, 1), _MAX_SPLITS
        )
    n_slots = hist_splits + 3 * dense_splits

    partial_m, partial_l, partial_acc = _partials(batch, q_heads, n_slots, head_dim, q.device, reuse=lengths is None)
    out = torch.empty(batch, q_heads, head_dim, dtype=q.dtype, device=q.device)
    # Masks travel as bytes (bool pointers are not portable across Triton versions). Without one the
    # kernel never reads the pointer: q stands in, sparing an allocation per call.
    mask = q if key_mask is None else key_mask.to(torch.uint8).contiguous()
    t = _last_dim_contiguous
    magic, offset = CODE_MAGIC[q.dtype][:2]

    first_slot = hist_splits if gluon else 0
    # On Hopper and later the dense tiers and the merge launch early (programmatic dependent launch):
    # the dense tiers fill the span's tail instead of waiting for all of it, and launch gaps hide.
    overlap = gluon and launch_variant.programmatic and programmatic_launch(q.device)
    if gluon:
        from .decode_history_gluon import history_into  # Gluon is optional: imported once it has loaded

        history_into(
            q,
            k_codes,
            k_scale,
            k_zero,
            v_codes,
            v_scale,
            v_zero,
            sm_scale,
            partial_m,
            partial_l,
            partial_acc,
            hist_splits,
            chunk_hist,
            lengths,
            launch_dependents=overlap,
            early=overlap and history_settled,
            variant=span_variant,
        )
    launch_kernel(
        _decode_stage1_kernel,
        (batch, kv_heads * head_blocks, n_slots - first_slot),
        *t(q),
        *t(sink_k),
        *t(sink_v),
        n_sink,
        _dense_chunk(n_sink, dense_splits, _DENSE_BLOCK_N),
        *t(recent_k),
        *t(recent_v),
        n_recent,
        _dense_chunk(n_recent, dense_splits, _DENSE_BLOCK_N),
        *t(new_k),
        *t(new_v),
        n_new,
        _dense_chunk(n_new, dense_splits, _DENSE_BLOCK_N),
        *_code_rows(k_codes, head_dim),
        *t(k_scale),
        *t(k_zero),
        *_code_rows(v_codes, head_dim),
        *t(v_scale),
        *t(v_zero),
        n_hist,
        chunk_hist,
        mask,
        mask.stride(0),
        partial_m,
        partial_l,
        partial_acc,
        sm_scale * LOG2E,
        hist_splits,
        dense_splits,
        n_slots,
        first_slot,
        q if lengths is None else lengths,  # unread without RING
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DENSE_BLOCK_N=_DENSE_BLOCK_N,
        D=head_dim,
        K_BITS=k_bits,
        K_GROUPS=k_scale.shape[-1],
        V_BITS=v_bits,
        V_GROUPS=v_scale.shape[-1],
        MAGIC=magic,
        OFFSET=offset,
        K_FREE=shift_free_blocks(k_bits, q.dtype),
        V_FREE=shift_free_blocks(v_bits, q.dtype),
        K_UNPACK="" if INTERPRET else unpack_asm(k_bits, q.dtype),
        V_UNPACK="" if INTERPRET else unpack_asm(v_bits, q.dtype),
        HAS_MASK=key_mask is not None,
        RING=lengths is not None,
        INTERPRETED=INTERPRET,
        AFTER_SPAN=overlap,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=overlap,
    )
    # Blocks of dims spread the merge over more programs than one a head (kernels/DESIGN.md);
    # narrower beyond 256 slots, so that a program's tile stays within merge_tile floats.
    slots = next_power_of_two(n_slots)
    block_d = min(head_dim, _MERGE_BLOCK_D, max(1, launch_variant.merge_tile // slots))
    merge = launch_variant.merge_kernel or _decode_stage2_kernel
    launch_kernel(
        merge,
        (batch, q_heads, head_dim // block_d),
        partial_m,
        partial_l,
        partial_acc,
        *t(out),
        n_slots,
        D=head_dim,
        BLOCK_D=block_d,
        SLOTS=slots,
        INTERPRETED=INTERPRET,
        DEPENDENT=overlap,
        num_warps=launch_variant.merge_warps,
        launch_pdl=overlap,
    )
    return out


# (device, stream, thread) -> the partial buffers of the latest eager call there
_PARTIALS: dict[tuple, tuple[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}


def _partials(batch: int, q_heads: int, n_slots: int, head_dim: int, device: torch.device, reuse: bool):
    """``(m, l, acc)`` slot buffers, float32 ``[B, Hq, n_slots]`` (acc ``[..., D]``).

    They live from stage 1 to stage 2 of one call. Calls from one thread on one stream run in
    order, so eager calls there share one set while the shape stays (every layer of a step):
    three allocations fewer a call, and eager batch-1 decoding is bound by host time. One set stays
    allocated per stream and thread (at most ~300 slots: 4.4 MB at batch 1 for 32 heads of 128 dims).
    Static decoding (``reuse`` false) allocates inside the graph it is captured in.
    """
    shape = (batch, q_heads, n_slots, head_dim)
    reuse = reuse and device.type == "cuda"
    if reuse:
        where = (device, triton.runtime.driver.active.get_current_stream(device.index), threading.get_ident())
        kept = _PARTIALS.get(where)
        if kept is not None and kept[0] == shape:
            return kept[1]
    m = torch.empty(batch, q_heads, n_slots, dtype=torch.float32, device=device)
    buffers = (m, torch.empty_like(m), torch.empty(shape, dtype=torch.float32, device=device))
    if reuse:
        _PARTIALS[where] = (shape, buffers)
    return buffers


HISTORY_KERNELS = ("gluon", "triton")


def _gluon_history(q, k_codes, k_bits, v_bits, k_scale, v_scale, tuned: bool) -> bool:
    """Whether the history slots come from the explicit-layout span (``kernels/decode_history_gluon.py``):
    on a GPU, for the shapes it covers, at the launcher's default tiles, where this Triton has Gluon, unless
    ``OSCAR_DECODE_HISTORY=triton`` asks for the Triton stage 1 throughout. It reads the bit widths in
    ``gluon_span_variant.BIT_WIDTHS``.

    Raises:
        ValueError: ``OSCAR_DECODE_HISTORY`` is neither ``gluon`` nor ``triton``.
        RuntimeError: ``OSCAR_DECODE_HISTORY=gluon`` asked for the span where it cannot load.
    """
    choice = os.environ.get("OSCAR_DECODE_HISTORY")
    if choice not in (None, *HISTORY_KERNELS):
        raise ValueError(f"OSCAR_DECODE_HISTORY={choice!r}: expected one of {HISTORY_KERNELS}")
    covered = (
        choice != "triton"
        and q.is_cuda
        and not INTERPRET
        and q.dtype == torch.bfloat16
        and q.shape[-1] == 128
        and (k_bits, v_bits) in BIT_WIDTHS
        and k_scale.shape[-1] == v_scale.shape[-1] == 1
        and q.shape[1] // k_codes.shape[1] <= 8
        and not tuned
        and k_codes.shape[2] > 0
    )
    if not covered:
        return False
    reason = _gluon_unavailable()
    if reason is not None and choice == "gluon":
        raise RuntimeError(f"OSCAR_DECODE_HISTORY=gluon, but the Gluon span cannot load here ({reason})")
    return reason is None


@functools.cache
def _gluon_unavailable() -> str | None:
    """Why the Gluon span cannot load with this Triton (it needs 3.6 or later), or None.
    Logged once; the Triton stage 1 then reads the history."""
    try:
        from . import decode_history_gluon  # noqa: F401
    except (ImportError, AttributeError) as error:
        reason = f"triton {triton.__version__}: {type(error).__name__}: {error}"
        logger.warning("the Gluon history span cannot load (%s): decoding uses the Triton kernel alone", reason)
        return reason
    return None


def _code_rows(codes: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """As :func:`_last_dim_contiguous`, for packed codes whose rows the kernel takes to start ``head_dim / 8``
    bytes apart or a multiple of that (:func:`.decode_unpack.load_code_blocks`): a row of any width is,
    and the cache's buffers keep them so; another view is copied."""
    codes, strides = _last_dim_contiguous(codes)
    if strides[-1] % (head_dim // 8) and codes.numel():
        codes, strides = _last_dim_contiguous(codes.contiguous())
    return codes, strides


def _last_dim_contiguous(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(tensor, strides of all but the last dim)``; kernels index the last dim with unit stride."""
    strides = tensor.stride()
    if strides[-1] != 1 and tensor.numel():
        tensor = tensor.contiguous()
        strides = tensor.stride()
    return tensor, strides[:-1]
