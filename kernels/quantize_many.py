"""Many quantize jobs in one launch: every layer's K and V rows into preallocated history views (the
prefill and each demotion from the recent window, :func:`quantize_pack_into`), and
:class:`WindowQuantizer`, the same launch at row offsets read on the device (static decoding).

Each job's rows take :mod:`.quantize_tile`'s steps, as :mod:`.quantize`'s one-tensor kernel does, so
codes and metadata match :func:`oscar_hf.quant.quantize` job by job, bit for bit.
"""

from __future__ import annotations

import torch

from oscar_hf.quant import QuantizedRows, check_bits, check_feedback, clip_index, quantize

from ._triton import HAS_TRITON, INTERPRET, cdiv, launch_kernel, runs_triton, tl, triton
from .quantize_tile import (
    NUM_WARPS,
    exact_launch,
    kernel_supports_quantize,
    quantize_tile,
    rows_per_program,
    store_tile,
)

# ------------------------------------------------------------------------------------------ kernel


# Columns of the int64 job table of _quantize_pack_many_kernel, one row per (source, destination) pair:
# base addresses, and the batch / head / row strides of [B, H, n, *] views (in elements).
_JOB_COLUMNS = (
    "src",
    "src_b",
    "src_h",
    "src_n",
    "codes",
    "codes_b",
    "codes_h",
    "codes_n",
    "scale",
    "zero",
    "meta_b",
    "meta_h",
    "meta_n",
    "clip_index",
    "factor",
    "factor_h",
)


@triton.jit
def _quantize_pack_many_kernel(
    JOBS,
    heads,
    rows_per_head,
    n_rows,
    WINDOW,
    JOB_WIDTH: tl.constexpr,
    SRC_DTYPE: tl.constexpr,
    META_DTYPE: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    DEVICE_WINDOW: tl.constexpr,
    FEEDBACK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program ``(tile, job)``: quantize rows of job ``job``'s ``[B, H, n, D]`` source into its destination.

    All jobs share shape and format; addresses, strides and the clip index come from the job table,
    so one launch serves every layer's K and V (the reference's pointer-table flush). With
    ``DEVICE_WINDOW`` the rows are ``n`` rows from offsets read in ``WINDOW`` (active, first source
    row, first destination row) when the launch runs, and nothing happens unless it is active.
    """
    job = JOBS + tl.program_id(1) * JOB_WIDTH
    index = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = index < n_rows
    b, h, t = index // (heads * rows_per_head), (index // rows_per_head) % heads, index % rows_per_head
    if DEVICE_WINDOW:
        if tl.load(WINDOW) != 0:
            _quantize_job(
                job,
                b,
                h,
                t + tl.load(WINDOW + 1),
                t + tl.load(WINDOW + 2),
                valid,
                SRC_DTYPE,
                META_DTYPE,
                D,
                G,
                BITS,
                SYMMETRIC,
                BLOCK_N,
                RECIPROCAL,
                FEEDBACK,
                INTERPRETED,
            )
    else:
        _quantize_job(
            job,
            b,
            h,
            t,
            t,
            valid,
            SRC_DTYPE,
            META_DTYPE,
            D,
            G,
            BITS,
            SYMMETRIC,
            BLOCK_N,
            RECIPROCAL,
            FEEDBACK,
            INTERPRETED,
        )


@triton.jit
def _quantize_job(
    job,
    b,
    h,
    source_row,
    target_row,
    valid,
    SRC_DTYPE: tl.constexpr,
    META_DTYPE: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    FEEDBACK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Quantize rows ``(b, h, source_row)`` of a job's source into rows ``(b, h, target_row)`` of its destination."""
    src = tl.load(job).to(tl.pointer_type(SRC_DTYPE))
    offsets = b * tl.load(job + 1) + h * tl.load(job + 2) + source_row * tl.load(job + 3)
    x = tl.load(src + offsets[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    clip_index = tl.load(job + 13).to(tl.int32)
    factor = tl.load(job + 14).to(tl.pointer_type(tl.float32)) + h * tl.load(job + 15)  # each row's head's factor
    packed, high, scale, zero = quantize_tile(
        x, clip_index, factor, BLOCK_N, D, G, BITS, SYMMETRIC, RECIPROCAL, FEEDBACK, META_DTYPE, INTERPRETED
    )

    codes = tl.load(job + 4).to(tl.pointer_type(tl.uint8))
    codes_rows = b * tl.load(job + 5) + h * tl.load(job + 6) + target_row * tl.load(job + 7)
    meta_rows = b * tl.load(job + 10) + h * tl.load(job + 11) + target_row * tl.load(job + 12)
    scale_base = tl.load(job + 8).to(tl.pointer_type(META_DTYPE))
    zero_base = tl.load(job + 9).to(tl.pointer_type(META_DTYPE))
    store_tile(
        packed,
        high,
        scale,
        zero,
        codes + codes_rows[:, None],
        scale_base + meta_rows[:, None],
        zero_base + meta_rows[:, None],
        valid,
        D,
        G,
        BITS,
        INTERPRETED,
    )


# ------------------------------------------------------------------------------------------ launch


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32} if HAS_TRITON else {}


def quantize_pack_many_triton(
    sources: list[torch.Tensor],
    destinations: list[QuantizedRows],
    bits: int,
    group_size: int,
    symmetric: bool,
    clip_ratios: list[float],
    metadata_dtype: torch.dtype,
    feedback: list[torch.Tensor] | None = None,
    block_rows: int = 0,
    num_warps: int = 0,
) -> None:
    """One launch for all jobs (arguments as :func:`quantize_pack_into`): a table row per job.

    ``block_rows`` (rows per program) and ``num_warps`` are tuning knobs, 0 meaning the defaults
    (``kernels/tools/tune_quantize.py``).
    """
    table = _job_table(sources, destinations, clip_ratios, feedback)
    _launch_many(
        table,
        sources[0],
        sources[0].shape[2],
        bits,
        group_size,
        symmetric,
        metadata_dtype,
        None,
        feedback is not None,
        block_rows,
        num_warps,
    )


def _job_table(
    sources: list[torch.Tensor],
    destinations: list[QuantizedRows],
    clip_ratios: list[float],
    feedback: list[torch.Tensor] | None,
) -> torch.Tensor:
    """The device table of :func:`_quantize_pack_many_kernel`: addresses, strides, clip index and feedback
    factor (address and head stride, 0 for a shared one) per job."""
    head_dim, jobs = sources[0].shape[-1], []
    factors = feedback or [None] * len(sources)
    for source, target, ratio, factor in zip(sources, destinations, clip_ratios, factors):
        clip = clip_index(ratio, head_dim) if ratio > 0 else -1
        factor_columns = [0, 0] if factor is None else [factor.data_ptr(), factor.stride(0) if factor.ndim == 3 else 0]
        jobs.append(
            [
                source.data_ptr(),
                *source.stride()[:3],
                target.codes.data_ptr(),
                *target.codes.stride()[:3],
                target.scale.data_ptr(),
                target.zero.data_ptr(),
                *target.scale.stride()[:3],
                clip,
                *factor_columns,
            ]
        )
    return torch.tensor(jobs, dtype=torch.int64).to(sources[0].device, non_blocking=True)


def _launch_many(
    table: torch.Tensor,
    like: torch.Tensor,
    rows_per_head: int,
    bits: int,
    group_size: int,
    symmetric: bool,
    metadata_dtype: torch.dtype,
    window: torch.Tensor | None,
    feedback: bool,
    block_rows: int = 0,
    num_warps: int = 0,
) -> None:
    batch, heads, _, head_dim = like.shape
    n_rows = batch * heads * rows_per_head
    block = block_rows or rows_per_program(head_dim)
    launch_kernel(
        _quantize_pack_many_kernel,
        (cdiv(n_rows, block), table.shape[0]),
        table,
        heads,
        rows_per_head,
        n_rows,
        table if window is None else window,
        len(_JOB_COLUMNS),
        SRC_DTYPE=_TL_DTYPES[like.dtype],
        META_DTYPE=_TL_DTYPES[metadata_dtype],
        D=head_dim,
        G=group_size,
        BITS=bits,
        SYMMETRIC=symmetric,
        BLOCK_N=block,
        RECIPROCAL=like.is_cuda and not INTERPRET,
        DEVICE_WINDOW=window is not None,
        FEEDBACK=feedback,
        INTERPRETED=INTERPRET,
        num_warps=num_warps or NUM_WARPS,
        **exact_launch(bits, feedback),
    )


def quantize_pack_many_reference(
    sources: list[torch.Tensor],
    destinations: list[QuantizedRows],
    bits: int,
    group_size: int,
    symmetric: bool,
    clip_ratios: list[float],
    metadata_dtype: torch.dtype,
    feedback: list[torch.Tensor] | None = None,
) -> None:
    """The torch reference of :func:`quantize_pack_into`: one :func:`oscar_hf.quant.quantize` per job."""
    for source, target, ratio, factor in zip(sources, destinations, clip_ratios, feedback or [None] * len(sources)):
        rows = quantize(
            source,
            bits,
            group_size,
            symmetric=symmetric,
            clip_ratio=ratio,
            metadata_dtype=metadata_dtype,
            feedback=factor,
        )
        target.codes.copy_(rows.codes)
        target.scale.copy_(rows.scale)
        target.zero.copy_(rows.zero)


# -------------------------------------------------------------------------------------- jobs


def quantize_pack_into(
    sources: list[torch.Tensor],
    destinations: list[QuantizedRows],
    bits: int,
    group_size: int,
    *,
    symmetric: bool = False,
    clip_ratios: list[float],
    metadata_dtype: torch.dtype = torch.bfloat16,
    feedback: list[torch.Tensor] | None = None,
) -> None:
    """Quantize each ``sources[i]`` ``[B, H, n, D]`` into the preallocated views ``destinations[i]``.

    Every layer's demoted K and V rows in one launch: all jobs share shape, dtype and format, each
    has its own clip ratio (``clip_ratios[i]``, 0 disables) and may be any strided view whose last
    dim is contiguous. ``feedback``, if given, holds every job's feedback factor (float32 ``[D, D]``
    or ``[H, D, D]``, contiguous, on the sources' device; see :func:`oscar_hf.quant.quantize`). Codes
    and metadata are identical to :func:`quantize_pack` job by job.
    """
    if not _check_jobs(sources, destinations, bits, group_size, clip_ratios, metadata_dtype, feedback):
        return
    fits = _kernel_fits(sources, destinations, group_size)
    launch = quantize_pack_many_triton if runs_triton(sources[0]) and fits else quantize_pack_many_reference
    launch(sources, destinations, bits, group_size, symmetric, clip_ratios, metadata_dtype, feedback)


def _check_jobs(sources, destinations, bits, group_size, clip_ratios, metadata_dtype, feedback=None) -> bool:
    """Validate jobs of :func:`quantize_pack_into`; False when there are none."""
    check_bits(bits)
    if not (len(sources) == len(destinations) == len(clip_ratios)):
        raise ValueError("sources, destinations and clip_ratios must have one entry per job")
    if feedback is not None and len(feedback) != len(sources):
        raise ValueError("feedback must hold one factor per job (a launch feeds errors forward in every job or none)")
    for source, factor in zip(sources, feedback or []):
        check_feedback(factor, source, bits)
        if factor.dtype != torch.float32 or not factor.is_contiguous() or factor.device != source.device:
            raise ValueError(f"a feedback factor must be float32 and contiguous on {source.device}")
    if not sources:
        return False
    shape, head_dim = sources[0].shape, sources[0].shape[-1]
    for source, target in zip(sources, destinations):
        if source.shape != shape or source.dtype != sources[0].dtype or source.device != sources[0].device:
            raise ValueError(
                f"all sources must share shape, dtype and device; got {tuple(source.shape)} "
                f"{source.dtype} and {tuple(shape)} {sources[0].dtype}"
            )
        if (
            target.codes.shape != (*shape[:3], head_dim * bits // 8)
            or target.scale.shape != (*shape[:3], head_dim // group_size)
            or target.zero.shape != target.scale.shape
            or target.zero.stride() != target.scale.stride()
            or target.scale.dtype != metadata_dtype
        ):
            raise ValueError(
                f"destination {tuple(target.codes.shape)} / {tuple(target.scale.shape)} does not fit "
                f"{bits}-bit rows of {tuple(shape)} with groups of {group_size}"
            )
    return True


def _kernel_fits(sources: list[torch.Tensor], destinations: list[QuantizedRows], group_size: int) -> bool:
    tensors = [
        t for source, target in zip(sources, destinations) for t in (source, target.codes, target.scale, target.zero)
    ]
    contiguous_rows = all(t.stride(-1) == 1 for t in tensors)
    return kernel_supports_quantize(sources[0].shape[-1], group_size) and contiguous_rows and sources[0].shape[2] > 0


class WindowQuantizer:
    """``count`` rows of each source quantized into its destination at row offsets read on the device.

    Static decoding demotes every layer's oldest ``block`` recent rows, from a ring position into the
    end of the history, whenever the window fills; both positions live on the device. Built once
    (the job table is uploaded here), each call is one launch that a CUDA graph can capture, and
    ``window`` (int64 ``[active, first source row, first destination row]``) is read when it runs.

    Args:
        sources: whole buffers ``[B, H, N, D]`` (e.g. every layer's recent-window rings of K and V).
        destinations: whole history buffers, one per source.
        count: rows per job.
        window: the device tensor described above; the caller updates it in place.
        bits, group_size, symmetric, clip_ratios, metadata_dtype, feedback: as :func:`quantize_pack_into`.
    """

    def __init__(
        self,
        sources: list[torch.Tensor],
        destinations: list[QuantizedRows],
        count: int,
        window: torch.Tensor,
        bits: int,
        group_size: int,
        *,
        symmetric: bool = False,
        clip_ratios: list[float],
        metadata_dtype: torch.dtype = torch.bfloat16,
        feedback: list[torch.Tensor] | None = None,
    ):
        _check_jobs(
            [s[:, :, :count] for s in sources],
            [_rows_of(d, count) for d in destinations],
            bits,
            group_size,
            clip_ratios,
            metadata_dtype,
            feedback,
        )
        if window.shape != (3,) or window.dtype != torch.int64 or window.device != sources[0].device:
            raise ValueError(
                f"window must be int64 [3] on {sources[0].device}, got {tuple(window.shape)} {window.dtype}"
            )
        self.sources, self.destinations, self.count, self.window = sources, destinations, count, window
        self.format = dict(bits=bits, group_size=group_size, symmetric=symmetric, metadata_dtype=metadata_dtype)
        self.clip_ratios, self.feedback = clip_ratios, feedback  # the factors stay alive while the table points at them
        fits = _kernel_fits(sources, destinations, group_size)
        kernel = runs_triton(sources[0]) and fits
        self.table = _job_table(sources, destinations, clip_ratios, feedback) if kernel else None

    def __call__(self) -> None:
        f = self.format
        if self.table is not None:
            _launch_many(
                self.table,
                self.sources[0],
                self.count,
                f["bits"],
                f["group_size"],
                f["symmetric"],
                f["metadata_dtype"],
                self.window,
                self.feedback is not None,
            )
            return
        active, source_row, target_row = (int(v) for v in self.window.tolist())  # reference: a host sync
        if active:
            sources = [s[:, :, source_row : source_row + self.count] for s in self.sources]
            targets = [_rows_of(d, self.count, target_row) for d in self.destinations]
            quantize_pack_many_reference(
                sources,
                targets,
                f["bits"],
                f["group_size"],
                f["symmetric"],
                self.clip_ratios,
                f["metadata_dtype"],
                self.feedback,
            )


def _rows_of(rows: QuantizedRows, count: int, start: int = 0) -> QuantizedRows:
    return QuantizedRows(*(t[:, :, start : start + count] for t in (rows.codes, rows.scale, rows.zero)))
