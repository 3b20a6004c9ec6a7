"""Learned refinement of calibrated rotations on the orthogonal group (beyond the reference).

Each layer's R_K and R_V start from the calibrated matrix R0 (U·H·P or H·P, as the clip search
chose) and become ``R = R0 · cayley(A)``, ``cayley(A) = (I - S)^-1 (I + S)`` with ``S = A - A^T``
skew-symmetric, so R stays exactly orthogonal whatever A is. A is fitted with Adam to the
attention-output error of the quantized history on captured calibration rows (post-RoPE queries
and keys, raw values), the same error the clip search ranks candidates by; rounding passes its
gradient straight through. The clip ratio is held at the layer's searched one during the fit and
searched again on a grid afterwards.

One matrix is fitted against the rows of every head that shares it: :class:`AttentionRows` holds
those rows, and :meth:`AttentionRows.head` selects one KV head's, so a per-head rotation is the same
fit on ``rows.head(h)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from oscar_hf.calibration.covariances import observe_attention
from oscar_hf.calibration.teacher_forcing import quantized_key_mask
from oscar_hf.config import METHODS, OscarConfig, TensorQuantConfig
from oscar_hf.core.quantize_jobs import roundtrip_rows
from oscar_hf.rotations.rotation_set import RotationSet

# Clip ratios tried around the starting one once a rotation is fitted (each costs one hard evaluation).
CLIP_OFFSETS = (0.04, 0.02, 0.0, -0.02, -0.04, -0.06, -0.08)


@dataclass(frozen=True)
class RefineSettings:
    """How hard each matrix is fitted.

    ``queries`` of the ``max_queries`` captured query positions per row are drawn (seeded) at each
    of ``steps`` Adam steps of learning rate ``lr``; once the rotation is fitted, the clip ratios
    ``start + offset`` for ``clip_offsets`` (within (0, 1]) are searched again (empty: keep the
    starting ratio).
    """

    steps: int = 60
    lr: float = 2e-3
    queries: int = 96
    max_queries: int = 256
    clip_offsets: tuple[float, ...] = CLIP_OFFSETS
    seed: int = 0


@dataclass
class AttentionRows:
    """One layer's captured attention inputs at a fixed set of query positions, float32.

    ``query`` is ``[rows, H_kv, g, Q, D]`` (query heads grouped onto their KV head), ``key`` and
    ``value`` ``[rows, H_kv, 1, T, D]``; ``history`` and ``causal`` are ``[Q, T]`` masks of the
    keys each query sees through the quantized history and at all.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    history: torch.Tensor
    causal: torch.Tensor

    def head(self, kv_head: int) -> "AttentionRows":
        """The rows of one KV head (and its query group), for a per-head rotation."""
        pick = slice(kv_head, kv_head + 1)
        return replace(self, query=self.query[:, pick], key=self.key[:, pick], value=self.value[:, pick])

    def subset(self, picks: torch.Tensor) -> "AttentionRows":
        """The same rows at query positions ``picks`` (indices into Q)."""
        return replace(self, query=self.query[..., picks, :], history=self.history[picks], causal=self.causal[picks])

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(exact scores, exact probabilities, exact output) of these rows."""
        scores = (self.query @ self.key.transpose(-1, -2)) * self.query.shape[-1] ** -0.5
        probs = scores.masked_fill(~self.causal, float("-inf")).softmax(-1)
        return scores, probs, probs @ self.value


class _Capture:
    """Keeps each layer's queries at evenly spaced history-seeing positions, and all keys and values."""

    def __init__(self, config: OscarConfig, max_queries: int) -> None:
        self.config, self.max_queries = config, max_queries
        self.parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def observe(self, layer_id: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        length = key.shape[2]
        history = quantized_key_mask(length, self.config, torch.device("cpu"))
        candidates = history.any(-1).nonzero().flatten()
        if candidates.numel() == 0:
            raise ValueError("calibration rows are too short for refinement: no key reaches the history")
        positions = candidates[torch.linspace(0, candidates.numel() - 1, self.max_queries).round().long()]
        groups = query.shape[1] // key.shape[1]
        for b in range(query.shape[0]):
            q = query[b : b + 1, :, positions].float().cpu().unflatten(1, (key.shape[1], groups))
            k, v = key[b : b + 1].float().cpu().unsqueeze(2), value[b : b + 1].float().cpu().unsqueeze(2)
            self.parts.setdefault(layer_id, []).append((q, k, v, positions))

    def rows(self) -> dict[int, AttentionRows]:
        result = {}
        for layer_id, parts in self.parts.items():
            lengths = {k.shape[-2] for _, k, _, _ in parts}
            if len(lengths) > 1:
                raise ValueError(f"refinement rows must all have the same length, got {sorted(lengths)}")
            length, positions = lengths.pop(), parts[0][3]
            history = quantized_key_mask(length, self.config, torch.device("cpu"))[positions]
            causal = positions[:, None] >= torch.arange(length)[None, :]
            result[layer_id] = AttentionRows(
                *(torch.cat([part[i] for part in parts]) for i in range(3)), history, causal
            )
        return result


def capture_rows(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    config: OscarConfig = METHODS["oscar-int2"],
    max_queries: int = 256,
    progress: bool = True,
) -> dict[int, AttentionRows]:
    """Every full-attention layer's :class:`AttentionRows` over ``batches`` (rows of one length, longer than sink + recent)."""
    capture = _Capture(config, max_queries)
    observe_attention(model, batches, capture.observe, "OSCAR refinement capture", progress)
    return capture.rows()


def fake_quantize(rows: torch.Tensor, spec: TensorQuantConfig, clip_ratio: float) -> torch.Tensor:
    """Clip + per-token min-max quantization round trip of ``rows [..., D]`` with a straight-through rounding gradient.

    Matches :func:`oscar_hf.quant.quantize` (asymmetric, float zero-point, round half up) except that
    scale and zero stay float32 instead of 16-bit.
    """
    if spec.symmetric:
        raise ValueError("refinement supports the asymmetric (min-max) quantizer only")
    head_dim = rows.shape[-1]
    group = spec.group_of(head_dim)
    if clip_ratio > 0:
        k = min(max(int(clip_ratio * head_dim), 0), head_dim - 1) + 1
        threshold = rows.abs().kthvalue(k, dim=-1, keepdim=True).values
        rows = torch.minimum(torch.maximum(rows, -threshold), threshold)
    groups = rows.unflatten(-1, (head_dim // group, group))
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low).clamp_min(1e-8) / (2**spec.bits - 1)
    code = (groups - low) / scale
    rounded = code + (torch.floor(code + 0.5).clamp(0, 2**spec.bits - 1) - code).detach()
    return (rounded * scale + low).flatten(-2)


def key_error(
    rows: AttentionRows, rotation: torch.Tensor, quantize, reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Squared attention-output error over the squared reference output when the history keys are ``quantize``d in the basis ``rotation``."""
    exact_scores, _, output = reference
    scale = rows.query.shape[-1] ** -0.5
    k_hat = quantize(rows.key @ rotation)
    scores = torch.where(rows.history, ((rows.query @ rotation) @ k_hat.transpose(-1, -2)) * scale, exact_scores)
    mixed = scores.masked_fill(~rows.causal, float("-inf")).softmax(-1) @ rows.value
    return (mixed - output).pow(2).sum() / output.pow(2).sum()


def value_error(
    rows: AttentionRows, rotation: torch.Tensor, quantize, reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Squared attention-output error over the squared reference output when the history values are ``quantize``d in the basis ``rotation``."""
    _, probs, output = reference
    error = quantize(rows.value @ rotation) @ rotation.T - rows.value
    return ((probs * rows.history) @ error).pow(2).sum() / output.pow(2).sum()


ERRORS = {"key": key_error, "value": value_error}


def cayley(parameters: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix ``(I - S)^-1 (I + S)`` of the skew part ``S = A - A^T`` of ``parameters``."""
    skew = parameters - parameters.T
    eye = torch.eye(skew.shape[0], dtype=skew.dtype, device=skew.device)
    return torch.linalg.solve(eye - skew, eye + skew)


@dataclass
class RefinedMatrix:
    """A fitted rotation and clip ratio, with the hard (real quantizer) errors before and after, on all captured queries."""

    rotation: torch.Tensor
    clip_ratio: float
    error_before: float
    error_after: float


def _hard_error(
    kind: str,
    rows: AttentionRows,
    rotation: torch.Tensor,
    spec: TensorQuantConfig,
    ratio: float,
    metadata_dtype: torch.dtype,
    reference,
) -> float:
    quantize = lambda x: roundtrip_rows(x, replace(spec, clip_ratio=ratio), metadata_dtype)  # noqa: E731
    with torch.no_grad():
        return ERRORS[kind](rows, rotation, quantize, reference).item()


def refine_matrix(
    kind: str,
    rows: AttentionRows,
    start: torch.Tensor,
    clip_ratio: float,
    config: OscarConfig = METHODS["oscar-int2"],
    settings: RefineSettings = RefineSettings(),
) -> RefinedMatrix:
    """Fit one ``[D, D]`` rotation of ``kind`` ("key" or "value") to ``rows``, starting from ``start``.

    The result keeps ``start`` (and ``clip_ratio``) unless the fit lowers the hard error on the
    captured queries, so refinement never makes a layer worse on its calibration rows.
    """
    if kind not in ERRORS:
        raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
    spec = config.key if kind == "key" else config.value
    start = start.float()
    full_reference = rows.reference()
    before = _hard_error(kind, rows, start, spec, clip_ratio, config.metadata_dtype, full_reference)
    generator = torch.Generator().manual_seed(settings.seed)
    parameters = torch.zeros_like(start, requires_grad=True)
    optimizer = torch.optim.Adam([parameters], lr=settings.lr)
    count = rows.history.shape[0]
    for _ in range(settings.steps):
        picks = torch.randperm(count, generator=generator)[: settings.queries].sort().values
        batch = rows.subset(picks)
        with torch.no_grad():
            reference = batch.reference()
        loss = ERRORS[kind](batch, start @ cayley(parameters), lambda x: fake_quantize(x, spec, clip_ratio), reference)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        fitted = start @ cayley(parameters)
    ratios = {clip_ratio} | {round(clip_ratio + o, 4) for o in settings.clip_offsets if 0 < clip_ratio + o <= 1}
    errors = {r: _hard_error(kind, rows, fitted, spec, r, config.metadata_dtype, full_reference) for r in ratios}
    best = min(errors, key=errors.get)
    if errors[best] >= before:
        return RefinedMatrix(start, clip_ratio, before, before)
    return RefinedMatrix(fitted, best, before, errors[best])


def refine_rotations(
    model: PreTrainedModel,
    batches: Sequence[torch.LongTensor],
    rotations: RotationSet,
    config: OscarConfig = METHODS["oscar-int2"],
    settings: RefineSettings = RefineSettings(),
    progress: bool = True,
) -> tuple[RotationSet, dict[int, dict[str, RefinedMatrix]]]:
    """Refine every layer's R_K and R_V of ``rotations`` on ``batches``; return the new set and each fit.

    ``batches`` are calibration rows of one length, longer than ``config.sink + config.recent``.
    A layer's starting clip ratio is its stored one, else ``config``'s. Layers missing from
    ``rotations`` start from the identity.
    """
    captured = capture_rows(model, batches, config, settings.max_queries, progress)
    eye = torch.eye(rotations.head_dim)
    key, value, key_clip, value_clip, fits = {}, {}, {}, {}, {}
    for layer_id in tqdm(sorted(captured), desc="OSCAR rotation refinement", unit="layer", disable=not progress):
        rows = captured[layer_id]
        k_start, v_start = rotations.key.get(layer_id, eye), rotations.value.get(layer_id, eye)
        k_fit = refine_matrix(
            "key", rows, k_start, rotations.key_clip.get(layer_id, config.key.clip_ratio), config, settings
        )
        v_fit = refine_matrix(
            "value", rows, v_start, rotations.value_clip.get(layer_id, config.value.clip_ratio), config, settings
        )
        key[layer_id], value[layer_id] = k_fit.rotation, v_fit.rotation
        key_clip[layer_id], value_clip[layer_id] = k_fit.clip_ratio, v_fit.clip_ratio
        fits[layer_id] = {"key": k_fit, "value": v_fit}
    refined = RotationSet(
        head_dim=rotations.head_dim,
        key=key,
        value=value,
        description=f"{rotations.description}; refined on the orthogonal group by attention-output error",
        key_eigenvalues=rotations.key_eigenvalues,
        value_eigenvalues=rotations.value_eigenvalues,
        key_clip=key_clip,
        value_clip=value_clip,
        key_bits=dict(rotations.key_bits),
        value_bits=dict(rotations.value_bits),
        base_bits=rotations.base_bits,
        windows=rotations.windows,
    )
    return refined, fits
