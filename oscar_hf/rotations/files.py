"""Our rotation file format: a directory with ``rotations.safetensors`` and ``config.json``.

Tensors are float32,
keyed by global layer id: ``layers.{i}.key_rotation``, ``layers.{i}.value_rotation`` (``[D, D]``, or
``[H_kv, D, D]`` for one R per KV head), ``layers.{i}.key_eigenvalues``,
``layers.{i}.value_eigenvalues`` (``[D]`` or ``[H_kv, D]``) and, when set, the per-layer clip ratios
``layers.{i}.key_clip`` / ``layers.{i}.value_clip`` and history bit widths ``layers.{i}.key_bits`` /
``layers.{i}.value_bits`` (one element each; files without them load as sets without them) and the
mean key ``layers.{i}.key_mean`` (``[D]`` or ``[H_kv, D]``) of sets that center keys and the key feedback
factor ``layers.{i}.key_feedback`` (``[D, D]`` or ``[H_kv, D, D]``) of sets that feed key errors forward.
A rotation is applied as
``x @ R`` exactly as stored, as the RotationZoo's files are. ``config.json`` records the format,
head_dim, ``kv_heads`` (per-head sets only), layer ids, description, ``base_bits`` (sets with per-layer
bit widths: the K and V widths of the method they were allocated for; files without it hold
allocations for 2-bit K and V) and whatever the caller adds (model, objective, data...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from oscar_hf._version import __version__
from oscar_hf.log import get_logger
from oscar_hf.rotations.rotation_set import RotationSet

logger = get_logger(__name__)

FORMAT = "oscar-hf-rotations"
FORMAT_VERSION = 1
TENSORS_FILE = "rotations.safetensors"
CONFIG_FILE = "config.json"
# Tensor kind in the safetensors file -> RotationSet field.
_FIELDS = {
    "key_rotation": "key",
    "value_rotation": "value",
    "key_eigenvalues": "key_eigenvalues",
    "value_eigenvalues": "value_eigenvalues",
    "key_clip": "key_clip",
    "value_clip": "value_clip",
    "key_bits": "key_bits",
    "value_bits": "value_bits",
    "key_mean": "key_mean",
    "key_feedback": "key_feedback",
}
_TENSOR_KEY = re.compile(r"layers\.(\d+)\.(" + "|".join(_FIELDS) + ")")
_RESERVED_KEYS = (
    "format",
    "format_version",
    "head_dim",
    "kv_heads",
    "layer_ids",
    "description",
    "library_version",
    "base_bits",
)


def save_rotations(rotations: RotationSet, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``rotations`` to ``directory`` (created if needed) in the oscar-hf format and return it.

    ``metadata`` (model id and revision, objective, composition, group size, clip ratios, sink,
    recent, calibration data, token count, ...) is merged into ``config.json``; it must be
    JSON-serialisable and may not override the format keys.
    """
    metadata = dict(metadata or {})
    clashes = sorted(set(metadata) & set(_RESERVED_KEYS))
    if clashes:
        raise ValueError(f"metadata may not set the reserved config keys {clashes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"layers.{layer_id}.{kind}": _stored_tensor(value)
        for kind, field_name in _FIELDS.items()
        for layer_id, value in getattr(rotations, field_name).items()
    }
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "head_dim": rotations.head_dim,
        **({"kv_heads": rotations.kv_heads} if rotations.kv_heads else {}),
        "layer_ids": layer_ids_of(rotations),
        "description": rotations.description,
        **(
            {"base_bits": dict(zip(("key", "value"), rotations.base_bits))}
            if rotations.key_bits or rotations.value_bits or rotations.base_bits != (2, 2)
            else {}
        ),
        **(dict(zip(("sink", "recent"), rotations.windows)) if rotations.windows else {}),
        "library_version": __version__,
        **metadata,
    }
    if rotations.windows and (config["sink"], config["recent"]) != rotations.windows:
        raise ValueError(f"metadata's sink/recent {config['sink']}/{config['recent']} contradict the set's windows")
    save_file(tensors, str(directory / TENSORS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    logger.info("saved rotations of %d layers to %s", len(config["layer_ids"]), directory)
    return directory


def _stored_tensor(value: torch.Tensor | float | int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        # safetensors refuses tensors sharing memory (RotationSet.hadamard reuses one matrix), hence the clone.
        return value.detach().to("cpu", torch.float32).clone().contiguous()
    return torch.tensor([float(value)], dtype=torch.float32)


def layer_ids_of(rotations: RotationSet) -> list[int]:
    return sorted(set().union(*(getattr(rotations, field_name) for field_name in _FIELDS.values())))


def load_rotation_config(directory: str | Path) -> dict[str, Any]:
    """The validated ``config.json`` of an oscar-hf rotation directory (format keys plus the saved metadata)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"rotation directory {directory} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no {CONFIG_FILE}; it is not an oscar-hf rotation directory")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{path} has format {config.get('format')!r}, expected {FORMAT!r}")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {config.get('format_version')!r}; this oscar-hf reads version {FORMAT_VERSION}"
        )
    return config


def load_ours(directory: Path, per_head: bool | None = None) -> RotationSet:
    config = load_rotation_config(directory)
    path = directory / TENSORS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no {TENSORS_FILE}")
    head_dim = int(config["head_dim"])
    tables: dict[str, dict] = {field_name: {} for field_name in _FIELDS.values()}
    for name, tensor in load_file(str(path)).items():
        match = _TENSOR_KEY.fullmatch(name)
        if match is None:
            raise ValueError(f"{path} holds an unexpected tensor {name!r}")
        kind = match.group(2)
        tables[_FIELDS[kind]][int(match.group(1))] = _read_tensor(path, name, kind, tensor, head_dim)
    layer_ids = sorted(set().union(*tables.values()))
    if layer_ids != sorted(config["layer_ids"]):
        raise ValueError(f"{path} has tensors for layers {layer_ids} but {CONFIG_FILE} lists {config['layer_ids']}")
    base = config.get("base_bits", {"key": 2, "value": 2})
    if not isinstance(base, dict) or set(base) != {"key", "value"}:
        raise ValueError(f"{path.parent / CONFIG_FILE}: base_bits must be {{'key': bits, 'value': bits}}, got {base!r}")
    windows = (config["sink"], config["recent"]) if "sink" in config and "recent" in config else None
    rotations = RotationSet(
        head_dim=head_dim,
        description=config.get("description", ""),
        base_bits=(base["key"], base["value"]),
        windows=windows,
        **tables,
    )
    if rotations.kv_heads != config.get("kv_heads"):
        raise ValueError(
            f"{path} has rotations for {rotations.kv_heads or 'no'} separate KV heads but {CONFIG_FILE} says "
            f"kv_heads={config.get('kv_heads')}"
        )
    if per_head is not None and rotations.per_head != per_head:
        held = "one rotation per KV head" if rotations.per_head else "rotations shared by all heads of a layer"
        raise ValueError(
            f"{directory} holds {held} only, but {'per-head' if per_head else 'shared'} rotations were asked for "
            "(per_head=None takes what the folder holds)"
        )
    return rotations


def _read_tensor(path: Path, name: str, kind: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor | float | int:
    if kind.endswith("bits"):
        if tensor.numel() != 1 or tensor.ndim > 1 or tensor.item() != int(tensor.item()):
            raise ValueError(f"{path}: {name} must hold a single whole bit width, got {tensor.tolist()}")
        return int(tensor.item())
    if kind.endswith("clip"):
        if tensor.numel() != 1 or tensor.ndim > 1:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected a single clip ratio")
        return _shortest_float(tensor)
    expected = (head_dim,) if kind.endswith(("eigenvalues", "mean")) else (head_dim, head_dim)
    shape = tuple(tensor.shape)
    if shape != expected and not (len(shape) == len(expected) + 1 and shape[1:] == expected):
        raise ValueError(f"{path}: {name} has shape {shape}, expected {expected} or (kv_heads, *{expected})")
    return tensor.to(torch.float32)


def _shortest_float(tensor: torch.Tensor) -> float:
    """The shortest decimal that float32 stores as this value, so a ratio saved as 0.96 reads back as 0.96."""
    stored = tensor.reshape(()).to(torch.float32)
    for digits in range(1, 10):  # 9 significant digits always reproduce a float32
        candidate = float(f"{stored.item():.{digits}g}")
        if torch.tensor(candidate, dtype=torch.float32) == stored:
            return candidate
    return stored.item()
