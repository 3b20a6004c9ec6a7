"""Key feedback factors: what a key's quantization error costs in the scores, per layer and KV head.

A stored key ``k_hat = k + e`` changes every later query's score by ``q . e``, so the error to minimise is
``e C_Q e^T`` with ``C_Q`` the covariance of the queries that will read it (post-RoPE, in the rotated basis
``R_K^T C_Q R_K``, over the KV head's query group). That is GPTQ's objective with ``C_Q`` as its Hessian;
:func:`oscar_hf.quant.feedback_factor` turns it into the factor a quantizer feeds errors forward with.

Post-RoPE queries rotate their channel pairs with position, slowly in the low-frequency pairs, so ``C_Q``
is measured on rows as long as the contexts the cache will hold (``seq_len``), not on short ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from oscar_hf.calibration.covariances import observe_attention
from oscar_hf.log import get_logger
from oscar_hf.quant import feedback_factor
from oscar_hf.rotations.rotation_set import RotationSet

logger = get_logger(__name__)

# Tikhonov damping of C_Q, as a share of its mean diagonal (GPTQ's 1%).
DAMPING = 0.01


def query_covariances(
    model: PreTrainedModel, batches: Sequence[torch.LongTensor], progress: bool = True
) -> dict[int, torch.Tensor]:
    """``C_Q^(h)`` of every full-attention layer, float64 ``[H_kv, D, D]``: the mean of ``q^T q`` over the
    tokens of ``batches`` and the query heads of each KV head's (contiguous) group."""
    sums: dict[int, list] = {}

    def observe(layer_id: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        batch, heads, length, dim = query.shape
        grouped = query.to(torch.float64).reshape(batch, key.shape[1], heads // key.shape[1], length, dim)
        outer = torch.einsum("bhgti,bhgtj->hij", grouped, grouped)
        entry = sums.setdefault(layer_id, [0, 0])
        entry[0] = entry[0] + outer
        entry[1] += batch * length * (heads // key.shape[1])

    observe_attention(model, batches, observe, "OSCAR key feedback (queries)", progress)
    return {layer_id: outer / count for layer_id, (outer, count) in sorted(sums.items())}


def key_feedback_factors(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    rotations: RotationSet,
    damping: float = DAMPING,
    progress: bool = True,
) -> dict[int, torch.Tensor]:
    """The key feedback factor of every layer of ``rotations``, float32 ``[H_kv, D, D]`` in its R_K's basis,
    from the queries of ``batches`` (rows as long as the contexts the cache will hold)."""
    covariances = query_covariances(model, batches, progress)
    factors = {}
    for layer_id in sorted(rotations.key):
        covariance = covariances[layer_id].cpu()
        rotation = rotations.key[layer_id].to(torch.float64)  # [D, D] or [H_kv, D, D]
        factors[layer_id] = feedback_factor(rotation.mT @ covariance @ rotation, damping)
    logger.info("key feedback factors of %d layers from %d tokens", len(factors), sum(b.numel() for b in batches))
    return factors
