"""What transformers' dense cache layers expose (``keys`` and ``values``), for an OscarLayer.

A ``DynamicLayer`` holds one K and one V tensor; an OscarLayer holds a sink, a packed history and a
recent window in a rotated basis. ``dequantized()`` rebuilds the dense K/V (a copy); ``keys`` and
``values`` give them where that copy is exact (methods that store no quantized rows) and otherwise
say what to use instead, rather than handing out an approximation under a name that promises the
stored tensors.
"""

from __future__ import annotations

import torch


class DenseView:
    """``keys``/``values``/``dequantized()`` of :class:`~oscar_hf.core.layer.OscarLayer` (a mixin: it reads
    the layer's tiers, rotations and config)."""

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The layer's K and V as ``[B, H_kv, T, D]`` tensors in the model's basis: the sink and window as
        stored, the history dequantized; a copy, which writes do not reach. ``(None, None)`` while empty."""
        if not self.is_initialized:
            return None, None
        self._leave_static()  # a frozen ring holds its rows out of order
        keys = [self.sink_keys.view(), self.recent_keys.view()]
        values = [self.sink_values.view(), self.recent_values.view()]
        if self.history_length:
            keys.insert(1, self.history_keys.dequantize(self.dtype))
            values.insert(1, self.history_values.dequantize(self.dtype))
        return self.unrotate_keys(torch.cat(keys, dim=2)), self.unrotate_values(torch.cat(values, dim=2))

    @property
    def keys(self) -> torch.Tensor | None:
        """All stored keys, as ``DynamicLayer.keys`` (a copy), for methods that store no quantized rows."""
        return self._dense_attribute(0, "keys")

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """All stored values, as ``DynamicLayer.values`` (a copy), for methods that store no quantized rows."""
        return self._dense_attribute(1, "values")

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._refuse_assignment("values", value)

    def _dense_attribute(self, index: int, name: str) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        if self.config.quantized:
            raise TypeError(
                f"an OscarLayer of method {self.config.method!r} stores {name} quantized in a rotated basis, not as "
                f"one tensor: layer.dequantized() gives K and V rebuilt from them (a copy), "
                "cache.memory_report() what is stored"
            )
        return self.dequantized()[index]

    @staticmethod
    def _refuse_assignment(name: str, value: torch.Tensor | None) -> None:
        if value is not None:  # transformers' CacheLayerMixin.__init__ sets both to None
            raise TypeError(f"an OscarLayer's {name} cannot be assigned: store K/V through cache.update()")
