"""Split-K (flash-decoding) attention of one new query token over ``[sink | packed history | recent | new]``.

The key sequence of one layer is four tiers, in this order of positions:

* ``sink``    dense rows ``[B, Hkv, S, D]`` (the first real tokens; with left padding some are pads),
* history     packed INT1-INT4 codes ``[B, Hkv, L, D*bits/8]`` + scale/zero ``[B, Hkv, L, D/G]``,
              K and V with their own bit widths and groups (``oscar-k4v2``: K 4-bit, V 2-bit),
* ``recent``  dense rows ``[B, Hkv, R, D]``,
* ``new``     dense rows ``[B, Hkv, T, D]`` (the token being decoded, not stored yet).

Everything is in the rotated basis: ``q`` is ``q·R_K`` and the output is in the ``V·R_V`` basis
(the caller applies ``·R_V^T``).

This module is the interface: :func:`decode_attention` checks the inputs and runs either the kernels
(through :func:`.decode_launch.decode_attention_triton`, also the custom op
``torch.ops.oscar.decode_attention``) or :func:`decode_attention_reference`, the torch reference the
kernels must match. The kernels: :mod:`.decode_stages` (Triton stage 1 and the merge),
:mod:`.decode_unpack` (packed codes as dot operands), :mod:`.decode_history_gluon` (the packed-history
span in Gluon, on the shapes it covers); :mod:`.decode_launch` plans and launches them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from oscar_hf.quant import QuantizedRows, check_bits, dequantize

from ._triton import define_op, is_power_of_two, op_or_launcher, runs_triton
from .decode_launch import decode_attention_triton


@dataclass(frozen=True)
class DecodeTiers:
    """What one decode step attends over, in the rotated basis: ``[sink | history | recent | new]``.

    Attributes:
        sink_k, sink_v, recent_k, recent_v, new_k, new_v: dense rows ``[B, Hkv, n, D]`` (views are fine).
        history_k, history_v: the packed history, codes ``uint8 [B, Hkv, L, D*bits/8]`` (the layout of
            :func:`oscar_hf.quant.pack`) and ``[B, Hkv, L, D/G]`` scale and zero (any float dtype);
            ``L`` may be 0.
        k_bits, v_bits: 1, 2, 3 or 4 each.
        key_mask: optional ``bool [B, S+L+R+T]``, True where a key may be attended (left-padding pads
            are False).
        lengths: static decoding (CUDA graphs): integers ``[history rows, ring start, ring rows]`` on the
            device. The history tensors are then allocated at capacity with their first ``lengths[0]``
            rows valid, ``recent_k``/``recent_v`` are a ring whose ``lengths[2]`` rows from
            ``lengths[1]`` on are valid, and ``key_mask`` covers the sink only. The newest
            ``new_k.shape[2]`` of those ring rows are the new rows' slots: the call stores ``new_k`` and
            ``new_v`` there (a decode step's one write) and attends them as new rows. Nothing is read
            on the host, so one launch can be captured and replayed as the lengths change.
    """

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    history_k: QuantizedRows
    history_v: QuantizedRows
    recent_k: torch.Tensor
    recent_v: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    k_bits: int
    v_bits: int
    key_mask: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @classmethod
    def from_flat(
        cls,
        tensors,
        k_bits: int,
        v_bits: int,
        key_mask: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> "DecodeTiers":
        """The tiers from tensors in the kernels' argument order (:meth:`flat`)."""
        sink_k, sink_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v = tensors
        return cls(
            sink_k,
            sink_v,
            QuantizedRows(k_codes, k_scale, k_zero),
            QuantizedRows(v_codes, v_scale, v_zero),
            recent_k,
            recent_v,
            new_k,
            new_v,
            k_bits,
            v_bits,
            key_mask,
            lengths,
        )

    def flat(self) -> tuple[torch.Tensor, ...]:
        """The tensors in the kernels' argument order (``torch.ops.oscar.decode_attention`` after ``q``)."""
        k, v = self.history_k, self.history_v
        return (
            self.sink_k,
            self.sink_v,
            k.codes,
            k.scale,
            k.zero,
            v.codes,
            v.scale,
            v.zero,
            self.recent_k,
            self.recent_v,
            self.new_k,
            self.new_v,
        )


# -------------------------------------------------------------------------------- torch reference


def decode_attention_reference(q: torch.Tensor, tiers: DecodeTiers, *, sm_scale: float | None = None) -> torch.Tensor:
    """The torch reference and CPU fallback of :func:`decode_attention`.

    Dequantizes the history with :func:`oscar_hf.quant.dequantize` into the query dtype, concatenates
    the tiers and runs one float32 softmax, with the query heads of each KV head grouped (GQA).
    With ``lengths`` it first stores the new rows in the ring, as the kernel does, then takes the
    valid history rows and unrolls the ring (a host sync).
    """
    sink_k, sink_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v = tiers.flat()
    k_bits, v_bits, key_mask, lengths = tiers.k_bits, tiers.v_bits, tiers.key_mask, tiers.lengths
    if lengths is not None:
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, key_mask = _unroll_static(
            lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v, key_mask
        )
    batch, q_heads, head_dim = q.shape
    kv_heads = sink_k.shape[1]
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    history_k = dequantize(QuantizedRows(k_codes, k_scale, k_zero), k_bits, head_dim // k_scale.shape[-1], q.dtype)
    history_v = dequantize(QuantizedRows(v_codes, v_scale, v_zero), v_bits, head_dim // v_scale.shape[-1], q.dtype)
    keys = torch.cat([sink_k, history_k, recent_k, new_k], dim=2).float()
    values = torch.cat([sink_v, history_v, recent_v, new_v], dim=2).float()
    grouped_q = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.einsum("bkgd,bktd->bkgt", grouped_q, keys) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask.bool()[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A fully masked row attends to nothing; NaN from a non-finite key or query propagates, as in SDPA.
    probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    out = torch.einsum("bkgt,bktd->bkgd", probs, values)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def _unroll_static(
    lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, recent_k, recent_v, new_k, new_v, key_mask
):
    """Static-decoding tiers as plain ones: the new rows stored in the ring's newest slots, then the first
    ``lengths[0]`` history rows, the ring's other valid rows in order from its start, and the sink mask
    extended with True for every other key."""
    history, start, rows = (int(v) for v in lengths.tolist())
    n_new, ring_size = new_k.shape[2], recent_k.shape[2]
    rows -= n_new
    new_slots = (start + rows + torch.arange(n_new, device=recent_k.device)) % ring_size
    recent_k.index_copy_(2, new_slots, new_k)
    recent_v.index_copy_(2, new_slots, new_v)
    ring = (start + torch.arange(rows, device=recent_k.device)) % ring_size
    packed = [t[:, :, :history] for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)]
    recent = [t.index_select(2, ring) for t in (recent_k, recent_v)]
    if key_mask is not None:
        rest = torch.ones(key_mask.shape[0], history + rows + n_new, dtype=torch.bool, device=key_mask.device)
        key_mask = torch.cat([key_mask.bool(), rest], dim=1)
    return (*packed, *recent, key_mask)


# ------------------------------------------------------------------------------------ custom op


def _decode_attention_op(
    q: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    recent_k: torch.Tensor,
    recent_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    key_mask: torch.Tensor | None,
    k_bits: int,
    v_bits: int,
    sm_scale: float,
    num_splits: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    lengths: torch.Tensor | None = None,
    history_settled: bool = False,
) -> torch.Tensor:
    # Looked up through this module (see quantize._quantize_pack_op): a re-import reaches the new launcher.
    launch = sys.modules[__name__].decode_attention_triton
    return launch(
        q,
        sink_k,
        sink_v,
        k_codes,
        k_scale,
        k_zero,
        v_codes,
        v_scale,
        v_zero,
        recent_k,
        recent_v,
        new_k,
        new_v,
        key_mask,
        k_bits,
        v_bits,
        sm_scale,
        num_splits,
        block_n,
        num_warps,
        num_stages,
        lengths,
        history_settled,
    )


def _decode_attention_fake(q, *args):
    return torch.empty_like(q)


define_op("oscar::decode_attention", _decode_attention_op, _decode_attention_fake, mutates=("recent_k", "recent_v"))


# ----------------------------------------------------------------------------------- dispatcher


def _check_inputs(q, dense, k_codes, k_scale, v_codes, v_scale, key_mask, k_bits, v_bits, lengths) -> None:
    """Shapes and dtypes the kernels rely on (``dense``: the six sink/recent/new tensors)."""
    check_bits(k_bits), check_bits(v_bits)
    batch, q_heads, head_dim = q.shape
    kv_heads = dense[0].shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    for rows in dense:
        if rows.shape[:2] != (batch, kv_heads) or rows.shape[-1] != head_dim or rows.dtype != q.dtype:
            raise ValueError(
                f"dense rows {tuple(rows.shape)} {rows.dtype} do not match [{batch}, {kv_heads}, *, "
                f"{head_dim}] {q.dtype}: q must be in the dtype of the windows"
            )
    for name, codes, scale, bits in (("key", k_codes, k_scale, k_bits), ("value", v_codes, v_scale, v_bits)):
        if (
            codes.shape[:3] != (batch, kv_heads, k_codes.shape[2])
            or codes.shape[-1] * 8 != head_dim * bits
            or scale.shape[:3] != codes.shape[:3]
            or head_dim % scale.shape[-1]
        ):
            raise ValueError(
                f"{name} history codes {tuple(codes.shape)} / scale {tuple(scale.shape)} do not fit "
                f"{bits}-bit rows of {head_dim} dims"
            )
    masked = dense[0].shape[2]  # static decoding: the sink only
    if lengths is None:
        masked += k_codes.shape[2] + dense[2].shape[2] + dense[4].shape[2]
    elif lengths.shape != (3,) or lengths.dtype not in (torch.int32, torch.int64) or lengths.device != q.device:
        raise ValueError(f"lengths must be 3 integers on {q.device}, got {tuple(lengths.shape)} {lengths.dtype}")
    if key_mask is not None and tuple(key_mask.shape) != (batch, masked):
        raise ValueError(f"key_mask has shape {tuple(key_mask.shape)}, expected [{batch}, {masked}]")


def column_blocks(bits: int) -> int:
    """Column blocks that ``bits``-bit codes unpack in: 4 for 1- to 3-bit codes, 2 for 4-bit."""
    check_bits(bits)
    return 2 if bits == 4 else 4


def kernel_supports_decode(
    head_dim: int, k_bits: int = 2, v_bits: int = 2, k_groups: int = 1, v_groups: int = 1
) -> bool:
    """Tiles are column blocks of ``D / column_blocks(bits)`` dims: a power of two, at least 16 for
    ``tl.dot``, and each within one quantization group (``groups`` per row, at most that many blocks)."""
    blocks = (column_blocks(k_bits), column_blocks(v_bits))
    return (
        is_power_of_two(head_dim)
        and head_dim // max(blocks) >= 16
        and all(is_power_of_two(g) and g <= n for g, n in zip((k_groups, v_groups), blocks))
    )


def decode_attention(
    q: torch.Tensor,
    tiers: DecodeTiers,
    *,
    sm_scale: float | None = None,
    num_splits: int = 0,
    history_settled: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence over ``[sink | history | recent | new]``, rotated basis.

    Args:
        q: ``[B, Hq, D]`` query, already multiplied by R_K, in the dtype of the dense rows.
        tiers: what it attends over (:class:`DecodeTiers`).
        sm_scale: score scale, ``1/sqrt(D)`` by default.
        num_splits: history splits (0: chosen from the length and the device).
        history_settled: the kernel launched just before this call wrote neither the history nor
            ``lengths`` (as in a decode step, where that kernel rotates q, K and V). On Hopper the
            history's first tiles are then copied while it still runs. False is always correct.

    Returns:
        ``[B, Hq, D]`` in the dtype of ``q`` and in the rotated V basis (the caller applies ``·R_V^T``).

    Runs the Triton kernels when :func:`~._triton.runs_triton` says so, else the torch reference.
    """
    flat = tiers.flat()
    sink_k, sink_v, k_codes, k_scale, _, v_codes, v_scale, _, recent_k, recent_v, new_k, new_v = flat
    k_bits, v_bits, key_mask, lengths = tiers.k_bits, tiers.v_bits, tiers.key_mask, tiers.lengths
    dense = (sink_k, sink_v, recent_k, recent_v, new_k, new_v)
    _check_inputs(q, dense, k_codes, k_scale, v_codes, v_scale, key_mask, k_bits, v_bits, lengths)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    supported = kernel_supports_decode(q.shape[-1], k_bits, v_bits, k_scale.shape[-1], v_scale.shape[-1])
    if not (runs_triton(q) and supported):
        return decode_attention_reference(q, tiers, sm_scale=scale)
    launch = op_or_launcher(torch.ops.oscar.decode_attention, decode_attention_triton)
    return launch(q, *flat, key_mask, k_bits, v_bits, scale, num_splits, 0, 0, 0, lengths, history_settled)
