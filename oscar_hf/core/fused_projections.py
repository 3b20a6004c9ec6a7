"""Sibling projections of one input (q/k/v, gate/up) computed by one GEMM over their stacked weights.

A batch-1 decode step is a chain of matrix-vector products bound by reading weights. cuBLAS reads
small projections (k and v under GQA) at a lower bandwidth than large ones, and each of the three
gets its own split-K reduction. One GEMM over ``[W_q; W_k; W_v]``
reads the same bytes in one launch. The products are the same up to rounding: on a GPU a stacked
GEMM may run another kernel (another split of the reduction) than the sibling's own, so a value can
differ in its last bit.

The model's own forwards stay in charge (no per-architecture code): while :func:`fused_projections`
is active, the first sibling called on an input runs the stacked GEMM and each sibling returns its
slice of that output. A sibling called on a different input computes its own product, so the result
never depends on call order. The siblings' weights become views into the stacked one while fused, so
no memory is duplicated. When the context ends, the siblings get weights of their own again.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from oscar_hf.log import get_logger

logger = get_logger(__name__)

# Sibling projections by module: attention (q, k, v) and gated MLPs (gate, up).
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class StackedProjection(torch.nn.Module):
    """Linear layers that read the same input, as one GEMM. Registered on the module that owns them,
    so that a compiled forward sees the stacked weight as a module input, as it sees theirs (one
    compiled graph then serves every layer); as buffers that ``state_dict`` leaves out."""

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        self.register_buffer("weight", torch.cat([linear.weight.detach() for linear in linears]), persistent=False)
        biases = [linear.bias for linear in linears]
        self.register_buffer(
            "bias", None if biases[0] is None else torch.cat([b.detach() for b in biases]), persistent=False
        )
        self.bounds = [0]
        for linear in linears:
            self.bounds.append(self.bounds[-1] + linear.out_features)
        self.last_input: torch.Tensor | None = None
        self.last_output: torch.Tensor | None = None

    def sibling_forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index``'s output on ``x``: a slice of the stacked GEMM's output on ``x``. The last
        sibling forgets the output, so no activation outlives the forward (and a compiled forward
        always starts from the same state)."""
        output = self.last_output if x is self.last_input else F.linear(x, self.weight, self.bias)
        last = index == len(self.bounds) - 2
        self.last_input, self.last_output = (None, None) if last else (x, output)
        return output[..., self.bounds[index] : self.bounds[index + 1]]


def sibling_groups(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, tuple[str, ...], list[torch.nn.Linear]]]:
    """Each module's sibling linears of :data:`SIBLING_NAMES` that can share one GEMM: same input
    size, dtype and device, all with or all without bias, plain weights (not a tensor subclass such as
    a tensor-parallel shard or a quantized weight, which stacking would gather or dequantize), and
    no hooks or replaced forwards. Yields (owner, their names, the linears)."""
    for module in model.modules():
        for names in SIBLING_NAMES:
            linears = [getattr(module, name, None) for name in names]
            if all(type(linear) is torch.nn.Linear for linear in linears) and _stackable(linears):
                yield module, names, linears


def _stackable(linears: list[torch.nn.Linear]) -> bool:
    first = linears[0].weight
    return all(
        linear.in_features == linears[0].in_features
        and (linear.bias is None) == (linears[0].bias is None)
        and type(linear.weight.data) is torch.Tensor
        and linear.weight.dtype == first.dtype
        and linear.weight.device == first.device
        and "forward" not in linear.__dict__
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
        for linear in linears
    )


@contextlib.contextmanager
def fused_projections(model: torch.nn.Module) -> Iterator[list[StackedProjection]]:
    """Meanwhile, every group of sibling projections of ``model`` runs as one GEMM (see the module doc).

    Yields the stacked projections. Weights are restored (own storage, same values) on exit.
    """
    fused: list[tuple[torch.nn.Module, str, list[torch.nn.Linear], StackedProjection]] = []
    try:
        for module, names, linears in sibling_groups(model):
            stacked = StackedProjection(linears)
            name = "oscar_stacked_" + "_".join(n.removesuffix("_proj") for n in names)
            module.register_module(name, stacked)
            for index, linear in enumerate(linears):
                lo, hi = stacked.bounds[index], stacked.bounds[index + 1]
                linear.weight.data = stacked.weight.data[lo:hi]  # a view: the old storage is freed
                if linear.bias is not None:
                    linear.bias.data = stacked.bias.data[lo:hi]
                linear.forward = _sibling_forward(stacked, index)
            fused.append((module, name, linears, stacked))
        logger.info("fused %d groups of sibling projections into one GEMM each", len(fused))
        yield [stacked for *_, stacked in fused]
    finally:
        for module, name, linears, _ in fused:
            for linear in linears:
                del linear.forward
                linear.weight.data = linear.weight.data.clone()
                if linear.bias is not None:
                    linear.bias.data = linear.bias.data.clone()
            delattr(module, name)


def _sibling_forward(stacked: StackedProjection, index: int):
    # A closure, not functools.partial: Dynamo guarded each layer's partial apart and compiled a
    # graph per layer (18 graphs against 6 for a 10-layer model), while closures share one.
    def forward(x: torch.Tensor) -> torch.Tensor:
        return stacked.sibling_forward(index, x)

    return forward
