"""One layer's attention step: attend over ``[sink | history | recent | new]`` and store the new chunk.

Attention runs in the rotated basis: ``q·R_K`` against stored ``K·R_K`` (so scores equal ``q·k``), and
the output is mapped back with ``o·R_V^T``. Three paths, one owner:

* a frozen layer (:mod:`oscar_hf.core.frozen_decoding`): its static layout attends, shape-stable;
* one decode token: :func:`oscar_hf.kernels.decode_attention.decode_attention` reads the packed
  history directly (the split-K Triton kernel on GPU, its torch reference elsewhere);
* a chunk (prefill, chunked prefill, verification): the history is dequantized transiently and SDPA
  runs over the dense tiers (prefill is compute-bound, and nothing dense outlives the call).
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from oscar_hf.kernels.decode_attention import DecodeTiers, decode_attention


class LayerAttention:
    """The attention step of :class:`~oscar_hf.core.layer.OscarLayer` (a mixin: it runs the layer's step
    phases and reads its tiers)."""

    def is_plain_decode(self, query: torch.Tensor, module: torch.nn.Module, kwargs: dict) -> bool:
        """One query token of softmax attention the decode kernel computes exactly.

        Logit soft-capping, learned sinks and dropout are not in the kernel; those go the SDPA way.
        """
        return (
            query.shape[2] == 1
            and self.config.quantized
            and kwargs.get("softcap") is None
            and kwargs.get("s_aux") is None
            and not (module.training and kwargs.get("dropout", 0.0))
        )

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        plain_decode: bool,
        kwargs: dict,
    ) -> torch.Tensor:
        """Attention of ``module``'s query over the layer's tiers and its pending chunk (``key``/``value``),
        which the layer then stores; ``plain_decode`` from :meth:`is_plain_decode`, ``kwargs`` as
        transformers passes them to attention functions. ``[B, T, Hq, D]``."""
        if self.static is not None:  # a frozen cache: shape-stable, nothing read on the host
            if not plain_decode:
                raise ValueError(
                    "static decoding computes plain softmax attention of one token (no soft-capping, "
                    "learned sinks or dropout)"
                )
            return self.static.attend(self, query, kwargs.get("scaling"))
        new_keys, new_values, plan = self.begin_step(attention_mask)
        if plain_decode:
            return self._decode(query, new_keys, new_values, plan, attention_mask, kwargs.get("scaling"))
        new_keys, new_values = self.rotate_chunk(new_keys, new_values)
        if self.stored_length == 0:
            # A first chunk attends only to itself: the K/V as given yield the same attention as their
            # rotated copies, without rotating q, concatenating tiers and rotating the output back.
            output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        else:
            keys, values = self.dense_rotated(new_keys, new_values)
            output, _ = sdpa_attention_forward(module, self.rotate_keys(query), keys, values, attention_mask, **kwargs)
            output = self.unrotate_values(output, heads_axis=2)  # sdpa_attention_forward returns [B, T, H, D]
            del keys, values
        self.finish_step(new_keys, new_values, plan)
        return output

    def _decode(self, query, new_keys, new_values, plan, attention_mask, scaling) -> torch.Tensor:
        """``[B, 1, Hq, D]`` attention output of one token over all tiers, which the layer then stores.

        One launch rotates q, K and V; K and V go straight into the recent window when the plan puts
        them there, so the window already holds them when attention reads it.
        """
        query, new_keys, new_values = self.rotate_step(query, new_keys, new_values, into_window=plan.joins_window)
        key_mask = None if attention_mask is None else allowed_keys(attention_mask)
        output = self.decode_over(query, self.decode_tiers(new_keys, new_values, key_mask), scaling)
        self.finish_step(new_keys, new_values, plan)
        return output

    def decode_tiers(
        self,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> DecodeTiers:
        """The layer's tiers and the new rows as a decode step reads them: the stored rows, or with
        ``lengths`` (a frozen layer) every allocated row, whose valid ones the lengths say."""
        frozen = lengths is not None
        history_k, history_v = (h.whole() if frozen else h.packed() for h in (self.history_keys, self.history_values))
        recent_k, recent_v = (r.data if frozen else r.view() for r in (self.recent_keys, self.recent_values))
        return DecodeTiers(
            self.sink_keys.view(),
            self.sink_values.view(),
            history_k,
            history_v,
            recent_k,
            recent_v,
            new_keys,
            new_values,
            self.config.key.bits,
            self.config.value.bits,
            key_mask,
            lengths,
        )

    def decode_over(self, query: torch.Tensor, tiers: DecodeTiers, scaling: float | None) -> torch.Tensor:
        """``[B, 1, Hq, D]``: the rotated ``query`` attends over ``tiers``, mapped back by R_V^T."""
        # the history last changed in an earlier step; the kernels launched since write none of it
        return self.unrotate_output(decode_attention(query, tiers, sm_scale=scaling, history_settled=True))


def allowed_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[batch, keys]``, True where the newest query may attend, from a decode step's 4D mask (bool,
    or additive float)."""
    allowed = attention_mask[:, 0, -1, :]
    return allowed if allowed.dtype == torch.bool else allowed == 0
