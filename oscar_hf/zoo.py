"""Rotation artifacts on disk: a directory with ``rotations.safetensors`` and ``config.json``.

Tensors are float32, keyed ``layers.{i}.key_rotation``, ``layers.{i}.value_rotation``,
``layers.{i}.key_eigenvalues`` and ``layers.{i}.value_eigenvalues`` with global layer ids; a
rotation is applied as ``x @ R`` exactly as stored (oscar-reference.md section 7.1). ``config.json``
records the format, head_dim, layer ids, description and how the rotations were made.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .log import get_logger
from .rotations import RotationSet

logger = get_logger(__name__)

FORMAT = "oscar-hf-rotations"
FORMAT_VERSION = 1
TENSORS_FILE = "rotations.safetensors"
CONFIG_FILE = "config.json"
DEFAULT_ROTATIONS = "smollm2-135m-instruct"

_BUNDLED_ROOT = Path(__file__).resolve().parent / "assets" / "rotations"
_TENSOR_KEY = re.compile(r"layers\.(\d+)\.(key_rotation|value_rotation|key_eigenvalues|value_eigenvalues)")
_RESERVED_KEYS = ("format", "format_version", "head_dim", "layer_ids", "description", "library_version")


def bundled_rotations_dir(name: str) -> Path:
    """Directory of the rotations shipped with the package under ``oscar_hf/assets/rotations/<name>/``."""
    return _BUNDLED_ROOT / name


def _library_version() -> str:
    import oscar_hf  # at call time: this module may be imported while the package itself is initialising

    return getattr(oscar_hf, "__version__", "0.1.0")


def save_rotations(rotations: RotationSet, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``rotations`` to ``directory`` (created if needed) and return it.

    ``metadata`` (model id, objective, composition, calibration data, token count, ...) is merged
    into ``config.json``; it must be JSON-serialisable and may not override the format keys.
    """
    metadata = dict(metadata or {})
    clashes = sorted(set(metadata) & set(_RESERVED_KEYS))
    if clashes:
        raise ValueError(f"metadata may not set the reserved config keys {clashes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tables = {
        "key_rotation": rotations.key,
        "value_rotation": rotations.value,
        "key_eigenvalues": rotations.key_eigenvalues,
        "value_eigenvalues": rotations.value_eigenvalues,
    }
    # safetensors refuses tensors sharing memory (RotationSet.hadamard reuses one matrix), hence the clone.
    tensors = {
        f"layers.{layer_id}.{kind}": tensor.detach().to("cpu", torch.float32).clone().contiguous()
        for kind, table in tables.items()
        for layer_id, tensor in table.items()
    }
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "head_dim": rotations.head_dim,
        "layer_ids": sorted(set(rotations.key) | set(rotations.value)),
        "description": rotations.description,
        "library_version": _library_version(),
        **metadata,
    }
    save_file(tensors, str(directory / TENSORS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    logger.info("saved rotations of %d layers to %s", len(config["layer_ids"]), directory)
    return directory


def load_rotation_config(directory: str | Path) -> dict[str, Any]:
    """The validated ``config.json`` of a rotation directory (format keys plus the saved metadata)."""
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


def load_rotations(directory: str | Path) -> RotationSet:
    """Read a directory written by :func:`save_rotations`.

    Raises ``FileNotFoundError`` for a missing directory or file and ``ValueError`` for unknown
    tensors, wrong shapes, layer ids that disagree with ``config.json`` or non-orthogonal rotations.
    """
    directory = Path(directory)
    config = load_rotation_config(directory)
    path = directory / TENSORS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no {TENSORS_FILE}")
    head_dim = int(config["head_dim"])
    tables: dict[str, dict[int, torch.Tensor]] = {
        "key_rotation": {},
        "value_rotation": {},
        "key_eigenvalues": {},
        "value_eigenvalues": {},
    }
    for name, tensor in load_file(str(path)).items():
        match = _TENSOR_KEY.fullmatch(name)
        if match is None:
            raise ValueError(f"{path} holds an unexpected tensor {name!r}")
        kind = match.group(2)
        expected = (head_dim,) if kind.endswith("eigenvalues") else (head_dim, head_dim)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected {expected}")
        tables[kind][int(match.group(1))] = tensor.to(torch.float32)
    layer_ids = sorted(set(tables["key_rotation"]) | set(tables["value_rotation"]))
    if layer_ids != sorted(config["layer_ids"]):
        raise ValueError(f"{path} has rotations for layers {layer_ids} but {CONFIG_FILE} lists {config['layer_ids']}")
    return RotationSet(
        head_dim=head_dim,
        key=tables["key_rotation"],
        value=tables["value_rotation"],
        description=config.get("description", ""),
        key_eigenvalues=tables["key_eigenvalues"],
        value_eigenvalues=tables["value_eigenvalues"],
    )
