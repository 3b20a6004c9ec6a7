"""Random decode-attention inputs at any shape: the one builder of the kernels' tests, the kernel
benchmark (``eval/benchmarks/kernel.py``) and the kernel-development tools (``kernels/tools/``).

:func:`decode_inputs` gives a query and the four tiers a decode step attends over
(:class:`.decode_attention.DecodeTiers`); :func:`tier_tensors` names them as the kernels take them;
:func:`reference_partials` is the torch side of the Gluon span's per-split results.
"""

from __future__ import annotations

import torch

from oscar_hf.quant import QuantizedRows, dequantize, quantize

from ._triton import LOG2E, ROW_ALIGNMENT, split_rows
from .decode_attention import DecodeTiers

# The kernels' positional order of the tiers' tensors (DecodeTiers.flat), by name.
TIER_NAMES = (
    "sink_k",
    "sink_v",
    "k_codes",
    "k_scale",
    "k_zero",
    "v_codes",
    "v_scale",
    "v_zero",
    "recent_k",
    "recent_v",
    "new_k",
    "new_v",
)


def decode_inputs(
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    sink: int,
    history: int,
    recent: int,
    new: int,
    dtype: torch.dtype,
    k_bits: int = 4,
    v_bits: int = 2,
    k_groups: int = 1,
    v_groups: int = 1,
    pads: list[int] | None = None,
    seed: int = 0,
    *,
    device: torch.device | str = "cpu",
    codes: str = "quantize",
    stored: bool = False,
) -> tuple[torch.Tensor, DecodeTiers]:
    """A query ``[batch, q_heads, head_dim]`` and tiers of ``sink``, ``history`` (packed), ``recent``
    and ``new`` rows of Gaussian K/V (standard deviation 2).

    ``codes``: ``"quantize"`` packs real rows (:func:`oscar_hf.quant.quantize`, clip ratio 0.96,
    ``head_dim // groups`` dims a group); ``"random"`` draws random code bytes and positive scales,
    as fast to read as real codes and much faster to make at 100K rows. ``stored``: each history
    tensor is the first rows of a buffer with room for more, in whole ``ROW_ALIGNMENT`` rows, as a
    cache holds it (rows then sit further apart than one row). ``pads``: left padding, the first
    ``pads[b]`` keys of row ``b`` masked out (they must lie in the sink). Drawn on ``device``.
    """
    device = torch.device(device)
    generator = torch.Generator(device).manual_seed(seed)

    def gaussian(length: int) -> torch.Tensor:  # float32
        return torch.randn(batch, kv_heads, length, head_dim, generator=generator, device=device) * 2

    def packed(bits: int, groups: int) -> QuantizedRows:
        if codes == "quantize":
            rows = quantize(gaussian(history), bits, head_dim // groups, clip_ratio=0.96)
        elif codes == "random":
            shape = (batch, kv_heads, history)
            code_bytes = torch.randint(
                0, 256, (*shape, head_dim * bits // 8), generator=generator, device=device, dtype=torch.uint8
            )
            scale = torch.rand((*shape, groups), generator=generator, device=device) * 0.5 + 0.05
            zero = torch.rand((*shape, groups), generator=generator, device=device) * (2**bits - 1)
            rows = QuantizedRows(code_bytes, scale.bfloat16(), zero.bfloat16())
        else:
            raise ValueError(f"codes must be 'quantize' or 'random', got {codes!r}")
        if not stored:
            return rows
        return QuantizedRows(_in_buffer(rows.codes), _in_buffer(rows.scale), _in_buffer(rows.zero))

    q = torch.randn(batch, q_heads, head_dim, generator=generator, device=device).to(dtype)
    history_k, history_v = packed(k_bits, k_groups), packed(v_bits, v_groups)
    mask = None
    if pads is not None:
        positions = torch.arange(sink + history + recent + new, device=device)
        mask = positions[None, :] >= torch.tensor(pads, device=device)[:, None]
    dense = [gaussian(length).to(dtype) for length in (sink, sink, recent, recent, new, new)]
    tiers = DecodeTiers(
        *dense[:2],
        history_k,
        history_v,
        *dense[2:],
        k_bits,
        v_bits,
        mask,
    )
    return q, tiers


def shaped_inputs(
    config: dict, context: int, batch: int, device: torch.device | str, seed: int = 0
) -> dict[str, torch.Tensor]:
    """:func:`tier_tensors` of :func:`decode_inputs` at the shape a kernel benchmark config holds
    (``eval/configs/bench_kernel.json``: ``shape`` with ``q_heads``, ``kv_heads``, ``head_dim``; ``sink``,
    ``recent``, ``new``, ``dtype``, ``k_bits``, ``v_bits``, ``codes``), ``context`` tokens in all, the
    history in buffers as a cache holds it."""
    shape, sink, recent, new = config["shape"], config["sink"], config["recent"], config["new"]
    history = context - sink - recent - new
    if history < 0:
        raise ValueError(f"context {context} is shorter than sink + recent + new")
    q, tiers = decode_inputs(
        batch,
        shape["q_heads"],
        shape["kv_heads"],
        shape["head_dim"],
        sink,
        history,
        recent,
        new,
        getattr(torch, config["dtype"]),
        config["k_bits"],
        config["v_bits"],
        seed=seed,
        device=device,
        codes=config["codes"],
        stored=True,
    )
    return tier_tensors(q, tiers)


def tier_tensors(q: torch.Tensor, tiers: DecodeTiers) -> dict[str, torch.Tensor]:
    """``q`` and the tiers' tensors by name (:data:`TIER_NAMES`)."""
    return {"q": q, **dict(zip(TIER_NAMES, tiers.flat()))}


def reference_partials(
    q: torch.Tensor, packed: list[torch.Tensor], splits: int, sm_scale: float
) -> tuple[torch.Tensor, ...]:
    """Float32 ``(m, l, acc)`` per (batch, query head, split) over a packed INT2 history (``packed``: K's
    codes, scale, zero, then V's), base-2 scores, split as the history kernels cut it: what the
    Gluon span writes into its partial slots (``decode_history_gluon.history_partials``)."""
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = packed
    head_dim = q.shape[-1]
    keys = dequantize(QuantizedRows(k_codes, k_scale, k_zero), 2, head_dim, torch.float32)
    values = dequantize(QuantizedRows(v_codes, v_scale, v_zero), 2, head_dim, torch.float32)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    chunk = split_rows(keys.shape[2], splits, 64)[1]  # as history_partials cuts them
    m, l, acc = [], [], []
    for start in range(0, keys.shape[2], chunk):
        scores = torch.einsum("bhd,bhtd->bht", q.float(), keys[:, :, start : start + chunk]) * sm_scale * LOG2E
        top = scores.amax(-1)
        p = torch.exp2(scores - top[..., None])
        m.append(top)
        l.append(p.sum(-1))
        acc.append(torch.einsum("bht,bhtd->bhd", p, values[:, :, start : start + chunk]))
    return torch.stack(m, -1), torch.stack(l, -1), torch.stack(acc, -2)


def _in_buffer(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[B, H, L, ...]`` as the first rows of a buffer of whole ``ROW_ALIGNMENT`` rows with room for more."""
    capacity = (rows.shape[2] // ROW_ALIGNMENT + 2) * ROW_ALIGNMENT
    buffer = torch.empty(*rows.shape[:2], capacity, *rows.shape[3:], dtype=rows.dtype, device=rows.device)
    buffer[:, :, : rows.shape[2]] = rows
    return buffer[:, :, : rows.shape[2]]
