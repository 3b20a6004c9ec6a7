"""The official OSCAR RotationZoo files, read as they are (:func:`load_official`) or converted to our format.

The RotationZoo (hub repo ``Zhongzhu/OSCAR-RotationZoo``) keeps torch-saved dicts in
``<Model>/<calibration tag>/{k_rotation_qqt_r_h_pbr.pt, v_rotation_sst_r_h_pbr.pt}`` (format 1, one R
per layer) and, for some models, ``{k_rotation_perhead.pt, v_rotation_perhead.pt}`` beside them
(format 2, ``source_grouping: "per_kv_head"``, one R per KV head, added by github.com/FutureMLS-Lab/OSCAR after the paper).
Where a folder holds both, the per-head files are read unless ``per_head=False`` asks for the shared ones.
Format 3 (the reference's key centering, files ``k_rotation_oscar2_<variant>.pt``) adds an optional
per-layer key mean ``k_mean`` (``[D]`` or ``[H_kv, D]``), read into :attr:`RotationSet.key_mean`; a
layer's rotation is shared or per KV head by its number of dimensions. Its non-orthogonal key
transforms (``q_rotation`` / ``o_rotation``) are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from oscar_hf.log import get_logger
from oscar_hf.rotations.files import save_rotations
from oscar_hf.rotations.rotation_set import RotationSet, format_layer_ids

logger = get_logger(__name__)

OFFICIAL_KEY_FILE = "k_rotation_qqt_r_h_pbr.pt"
OFFICIAL_VALUE_FILE = "v_rotation_sst_r_h_pbr.pt"
OFFICIAL_PER_HEAD_KEY_FILE = "k_rotation_perhead.pt"
OFFICIAL_PER_HEAD_VALUE_FILE = "v_rotation_perhead.pt"
# The official files are named after their objective; other objectives (hadamard, ktk_...) exist too.
OFFICIAL_KEY_PATTERN = "k_rotation_*.pt"
OFFICIAL_VALUE_PATTERN = "v_rotation_*.pt"
# format_version -> source_grouping its files carry (format 2: one R per KV head).
_OFFICIAL_GROUPING = {1: "layer", "identity-v1": "layer", 2: "per_kv_head", 3: None}
# Format 3 entries that carry a non-orthogonal key transform (the reference's whiten / flat / stretch).
_NON_ORTHOGONAL = ("q_rotation", "o_rotation")


def load_official(directory: str | Path, per_head: bool | None = None) -> RotationSet:
    """Read a RotationZoo directory holding ``k_rotation_*.pt`` (R_K) and ``v_rotation_*.pt`` (R_V).

    ``per_head``: None reads, for K and for V, the per-KV-head file (``*_rotation_perhead.pt``, format
    2) where the folder has one and the shared file (format 1) otherwise; True reads only per-head
    files and False only shared ones, and raise ``FileNotFoundError`` where those are missing.

    Raises ``FileNotFoundError`` for a missing directory or file, ``ValueError`` for a file that
    is not a RotationZoo dict, wrong shapes, K and V files covering different layers, or
    non-orthogonal rotations.
    """
    return _read_official_dir(Path(directory), per_head)[0]


def convert_official(
    src_dir: str | Path, dst_dir: str | Path, metadata: dict[str, Any] | None = None, per_head: bool | None = None
) -> Path:
    """Convert a RotationZoo directory ``<Model>/<calibration tag>/`` to the oscar-hf format in ``dst_dir``.

    ``per_head`` picks the files as in :func:`load_official`. The config records the objectives, the
    composition, the model and calibration tag (from the folder names) and the source path;
    ``metadata`` adds to or overrides those entries.
    """
    src = Path(src_dir).resolve()
    rotations, info = _read_official_dir(src, per_head)
    recorded = {
        "source_format": "OSCAR RotationZoo (torch.save)",
        "source_path": str(src),
        "source_files": [info["key_file"], info["value_file"]],
        "model_name": src.parent.name,
        "calibration": src.name,
        **_objective_metadata(info["key_objective"], info["value_objective"]),
        "key_objective": info["key_objective"],
        "value_objective": info["value_objective"],
        **(metadata or {}),
    }
    return save_rotations(rotations, dst_dir, recorded)


def _objective_metadata(key_objective: str, value_objective: str) -> dict[str, str]:
    """``qqt_r_h_pbr`` + ``sst_r_h_pbr`` -> objective ``qqt_sst``, composition ``r_h_pbr`` (the bundled set's terms)."""
    key_base, _, key_composition = key_objective.partition("_")
    value_base, _, value_composition = value_objective.partition("_")
    if key_composition != value_composition:
        return {"objective": f"{key_objective}/{value_objective}"}
    base = key_base if key_base == value_base else f"{key_base}_{value_base}"
    return {"objective": base, "composition": key_composition} if key_composition else {"objective": base}


def _read_official_dir(directory: Path, per_head: bool | None = None) -> tuple[RotationSet, dict[str, str]]:
    if not directory.is_dir():
        raise FileNotFoundError(f"RotationZoo directory {directory} does not exist")
    key_path = _official_file(directory, OFFICIAL_KEY_PATTERN, OFFICIAL_KEY_FILE, OFFICIAL_PER_HEAD_KEY_FILE, per_head)
    value_path = _official_file(
        directory, OFFICIAL_VALUE_PATTERN, OFFICIAL_VALUE_FILE, OFFICIAL_PER_HEAD_VALUE_FILE, per_head
    )
    key_objective, key, key_eigenvalues, key_mean = _read_official_file(key_path)
    value_objective, value, value_eigenvalues, _ = _read_official_file(value_path)
    if sorted(key) != sorted(value):
        raise ValueError(
            f"{directory}: {key_path.name} has layers {format_layer_ids(sorted(key))} but "
            f"{value_path.name} has layers {format_layer_ids(sorted(value))}"
        )
    head_dims = {r.shape[-1] for r in [*key.values(), *value.values()]}
    if len(head_dims) != 1:
        raise ValueError(f"{directory}: the K and V rotations have different shapes (head dims {sorted(head_dims)})")
    rotations = RotationSet(
        head_dim=head_dims.pop(),
        key=key,
        value=value,
        description=(
            f"OSCAR RotationZoo {directory.parent.name}/{directory.name} (K: {key_objective}, V: {value_objective})"
        ),
        key_eigenvalues=key_eigenvalues,
        value_eigenvalues=value_eigenvalues,
        key_mean=key_mean,
    )
    info = {
        "key_objective": key_objective,
        "value_objective": value_objective,
        "key_file": key_path.name,
        "value_file": value_path.name,
    }
    return rotations, info


def _official_file(directory: Path, pattern: str, preferred: str, per_head_name: str, per_head: bool | None) -> Path:
    """The K (or V) file to read: the per-head one if present and not refused, else the shared one."""
    per_head_file = directory / per_head_name
    if per_head_file.is_file() and per_head is not False:
        return per_head_file
    if per_head:
        raise FileNotFoundError(
            f"{directory} holds no {per_head_name}: per-head rotations were asked for (per_head=True), and the "
            f"shared ones it may hold are not taken in their place; pass per_head=None or False to use those"
        )
    files = sorted(f for f in directory.glob(pattern) if f != per_head_file)
    if not files:
        raise FileNotFoundError(
            f"{directory} holds no {preferred} (a RotationZoo folder <Model>/<calibration>/ holds "
            f"{OFFICIAL_KEY_FILE} and {OFFICIAL_VALUE_FILE}"
            + (
                f", and may hold {OFFICIAL_PER_HEAD_KEY_FILE} and {OFFICIAL_PER_HEAD_VALUE_FILE})"
                if per_head is False
                else ")"
            )
        )
    if len(files) == 1:
        return files[0]
    if directory / preferred in files:
        return directory / preferred
    raise ValueError(f"{directory} holds several {pattern} files {[f.name for f in files]}; keep one per folder")


def holds_official(directory: Path) -> bool:
    return any(directory.glob(OFFICIAL_KEY_PATTERN)) or any(directory.glob(OFFICIAL_VALUE_PATTERN))


def _read_official_file(
    path: Path,
) -> tuple[str, dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """(objective, rotations, eigenvalues, key means) of one RotationZoo file, keyed by int layer id."""
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # the unpickling errors differ between torch versions
        raise ValueError(f"{path} is not a torch-saved RotationZoo file: {error}") from error
    if not isinstance(data, dict) or "layers" not in data:
        raise ValueError(
            f"{path} has no 'layers' key; a RotationZoo file is a dict "
            "{format_version, objective, source_grouping, layers: {layer id: {rotation, eigenvalues}}}"
        )
    version = data.get("format_version")
    if version not in _OFFICIAL_GROUPING:
        raise ValueError(f"{path} has format_version {version!r}; supported: {list(_OFFICIAL_GROUPING)}")
    grouping = _OFFICIAL_GROUPING[version]
    if grouping is not None and data.get("source_grouping", "layer") != grouping:
        raise ValueError(
            f"{path} has source_grouping {data.get('source_grouping')!r}; format_version {version!r} files have "
            f"{grouping!r}"
        )
    layers = data["layers"]
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{path}: 'layers' must be a non-empty dict of layer id -> entry")
    rotations: dict[int, torch.Tensor] = {}
    eigenvalues: dict[int, torch.Tensor] = {}
    means: dict[int, torch.Tensor] = {}
    for key, entry in layers.items():
        layer_id = _official_layer_id(path, key, entry)
        if layer_id in rotations:
            raise ValueError(f"{path} lists layer {layer_id} twice")
        per_head = None if grouping is None else grouping == "per_kv_head"
        rotations[layer_id], eigenvalue = _official_entry(path, layer_id, entry, per_head)
        if eigenvalue is not None:
            eigenvalues[layer_id] = eigenvalue
        if entry.get("k_mean") is not None:
            means[layer_id] = _official_mean(path, layer_id, entry["k_mean"], rotations[layer_id])
    return str(data.get("objective", "")), rotations, eigenvalues, means


def _official_layer_id(path: Path, key: Any, entry: Any) -> int:
    # The reference loader accepts python int and str layer keys alike.
    if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and key.isdigit())):
        raise ValueError(f"{path}: layer key {key!r} is not a layer id")
    layer_id = int(key)
    if isinstance(entry, dict) and "layer_id" in entry and int(entry["layer_id"]) != layer_id:
        raise ValueError(f"{path}: the entry under layer {key!r} says layer_id={entry['layer_id']!r}")
    return layer_id


def _official_entry(
    path: Path, layer_id: int, entry: Any, per_head: bool | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rotation, eigenvalues or None) of one layer: ``[D, D]`` and ``[D]``, or per KV head ``[H_kv, D, D]``
    and ``[H_kv, D]`` (eigenvalues may also be absent there); ``per_head=None`` (format 3) takes either."""
    rotation = entry.get("rotation") if isinstance(entry, dict) else None
    if not isinstance(rotation, torch.Tensor):
        raise ValueError(f"{path}: layer {layer_id} has no 'rotation' tensor")
    transforms = [name for name in _NON_ORTHOGONAL if entry.get(name) is not None]
    if transforms:
        raise ValueError(
            f"{path}: layer {layer_id} carries {' and '.join(transforms)}, a non-orthogonal key transform "
            "(the reference's whiten / flat / stretch variants); scalar INT2 cannot hold such keys at long context "
            "(the reference measured perplexity 102-978 at 32K), so only orthogonal rotations load: take the "
            "folder's plain or centered (k_mean) variant"
        )
    if per_head is None:
        per_head = rotation.ndim == 3
    if rotation.ndim != 2 + per_head or rotation.shape[-1] != rotation.shape[-2]:
        expected = "[H_kv, D, D] (per_kv_head)" if per_head else "[D, D]"
        raise ValueError(
            f"{path}: the rotation of layer {layer_id} has shape {tuple(rotation.shape)}, expected {expected}"
        )
    eigenvalues = entry.get("eigenvalues")  # absent in the identity files; informational only
    if eigenvalues is None:
        return rotation.to(torch.float32), None
    if not isinstance(eigenvalues, torch.Tensor) or tuple(eigenvalues.shape) != tuple(rotation.shape[:-1]):
        shape = tuple(eigenvalues.shape) if isinstance(eigenvalues, torch.Tensor) else type(eigenvalues).__name__
        expected = tuple(rotation.shape[:-1])
        raise ValueError(f"{path}: the eigenvalues of layer {layer_id} have shape {shape}, expected {expected}")
    return rotation.to(torch.float32), eigenvalues.to(torch.float32)


def _official_mean(path: Path, layer_id: int, mean: Any, rotation: torch.Tensor) -> torch.Tensor:
    """A format-3 layer's key mean, ``[D]`` or ``[H_kv, D]`` (as many KV heads as a per-head rotation)."""
    dim = rotation.shape[-1]
    shaped = isinstance(mean, torch.Tensor) and mean.ndim in (1, 2) and mean.shape[-1] == dim
    if not shaped or (mean.ndim == 2 and rotation.ndim == 3 and mean.shape[0] != rotation.shape[0]):
        shape = tuple(mean.shape) if isinstance(mean, torch.Tensor) else type(mean).__name__
        raise ValueError(
            f"{path}: the k_mean of layer {layer_id} has shape {shape}, expected ({dim},) or (H_kv, {dim})"
        )
    return mean.to(torch.float32)
