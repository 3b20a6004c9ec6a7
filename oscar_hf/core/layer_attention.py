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

from oscar_hf.kernels.decode_attention import decode_attention


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
                raise ValueError("static decoding computes plain softmax attention of one token (no soft-capping, "
                                 "learned sinks or dropout)")  # fmt: skip
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
        history_k, history_v = self.history_keys.packed(), self.history_values.packed()
        output = decode_attention(
            query, self.sink_keys.view(), self.sink_values.view(),
            history_k.codes, history_k.scale, history_k.zero, history_v.codes, history_v.scale, history_v.zero,
            self.recent_keys.view(), self.recent_values.view(), new_keys, new_values,
            k_bits=self.config.key.bits, v_bits=self.config.value.bits, sm_scale=scaling, key_mask=key_mask,
            history_settled=True,  # it last changed in an earlier finish_step; kernels since write no history
        )  # fmt: skip
        self.finish_step(new_keys, new_values, plan)
        return self.unrotate_output(output)


def allowed_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[batch, keys]``, True where the newest query may attend, from a decode step's 4D mask (bool,
    or additive float)."""
    allowed = attention_mask[:, 0, -1, :]
    return allowed if allowed.dtype == torch.bool else allowed == 0
