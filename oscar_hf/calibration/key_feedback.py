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

from oscar_hf.calibration.covariances import collect_query_covariances
from oscar_hf.log import get_logger
from oscar_hf.quant import feedback_factor
from oscar_hf.rotations.rotation_set import RotationSet

logger = get_logger(__name__)

# Tikhonov damping of C_Q, as a share of its mean diagonal (GPTQ's 1%).
DAMPING = 0.01


def key_feedback_factors(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    rotations: RotationSet,
    damping: float = DAMPING,
    progress: bool = True,
) -> dict[int, torch.Tensor]:
    """The key feedback factor of every layer of ``rotations``, float32 ``[H_kv, D, D]`` in its R_K's basis,
    from the queries of ``batches`` (rows as long as the contexts the cache will hold)."""
    covariances = collect_query_covariances(model, batches, "OSCAR key feedback (queries)", progress)
    factors = {}
    for layer_id in sorted(rotations.key):
        covariance = covariances[layer_id].cpu()
        rotation = rotations.key[layer_id].to(torch.float64)  # [D, D] or [H_kv, D, D]
        factors[layer_id] = feedback_factor(rotation.mT @ covariance @ rotation, damping)
    logger.info("key feedback factors of %d layers from %d tokens", len(factors), sum(b.numel() for b in batches))
    return factors
