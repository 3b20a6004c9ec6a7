"""What a calibration records beside its rotations: the saved set it started from (its origin and the
commands since), the calibration files by name and hash, and the summary ``oscar-hf calibrate`` prints
(time, peak memory, each layer's covariance spread, choices and widths)."""

from __future__ import annotations

import hashlib
import resource
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from oscar_hf.calibration.bit_allocation import BitAllocation
from oscar_hf.calibration.clip_search import LayerChoice
from oscar_hf.calibration.covariances import LayerCovariances
from oscar_hf.rotations.rotation_set import RotationSet

# What a calibration from a saved set carries over from it: how its rotations and clips were made.
_RECIPE_KEYS = ("objective", "composition", "source_grouping", "clip", "layer_choices")


def existing_set(path: str) -> tuple[RotationSet, dict]:
    """A saved set's rotations and clip ratios (its bit widths are replaced by the allocation) and the metadata
    of how they were made: the command that made the rotations, and the commands that changed the set since."""
    from oscar_hf.rotations.files import load_rotation_config
    from oscar_hf.rotations.hub import load_rotations

    config = load_rotation_config(path)
    rotations = load_rotations(path)
    recipe = {key: config[key] for key in _RECIPE_KEYS if key in config}
    made = {key: config.get(key) for key in ("command", "recipe", "calibration_data", "tokens")}
    made["files"] = file_hashes(f for f in sorted(Path(path).iterdir()) if f.is_file())
    if "rotations_from" in config:  # the rotations were made further back: keep their origin, list the steps since
        origin = config["rotations_from"]
        made = {**origin, "then": [*origin.get("then", []), config.get("command")]}
    recipe["rotations_from"] = made
    return rotations, recipe


def file_hashes(files: Iterable[Path]) -> dict[str, str]:
    """Each file's name and the SHA-256 of its bytes."""
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def calibration_summary(
    started: float,
    tokens: int,
    covariances: dict[int, LayerCovariances],
    rotations: RotationSet,
    choices: dict[int, LayerChoice],
    allocation: BitAllocation | None,
    allocate_for: str,
) -> dict:
    """The summary of a calibration that began at ``started`` (``time.perf_counter()``)."""
    summary = {
        "layers": len(rotations.key),
        "tokens": tokens,
        "seconds": round(time.perf_counter() - started, 1),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "per_layer": _per_layer(covariances, rotations, choices),
    }
    if allocation is not None:
        summary["bit_allocation"] = {
            "method": allocate_for,
            "key_bits": allocation.key_bits,
            "value_1bit_layers": allocation.value_layers,
            "baseline_kl": round(allocation.baseline_kl, 6),
            "allocated_kl": round(allocation.allocated_kl, 6),
        }
    return summary


def _peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _spread(eigenvalues: torch.Tensor) -> tuple[float, float]:
    """(largest / smallest eigenvalue, largest eigenvalue's share of the trace)."""
    values = eigenvalues.double().clamp_min(1e-30)
    return float(values.max() / values.min()), float(values.max() / values.sum())


def _per_layer(covariances: dict[int, LayerCovariances], rotations: RotationSet, choices: dict) -> list[dict]:
    rows = []
    for layer_id in sorted(rotations.key):
        row: dict = {"layer": layer_id}
        if layer_id in covariances:
            q_ratio, q_share = _spread(torch.linalg.eigvalsh(covariances[layer_id].query))
            s_ratio, _ = _spread(torch.linalg.eigvalsh(covariances[layer_id].value))
            row |= {
                "c_q_condition": round(q_ratio, 1),
                "c_q_top_share": round(q_share, 3),
                "c_s_condition": round(s_ratio, 1),
            }
        if layer_id in choices:
            c = choices[layer_id]
            # The stored ratios: the search's, or those searched again after --refine.
            row |= {
                "key": f"{c.key_factors} clip {rotations.key_clip[layer_id]}",
                "value": f"{c.value_factors} clip {rotations.value_clip[layer_id]}",
            }
        if rotations.key_bits or rotations.value_bits:
            base_key, base_value = rotations.base_bits
            row |= {
                "key_bits": rotations.key_bits.get(layer_id, base_key),
                "value_bits": rotations.value_bits.get(layer_id, base_value),
            }
        rows.append(row)
    return rows
