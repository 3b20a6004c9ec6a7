"""Honest KV-cache accounting: packed codes, metadata, BF16 sink and recent window, per layer.

Bits per element (BPE) are total stored bits over the number of K and V elements, the way the
OSCAR paper counts them: with a 64-token sink and a 256-token recent window at 16 bits and INT2
codes with one 16-bit scale and zero per 128 channels,

    BPE(L) = (320 * 16 + (L - 320) * 2.25) / L      # 2.2836 at L = 131072
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from oscar_hf.config import OscarConfig

BF16_BYTES = 2


@dataclass
class LayerMemory:
    """What one layer stores. ``elements_per_token`` counts K and V over batch and heads."""

    layer: int
    kind: str  # "oscar" or "dense" (a layer type kept in the model dtype, e.g. sliding window)
    dtype_bytes: int  # bytes per element of the model's K/V dtype
    sink_tokens: int
    history_tokens: int
    recent_tokens: int
    elements_per_token: int
    code_bytes: int
    metadata_bytes: int
    sink_bytes: int
    recent_bytes: int

    @classmethod
    def dense(cls, layer: int, keys: torch.Tensor | None, values: torch.Tensor | None) -> "LayerMemory":
        if keys is None or keys.numel() == 0:
            return cls(layer, "dense", BF16_BYTES, 0, 0, 0, 0, 0, 0, 0, 0)
        batch, heads, tokens, head_dim = keys.shape
        stored = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        return cls(layer, "dense", keys.element_size(), 0, 0, tokens, 2 * batch * heads * head_dim, 0, 0, 0, stored)

    @property
    def tokens(self) -> int:
        return self.sink_tokens + self.history_tokens + self.recent_tokens

    def in_bf16(self) -> "LayerMemory":
        """This layer with its windows (or dense K/V) held in BF16, as a GPU runs the model; codes and
        metadata keep their own formats."""
        return replace(
            self,
            dtype_bytes=BF16_BYTES,
            sink_bytes=self.sink_bytes * BF16_BYTES // self.dtype_bytes,
            recent_bytes=self.recent_bytes * BF16_BYTES // self.dtype_bytes,
        )

    @property
    def total_bytes(self) -> int:
        return self.code_bytes + self.metadata_bytes + self.sink_bytes + self.recent_bytes

    @property
    def elements(self) -> int:
        return self.tokens * self.elements_per_token

    @property
    def bf16_bytes(self) -> int:
        """What a BF16 DynamicCache would store for the same tokens."""
        return self.elements * BF16_BYTES

    @property
    def dynamic_bytes(self) -> int:
        """What a DynamicCache in the model's dtype would store for the same tokens."""
        return self.elements * self.dtype_bytes


@dataclass
class MemoryReport:
    """Per-layer :class:`LayerMemory` entries and their totals."""

    method: str
    layers: list[LayerMemory]
    windows: str = ""  # the cache's sink and recent windows and where they came from, in words

    def total(self, field: str) -> int:
        return sum(getattr(layer, field) for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return self.total("total_bytes")

    @property
    def bf16_bytes(self) -> int:
        return self.total("bf16_bytes")

    @property
    def bits_per_element(self) -> float:
        elements = self.total("elements")
        return 8 * self.total_bytes / elements if elements else float("nan")

    @property
    def compression(self) -> float:
        """How many times smaller than a BF16 DynamicCache holding the same tokens."""
        return self.bf16_bytes / self.total_bytes if self.total_bytes else float("nan")

    @property
    def compression_vs_dynamic(self) -> float:
        """How many times smaller than a DynamicCache in the model's dtype (equal to ``compression`` for BF16 models)."""
        dynamic = self.total("dynamic_bytes")
        return dynamic / self.total_bytes if self.total_bytes else float("nan")

    def in_bf16(self) -> "MemoryReport":
        """What the same cache stores with a BF16 model (see :meth:`LayerMemory.in_bf16`)."""
        return MemoryReport(self.method, [layer.in_bf16() for layer in self.layers], self.windows)

    def projected_bytes(self, config: OscarConfig, tokens: int, head_dim: int) -> int:
        """Bytes these layers would hold, in a BF16 model, right after a prefill of ``tokens`` tokens
        with ``config``, at :func:`bits_per_element` (dense layers count as BF16 for every token)."""
        bits = {"oscar": bits_per_element(config, tokens, head_dim), "dense": 8 * BF16_BYTES}
        return round(sum(bits[layer.kind] * tokens * layer.elements_per_token for layer in self.layers) / 8)

    def summary(self) -> dict:
        """Totals as a JSON-ready dict."""
        return {
            "method": self.method,
            "windows": self.windows,
            "tokens": max((layer.tokens for layer in self.layers), default=0),
            "code_bytes": self.total("code_bytes"),
            "metadata_bytes": self.total("metadata_bytes"),
            "sink_bytes": self.total("sink_bytes"),
            "recent_bytes": self.total("recent_bytes"),
            "total_bytes": self.total_bytes,
            "bf16_dynamic_cache_bytes": self.bf16_bytes,
            "model_dtype_dynamic_cache_bytes": self.total("dynamic_bytes"),
            "bits_per_element": round(self.bits_per_element, 4),
            "compression_vs_bf16": round(self.compression, 3),
            "compression_vs_model_dtype": round(self.compression_vs_dynamic, 3),
        }

    def to_dict(self) -> dict:
        return {
            **self.summary(),
            "layers": [asdict(layer) | {"total_bytes": layer.total_bytes} for layer in self.layers],
        }

    def to_markdown(self) -> str:
        """A per-layer table followed by the totals."""
        head = (
            "| layer | kind | sink | history | recent | codes B | metadata B | sink B | recent B | total B | BF16 B |"
        )
        rows = [head, "|" + "---|" * 11]
        for m in self.layers:
            rows.append(
                f"| {m.layer} | {m.kind} | {m.sink_tokens} | {m.history_tokens} | {m.recent_tokens} | {m.code_bytes:,} "
                f"| {m.metadata_bytes:,} | {m.sink_bytes:,} | {m.recent_bytes:,} | {m.total_bytes:,} | {m.bf16_bytes:,} |"
            )
        s = self.summary()
        rows.append(
            f"| **all** | {self.method} | | | | {s['code_bytes']:,} | {s['metadata_bytes']:,} | {s['sink_bytes']:,} "
            f"| {s['recent_bytes']:,} | {s['total_bytes']:,} | {s['bf16_dynamic_cache_bytes']:,} |"
        )
        if not s["tokens"]:
            rows.append("\nNo tokens stored yet.")
        else:
            rows.append(f"\n{s['bits_per_element']} bits per element, {s['compression_vs_bf16']}x smaller than BF16.")
        return "\n".join(rows)

    def __str__(self) -> str:
        """Totals in words: as stored, as a BF16 model stores them, and why short prompts compress less."""
        s = self.summary()
        if not s["tokens"]:
            return f"{self.method}: no tokens stored yet"
        bf16 = self.in_bf16()
        text = f"{self.method}: {s['tokens']:,} tokens, {_mib(self.total_bytes)}"
        wide = {layer.dtype_bytes for layer in self.layers if layer.dtype_bytes != BF16_BYTES}
        if wide:  # a float32 model (the CPU default) stores its windows in float32
            text += (
                f" with the model's float{8 * max(wide)} windows ({_mib(bf16.total_bytes)} with BF16 windows, "
                "as a bf16 model holds them)"
            )
        if round(bf16.compression, 2) == 1:
            text += f": {bf16.bits_per_element:.2f} bits/element, as a BF16 DynamicCache."
        else:
            text += (
                f": {bf16.bits_per_element:.2f} bits/element, {bf16.compression:.1f}x smaller than a BF16 "
                f"DynamicCache ({_mib(bf16.bf16_bytes)})."
            )
        quantized = [layer for layer in self.layers if layer.history_tokens]
        if quantized:
            windows = max(layer.sink_tokens + layer.recent_tokens for layer in quantized)
            history_bits = (
                8
                * sum(layer.code_bytes + layer.metadata_bytes for layer in quantized)
                / sum(layer.history_tokens * layer.elements_per_token for layer in quantized)
            )
            text += (
                f"\n  {windows:,} of the {s['tokens']:,} tokens are the uncompressed sink and recent window"
                f"{f' ({self.windows})' if self.windows else ''}; "
                f"the quantized history costs {history_bits:.2f} bits/element, so the cache approaches "
                f"{8 * BF16_BYTES / history_bits:.1f}x smaller than BF16 as the context grows."
            )
        return text


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def bits_per_element(config: OscarConfig, context: int, head_dim: int, window_bits: int = 16) -> float:
    """BPE of ``config`` holding ``context`` tokens right after a prefill (``sink + recent`` high-precision tokens).

    Metadata bits come from ``config.metadata_dtype``; the paper's 2.28 at 128K is
    ``bits_per_element(METHODS["oscar-int2"], 131072, 128)``. A history of ``oscar-k3v2`` at head_dim
    64 takes (3 + 32/64 + 2 + 32/64) / 2 = 3.0 bits per element.
    """
    if not config.quantized:
        return float(window_bits)
    metadata_bits = 2 * torch.finfo(config.metadata_dtype).bits
    history_bits = sum(spec.bits + metadata_bits / spec.group_of(head_dim) for spec in (config.key, config.value)) / 2
    window = min(context, config.sink + config.recent)
    return (window * window_bits + (context - window) * history_bits) / context


def mean_bits_per_element(configs: list[OscarConfig], context: int, head_dim: int, window_bits: int = 16) -> float:
    """:func:`bits_per_element` over layers of their own configurations (per-layer bit widths), averaged."""
    if not configs:
        raise ValueError("no layer configurations to average")
    return sum(bits_per_element(c, context, head_dim, window_bits) for c in configs) / len(configs)
