"""Quantizing rotated rows into the packed history: batched jobs (one launch per format) and single calls.

The fused Triton kernels on GPU, their torch references elsewhere; both give identical codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_hf.config import TensorQuantConfig
from oscar_hf.kernels.quantize import quantize_pack, quantize_pack_into
from oscar_hf.quant import QuantizedRows, dequantize


@dataclass
class QuantizeJob:
    """Rotated rows to quantize as ``spec`` says, straight into their history slots."""

    spec: TensorQuantConfig
    rows: torch.Tensor  # [B, H, n, D]
    target: QuantizedRows  # views of the history buffers


def quantize_jobs(jobs: list[QuantizeJob], metadata_dtype: torch.dtype) -> None:
    """Run quantize jobs, one kernel launch per shared format (every layer's K and V of oscar-int2: one)."""
    by_format: dict[tuple, list[QuantizeJob]] = {}
    for job in jobs:
        spec = job.spec
        by_format.setdefault((spec.bits, spec.group_of(job.rows.shape[-1]), spec.symmetric, job.rows.shape), []).append(
            job
        )
    for (bits, group, symmetric, _), same in by_format.items():
        quantize_pack_into(
            [job.rows for job in same],
            [job.target for job in same],
            bits,
            group,
            symmetric=symmetric,
            clip_ratios=[job.spec.clip_ratio for job in same],
            metadata_dtype=metadata_dtype,
        )


def quantize_rows(rows: torch.Tensor, spec: TensorQuantConfig, metadata_dtype: torch.dtype) -> QuantizedRows:
    """Quantize rotated rows as ``spec`` says (clip, then per-token min-max or symmetric).

    The fused Triton kernel on GPU, the torch reference elsewhere; both give identical codes.
    """
    return quantize_pack(
        rows,
        spec.bits,
        spec.group_of(rows.shape[-1]),
        symmetric=spec.symmetric,
        clip_ratio=spec.clip_ratio,
        metadata_dtype=metadata_dtype,
    )


def roundtrip_rows(rows: torch.Tensor, spec: TensorQuantConfig, metadata_dtype: torch.dtype) -> torch.Tensor:
    """Rows as they come back out of a history quantized with ``spec``."""
    quantized = quantize_rows(rows, spec, metadata_dtype)
    return dequantize(quantized, spec.bits, spec.group_of(rows.shape[-1]), rows.dtype)
