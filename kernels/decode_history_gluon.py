"""The packed-history span of decode attention in Gluon, host side: stage the inputs and launch.

The span covers 2-, 3- or 4-bit K and 2- or 1-bit V (:data:`BIT_WIDTHS`) with one (scale, zero) per row,
bf16, head_dim 128 and up to 8 query heads per KV head. On a GPU the decode call (:mod:`.decode_launch`) takes its history slots from
here for the shapes it covers (``OSCAR_DECODE_HISTORY=triton`` opts out); the dense tiers (a Triton
launch) and the merge follow it, as programmatic dependent launches on Hopper, so they start in the
span's tail. The kernel is :mod:`.gluon_span_kernel` (its design in ``kernels/DESIGN.md``), its
development switches :mod:`.gluon_span_variant`.

:func:`history_partials` and :func:`merge_partials` run the span alone and merge its slots in torch,
for tests and tools.
"""

from __future__ import annotations

import torch

from ._triton import LOG2E, launch_kernel, split_rows
from .gluon_span_kernel import history_kernel
from .gluon_span_layouts import halves
from .gluon_span_operands import value_unpack_asm
from .gluon_span_variant import BIT_WIDTHS, PRODUCTION, SpanVariant


def history_into(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    sm_scale: float,
    partial_m: torch.Tensor,
    partial_l: torch.Tensor,
    partial_acc: torch.Tensor,
    splits: int,
    chunk: int,
    lengths: torch.Tensor | None = None,
    pipeline: bool | None = None,
    launch_dependents: bool = False,
    early: bool = False,
    *,
    variant: SpanVariant = PRODUCTION,
) -> None:
    """Write the packed history's partial results into slots ``[0, splits)`` of the decode kernel's
    buffers (``partial_m``/``partial_l`` ``[B, Hq, n_slots]``, ``partial_acc`` ``[B, Hq, n_slots, D]``;
    m and l in base-2 units): ``chunk`` rows a split, or with ``lengths`` (static decoding) the first
    ``lengths[0]`` rows split on the device. The codes' bit widths (:data:`BIT_WIDTHS`) follow from
    their rows' bytes. ``pipeline``: stage the next tile in shared memory (see
    :func:`.gluon_span_kernel._history_span`); None (the default) stages 2-bit K and V where the
    metadata are aligned for it, as a cache's buffers are. ``launch_dependents`` (Hopper
    and later): the next kernel may start before this one ends, and must not read what it writes
    without waiting (``griddepcontrol.wait``). ``early`` (Hopper and later, staged): this launch may
    start before the kernel ahead of it ends, copying its first tiles meanwhile; only for a history
    (and ``lengths``) that kernel does not write, as in a decode step, where it rotates q. ``variant``:
    see :class:`SpanVariant`."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k_codes.shape[1]
    group = q_heads // kv_heads
    bits = (8 * k_codes.shape[-1] // head_dim, 8 * v_codes.shape[-1] // head_dim)
    shape = (head_dim, k_scale.shape[-1], v_scale.shape[-1], q.dtype)
    if shape != (128, 1, 1, torch.bfloat16) or bits not in BIT_WIDTHS:
        raise ValueError(
            "the span covers 2-, 3- or 4-bit K with 2- or 1-bit V, head_dim 128, one group, bf16 only; "
            f"got {bits[0]}-bit K and {bits[1]}-bit V"
        )
    if group > 8:
        raise ValueError(f"the span covers at most 8 query heads per KV head, got {group}")
    q = q.contiguous()
    # Rows are read in place (a cache's buffers hold more rows than are valid): no copies per call.
    words_k, words_v = _code_words(k_codes), _code_words(v_codes)
    meta = [_metadata_in_place(t) for t in (k_scale, k_zero, v_scale, v_zero)]
    strides = [t.stride()[:2] for t in meta]
    if strides.count(strides[0]) != 4:  # the kernel takes one pair of strides for all four
        meta = [t.contiguous() for t in meta]
        strides = [t.stride()[:2] for t in meta]
    aligned = staging_aligned(meta)
    if pipeline is None:
        pipeline = aligned and bits == (2, 2)
    elif pipeline and bits != (2, 2):
        raise ValueError(f"pipeline=True stages 2-bit K and V only, got {bits[0]}-bit K and {bits[1]}-bit V")
    elif pipeline and not aligned:
        raise ValueError(
            "pipeline=True stages the metadata with 4-byte copies: each head's rows must start "
            "16-row aligned (ROW_ALIGNMENT)"
        )
    if early and pipeline:  # a copy made here is the kernel just before the span: its rows are not settled
        originals = (k_codes, v_codes, k_scale, k_zero, v_scale, v_zero)
        early = all(a.data_ptr() == b.data_ptr() for a, b in zip((words_k, words_v, *meta), originals))
    else:
        early = False
    launch_kernel(
        history_kernel,
        (batch, kv_heads, splits),
        q,
        q.stride(0),
        words_k,
        *words_k.stride()[:2],
        words_v,
        *words_v.stride()[:2],
        *meta,
        *strides[0],
        k_codes.shape[2],
        chunk,
        partial_m,
        partial_l,
        partial_acc,
        partial_m.shape[-1],
        sm_scale * LOG2E,
        q if lengths is None else lengths,  # unread without RING
        q if variant.timeline is None else variant.timeline,  # unread untimed
        GROUP=group,
        V_UNPACK=value_unpack_asm(bits[1]),
        RING=lengths is not None,
        PIPELINE=pipeline,
        LAUNCH_DEPENDENTS=launch_dependents,
        EARLY=early,
        PACK=halves(group, variant.two_halves),
        TIMED=variant.timeline is not None,
        K_BITS=bits[0],
        V_BITS=bits[1],
        K_ROW=words_k.stride(2),
        V_ROW=words_v.stride(2),
        num_warps=1,
        maxnreg=variant.registers,
        launch_pdl=early,
    )


def _code_words(codes: torch.Tensor) -> torch.Tensor:
    """Code rows ``[B, H, L, n]`` (bytes) as int32 words ``[B, H, L, n / 4]``, in place where each row is
    contiguous and rows start 8 bytes aligned (the copies and K's loads are 8 bytes wide), else copied."""
    strides = codes.stride()
    if strides[3] != 1 or strides[2] % 8 or strides[1] % 8 or strides[0] % 8 or codes.data_ptr() % 8:
        codes = codes.contiguous()
    return codes.view(torch.int32)


def _metadata_in_place(rows: torch.Tensor) -> torch.Tensor:
    """One group's scales or zeros ``[B, H, L, 1]`` as the kernel reads them (consecutive rows, any stride
    between heads); copied only where rows are not consecutive."""
    if rows.stride(2) != 1:
        return rows.contiguous()
    return rows


def staging_aligned(metadata: list[torch.Tensor]) -> bool:
    """Whether each head's metadata rows start 16 bytes aligned and Triton can prove it (pointer and
    strides divisible by 16), as ``pipeline=True`` needs."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0 for t in metadata)


def history_partials(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    sm_scale: float,
    splits: int,
    pipeline: bool = False,
    *,
    variant: SpanVariant = PRODUCTION,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The span over the whole packed history in ``splits`` chunks: ``(m, l, acc)`` per (batch, query
    head, split), as :func:`merge_partials` (or the decode kernel's stage 2) merges them."""
    batch, q_heads, head_dim = q.shape
    splits, chunk = split_rows(k_codes.shape[2], splits, 64)
    m = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=q.device)
    l, acc = torch.empty_like(m), torch.empty(batch, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    history_into(
        q,
        k_codes,
        k_scale,
        k_zero,
        v_codes,
        v_scale,
        v_zero,
        sm_scale,
        m,
        l,
        acc,
        splits,
        chunk,
        pipeline=pipeline,
        variant=variant,
    )
    return m, l, acc


def merge_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Attention output ``[B, Hq, D]`` from partial slots (base-2 log-sum-exp), as stage 2 merges them."""
    # An empty slot (m = -inf) weighs nothing; a NaN slot must reach the output, as in stage 2.
    weight = torch.where(torch.isneginf(m), 0.0, torch.exp2(m - m.amax(dim=-1, keepdim=True)))
    return (weight[..., None] * acc).sum(-2) / (weight * l).sum(-1, keepdim=True)
