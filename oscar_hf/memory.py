"""Honest KV-cache accounting: packed codes, metadata, BF16 sink and recent window, per layer.

Bits per element (BPE) are total stored bits over the number of K and V elements, the way the
OSCAR paper counts them: with a 64-token sink and a 256-token recent window at 16 bits and INT2
codes with one 16-bit scale and zero per 128 channels,

    BPE(L) = (320 * 16 + (L - 320) * 2.25) / L      # 2.2836 at L = 131072
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

BF16_BYTES = 2


@dataclass
class LayerMemory:
    """What one layer stores. ``elements_per_token`` counts K and V over batch and heads."""

    layer: int
    kind: str  # "oscar" or "dense" (a layer type kept in the model dtype, e.g. sliding window)
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
            return cls(layer, "dense", 0, 0, 0, 0, 0, 0, 0, 0)
        batch, heads, tokens, head_dim = keys.shape
        stored = keys.numel() * keys.element_size() + values.numel() * values.element_size()
        return cls(layer, "dense", 0, 0, tokens, 2 * batch * heads * head_dim, 0, 0, 0, stored)

    @property
    def tokens(self) -> int:
        return self.sink_tokens + self.history_tokens + self.recent_tokens

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


@dataclass
class MemoryReport:
    """Per-layer :class:`LayerMemory` entries and their totals."""

    method: str
    layers: list[LayerMemory]

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

    def summary(self) -> dict:
        """Totals as a JSON-ready dict."""
        return {
            "method": self.method,
            "tokens": max((layer.tokens for layer in self.layers), default=0),
            "code_bytes": self.total("code_bytes"),
            "metadata_bytes": self.total("metadata_bytes"),
            "sink_bytes": self.total("sink_bytes"),
            "recent_bytes": self.total("recent_bytes"),
            "total_bytes": self.total_bytes,
            "bf16_dynamic_cache_bytes": self.bf16_bytes,
            "bits_per_element": round(self.bits_per_element, 4),
            "compression_vs_bf16": round(self.compression, 3),
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "layers": [asdict(layer) | {"total_bytes": layer.total_bytes} for layer in self.layers]}

    def to_markdown(self) -> str:
        """A per-layer table followed by the totals."""
        head = "| layer | kind | sink | history | recent | codes B | metadata B | sink B | recent B | total B | BF16 B |"
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
        rows.append(f"\n{s['bits_per_element']} bits per element, {s['compression_vs_bf16']}x smaller than BF16.")
        return "\n".join(rows)

    def __str__(self) -> str:
        s = self.summary()
        return (
            f"{self.method}: {s['total_bytes'] / 2**20:.2f} MiB for {s['tokens']} tokens "
            f"({s['bits_per_element']} bits/element, {s['compression_vs_bf16']}x smaller than BF16 "
            f"{s['bf16_dynamic_cache_bytes'] / 2**20:.2f} MiB)"
        )


def paper_bits_per_element(
    context: int, head_dim: int = 128, bits: int = 2, group_size: int | None = None, sink: int = 64, recent: int = 256
) -> float:
    """BPE of a cache with ``sink + recent`` BF16 tokens and a history with 16-bit scale and zero per group."""
    group_size = group_size or head_dim
    window = min(context, sink + recent)
    history_bits = bits + 32 / group_size
    return (window * 16 + (context - window) * history_bits) / context
