"""Quantizing rotated rows into the packed history: batched jobs (one launch per format) and single calls.

The fused Triton kernels on GPU, their torch references elsewhere; both give identical codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_hf.config import TensorQuantConfig
from oscar_hf.kernels.quantize import quantize_pack
from oscar_hf.kernels.quantize_many import quantize_pack_into
from oscar_hf.quant import QuantizedRows, dequantize


@dataclass
class QuantizeJob:
    """Rotated rows to quantize as ``spec`` says, straight into their history slots."""

    spec: TensorQuantConfig
    rows: torch.Tensor  # [B, H, n, D]
    target: QuantizedRows  # views of the history buffers
    feedback: torch.Tensor | None = None  # the layer's key feedback factor (keys only)


def quantize_jobs(jobs: list[QuantizeJob], metadata_dtype: torch.dtype) -> None:
    """Run quantize jobs, one kernel launch per shared format (oscar-int2: every layer's K with feedback in one,
    every layer's V in another)."""
    by_format: dict[tuple, list[QuantizeJob]] = {}
    for job in jobs:
        spec, feeds_back = job.spec, job.feedback is not None
        by_format.setdefault(
            (spec.bits, spec.group_of(job.rows.shape[-1]), spec.symmetric, job.rows.shape, feeds_back), []
        ).append(job)
    for (bits, group, symmetric, _, feeds_back), same in by_format.items():
        quantize_pack_into(
            [job.rows for job in same],
            [job.target for job in same],
            bits,
            group,
            symmetric=symmetric,
            clip_ratios=[job.spec.clip_ratio for job in same],
            metadata_dtype=metadata_dtype,
            feedback=[job.feedback for job in same] if feeds_back else None,
        )


def quantize_rows(
    rows: torch.Tensor, spec: TensorQuantConfig, metadata_dtype: torch.dtype, feedback: torch.Tensor | None = None
) -> QuantizedRows:
    """Quantize rotated rows as ``spec`` says (clip, then per-token min-max or symmetric), with key feedback
    if ``feedback`` is given (rows ``[..., H_kv, n, D]``).

    The fused Triton kernel on GPU, the torch reference elsewhere; both give identical codes.
    """
    return quantize_pack(
        rows,
        spec.bits,
        spec.group_of(rows.shape[-1]),
        symmetric=spec.symmetric,
        clip_ratio=spec.clip_ratio,
        metadata_dtype=metadata_dtype,
        feedback=feedback,
    )


def roundtrip_rows(
    rows: torch.Tensor, spec: TensorQuantConfig, metadata_dtype: torch.dtype, feedback: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows as they come back out of a history quantized with ``spec`` (and ``feedback``)."""
    quantized = quantize_rows(rows, spec, metadata_dtype, feedback)
    return dequantize(quantized, spec.bits, spec.group_of(rows.shape[-1]), rows.dtype)
