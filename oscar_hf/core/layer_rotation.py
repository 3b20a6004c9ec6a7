"""The rotations of one cache layer: R_K and R_V applied to states, queries and attention outputs.

A layer keeps R_K and R_V in float32 and uses copies cast once to each dtype and device it meets. A
shared R is ``[D, D]``; a per-KV-head R is ``[H_kv, D, D]`` and query head ``i`` uses its KV head's
``i // g``. A layer with a key mean ``mu`` (``[D]`` or ``[H_kv, D]``) stores keys centered,
``(k - mu) @ R_K``, and adds it back where stored keys leave the cache; queries are not centered, so
each query's scores shift by one constant, ``q . mu``, which softmax ignores. A key feedback factor
(``[D, D]`` or ``[H_kv, D, D]``, in the rotated basis) belongs to R_K and is kept beside it.
"""

from __future__ import annotations

import torch

from oscar_hf.kernels.rotate import rotate_rows
from oscar_hf.rotations.rotation_set import per_query_head


def _rotate(states: torch.Tensor, rotation: torch.Tensor | None, heads_axis: int = 1) -> torch.Tensor:
    """``states @ rotation``, one GEMM in the states' dtype (``rotation`` is stored in it).

    A per-head rotation ``[H, D, D]`` (one R per head of ``states``, whose heads sit on ``heads_axis``)
    is one batched GEMM. For 16-bit models R is rounded to 16 bits, as the reference does:
    orthogonal to ~1e-3, far below the INT2 error, while a float32 product would cost two extra
    casts and a slow SIMT GEMM per call.
    """
    if rotation is None:
        return states
    if rotation.ndim == 2 or heads_axis == 1:
        return states @ rotation
    return (states.transpose(1, heads_axis) @ rotation).transpose(1, heads_axis)


class RotatedLayer:
    """R_K / R_V of a layer and the products with them; ``None`` is the identity."""

    def set_rotations(
        self,
        key_rotation: torch.Tensor | None,
        value_rotation: torch.Tensor | None,
        key_mean: torch.Tensor | None = None,
        key_feedback: torch.Tensor | None = None,
    ) -> None:
        self.key_rotation, self.value_rotation, self.key_mean = key_rotation, value_rotation, key_mean
        self.key_feedback = None if key_feedback is None else key_feedback.float().contiguous()
        self._rotation_copies: dict[tuple, torch.Tensor] = {}  # (which, heads, dim, dtype, device) -> R cast once

    def place_rotations(self, device: torch.device, kv_heads: int) -> None:
        """Check per-head rotations against the layer's ``kv_heads`` and move the float32 R_K / R_V to its
        device, so that every tensor of a layer sits beside its attention (``device_map``)."""
        masters = (self.key_rotation, self.value_rotation, self.key_mean, self.key_feedback)
        per_head = [t for t in (*masters[:2], masters[3]) if t is not None and t.ndim == 3]
        per_head += [self.key_mean] if self.key_mean is not None and self.key_mean.ndim == 2 else []
        for rotation in per_head:
            if rotation.shape[0] != kv_heads:
                raise ValueError(
                    f"the per-head rotations hold {rotation.shape[0]} KV heads but this layer receives {kv_heads}; "
                    "under tensor parallelism build the cache from the sharded model (OscarCache(model, ...)) so "
                    "each rank takes its own heads, or pass rotations.select_kv_heads(start, stop)"
                )
        if any(r is not None and r.device != device for r in masters):
            self.set_rotations(*(None if r is None else r.to(device) for r in masters))

    def feedback_for(self, keys: torch.Tensor) -> torch.Tensor | None:
        """The key feedback factor (float32) on ``keys``' device, moved there once; None without one."""
        if self.key_feedback is not None and self.key_feedback.device != keys.device:
            self.key_feedback = self.key_feedback.to(keys.device)
        return self.key_feedback

    def unrotate_output(self, output: torch.Tensor) -> torch.Tensor:
        """A decode step's attention output ``[B, Hq, D]`` mapped back (``o·R_V^T``), as ``[B, 1, Hq, D]``."""
        rotation = self.rotation_for("value", output, expand=False)
        if rotation is None:
            return output.unsqueeze(1)
        unrotated = torch.empty_like(output)
        rotate_rows([(output, rotation.mT, unrotated)])
        return unrotated.unsqueeze(1)

    def rotate_keys(self, states: torch.Tensor) -> torch.Tensor:
        """``x @ R_K`` of ``[B, H, T, D]`` states; queries are rotated like keys (each by its KV head's
        R_K) so that scores are unchanged."""
        return _rotate(states, self.rotation_for("key", states))

    def store_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys ``[B, H_kv, T, D]`` as the layer stores them: ``(k - mu) @ R_K``."""
        rotated = self.rotate_keys(keys)
        if self.key_mean is None:
            return rotated
        center = self.rotated_key_mean(rotated)  # [D] or [H_kv, D] against [B, H_kv, T, D]
        return rotated - (center if center.ndim == 1 else center.unsqueeze(-2))

    def rotated_key_mean(self, like: torch.Tensor) -> torch.Tensor:
        """``mu @ R_K``, ``[D]`` or ``[H_kv, D]`` (as :func:`~oscar_hf.kernels.rotate.rotate_rows` subtracts
        it), in ``like``'s dtype and device, made once."""
        return self._copy(("mean", None, like.shape[-1], like.dtype, like.device))

    def rotate_values(self, states: torch.Tensor) -> torch.Tensor:
        return _rotate(states, self.rotation_for("value", states))

    def _key_center(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(mu R_K,)`` as :func:`~oscar_hf.kernels.rotate.rotate_rows` subtracts it (``[D]`` or ``[H_kv, D]``),
        or ``()`` for a layer without a key mean."""
        return () if self.key_mean is None else (self.rotated_key_mean(like),)

    def unrotate_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Stored keys back in the model's basis, ``x @ R_K^T + mu``."""
        rotation = self.rotation_for("key", keys)
        keys = keys if rotation is None else _rotate(keys, rotation.mT)
        return keys if self.key_mean is None else keys + self.key_mean.to(keys.device, keys.dtype).unsqueeze(-2)

    def unrotate_values(self, values: torch.Tensor, heads_axis: int = 1) -> torch.Tensor:
        """``x @ R_V^T``; also maps attention outputs back, ``o = o_rot @ R_V^T`` (``heads_axis=2`` for
        ``[B, T, H, D]`` outputs)."""
        rotation = self.rotation_for("value", values, heads_axis=heads_axis)
        return values if rotation is None else _rotate(values, rotation.mT, heads_axis)

    def rotation_for(
        self, which: str, like: torch.Tensor, identity: bool = False, expand: bool = True, heads_axis: int = 1
    ) -> torch.Tensor | None:
        """R_K or R_V (kept in float32) on ``like``'s device and in its dtype, cast once; without one,
        None or (``identity``) the identity matrix. A per-head R is repeated over the GQA groups of
        ``like``'s heads (on ``heads_axis``) when ``expand``, else kept as ``[H_kv, D, D]``."""
        master = self.key_rotation if which == "key" else self.value_rotation
        if master is None and not identity:
            return None
        heads = like.shape[heads_axis] if expand and master is not None and master.ndim == 3 else None
        return self._copy((which, heads, like.shape[-1], like.dtype, like.device))

    def _copy(self, key: tuple) -> torch.Tensor:
        """The copy ``(which, heads, head_dim, dtype, device)`` names (``which``: ``key``, ``value`` or
        ``mean``; a missing R is the identity), made at the first ask."""
        if key[0] != "mean" and (self.key_rotation if key[0] == "key" else self.value_rotation) is None:
            key = ("identity", *key[1:])
        if key not in self._rotation_copies:
            self._rotation_copies[key] = self._make_copy(*key)
        return self._rotation_copies[key]

    def _make_copy(self, which: str, heads: int | None, dim: int, dtype: torch.dtype, device: torch.device):
        if which == "mean":
            mean, rotation = self.key_mean.to(device), self.key_rotation
            if rotation is not None:
                rotation = rotation.to(device)
                mean = mean @ rotation if rotation.ndim == 2 else (mean.unsqueeze(-2) @ rotation).squeeze(-2)
            return mean.to(dtype).contiguous()
        master = {"key": self.key_rotation, "value": self.value_rotation}.get(which)
        master = torch.eye(dim) if master is None else master
        if heads is not None:
            master = per_query_head(master, heads)
        return master.to(device=device, dtype=dtype)

    def make_step_rotations(self, dtype: torch.dtype, device: torch.device) -> None:
        """Make the copies a decode step reads (R_K and R_V, or the identity, unexpanded; ``mu R_K``) now.
        Made inside a captured step, they would live in the graph's memory and be recomputed from this
        layer's float32 masters at every replay, which a cache that takes the step over
        (:mod:`oscar_hf.core.step_reuse`) outlives."""
        for which in ("key", "value"):
            self._copy((which, None, self.head_dim, dtype, device))
        if self.key_mean is not None:
            self._copy(("mean", None, self.head_dim, dtype, device))

    def drop_rotation_copies(self) -> None:
        """Forget the cast copies (made again when next asked for): a calibration probes dozens of caches
        of one model, whose copies would otherwise add up to several times its activations."""
        self._rotation_copies = {}

    def rotation_copies(self) -> dict[tuple, torch.Tensor]:
        """The cast copies of R_K, R_V and ``mu R_K`` made so far, by what they are."""
        return dict(self._rotation_copies)

    def move_rotation_copies_into(self, copies: dict[tuple, torch.Tensor]) -> None:
        """Hold ``copies`` (another layer's :meth:`rotation_copies`) instead of this layer's own, with this
        layer's values written into them."""
        for key, tensor in copies.items():
            tensor.copy_(self._copy(key))
        self._rotation_copies.update(copies)
