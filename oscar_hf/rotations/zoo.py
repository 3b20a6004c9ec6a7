"""Rotation artifacts: our safetensors format, the official OSCAR RotationZoo files, and the hub.

Our format is a directory with ``rotations.safetensors`` and ``config.json``. Tensors are float32,
keyed by global layer id: ``layers.{i}.key_rotation``, ``layers.{i}.value_rotation`` (``[D, D]``, or
``[H_kv, D, D]`` for one R per KV head), ``layers.{i}.key_eigenvalues``,
``layers.{i}.value_eigenvalues`` (``[D]`` or ``[H_kv, D]``) and, when set, the per-layer clip ratios
``layers.{i}.key_clip`` / ``layers.{i}.value_clip`` and history bit widths ``layers.{i}.key_bits`` /
``layers.{i}.value_bits`` (one element each; files without them load as sets without them). A rotation is applied as
``x @ R`` exactly as stored (oscar-reference.md section 7.1). ``config.json`` records the format,
head_dim, ``kv_heads`` (per-head sets only), layer ids, description and whatever the caller adds
(model, objective, data...).

The official RotationZoo (hub repo ``Zhongzhu/OSCAR-RotationZoo``) keeps torch-saved dicts in
``<Model>/<calibration tag>/{k_rotation_qqt_r_h_pbr.pt, v_rotation_sst_r_h_pbr.pt}`` (format 1, one R
per layer) and, for some models, ``{k_rotation_perhead.pt, v_rotation_perhead.pt}`` beside them
(format 2, ``source_grouping: "per_kv_head"``, one R per KV head, oscar-reference.md Appendix C);
they are read as they are (:func:`load_official`) or converted to our format (:func:`convert_official`).
Where a folder holds both, the per-head files are read unless ``per_head=False`` asks for the shared ones.

:func:`save_pretrained`, :func:`from_pretrained` and :func:`push_to_hub` follow the Hugging Face
conventions; :func:`resolve_rotations` picks the rotations for a model (``OscarCache.from_zoo``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
from huggingface_hub.errors import (
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel

from oscar_hf.core.cache import head_dim_of, kv_heads_of
from oscar_hf.core.config import OscarConfig, resolve_method
from oscar_hf.log import get_logger
from oscar_hf.core.rotation_set import RotationSet

logger = get_logger(__name__)

FORMAT = "oscar-hf-rotations"
FORMAT_VERSION = 1
TENSORS_FILE = "rotations.safetensors"
CONFIG_FILE = "config.json"
DEFAULT_ROTATIONS = "smollm2-135m-instruct"  # clip-searched: what oscar-int2 is best with
DEFAULT_PAPER_ROTATIONS = "smollm2-135m-instruct-paper"  # U·H·P, fixed clips: oscar-int2-paper
ROTATION_ZOO = "Zhongzhu/OSCAR-RotationZoo"
OFFICIAL_KEY_FILE = "k_rotation_qqt_r_h_pbr.pt"
OFFICIAL_VALUE_FILE = "v_rotation_sst_r_h_pbr.pt"
OFFICIAL_PER_HEAD_KEY_FILE = "k_rotation_perhead.pt"
OFFICIAL_PER_HEAD_VALUE_FILE = "v_rotation_perhead.pt"
ZOO_OPTIONS = frozenset({"subfolder", "revision", "local_files_only", "cache_dir", "calibration", "per_head"})

_BUNDLED_ROOT = Path(__file__).resolve().parent / "assets" / "rotations"
_BUNDLED_KEYWORD = "default"
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
}
_TENSOR_KEY = re.compile(r"layers\.(\d+)\.(" + "|".join(_FIELDS) + ")")
_RESERVED_KEYS = ("format", "format_version", "head_dim", "kv_heads", "layer_ids", "description", "library_version")
# The official files are named after their objective; other objectives (hadamard, ktk_...) exist too.
_OFFICIAL_KEY_PATTERN = "k_rotation_*.pt"
_OFFICIAL_VALUE_PATTERN = "v_rotation_*.pt"
# format_version -> source_grouping its files carry (format 2: one R per KV head).
_OFFICIAL_GROUPING = {1: "layer", "identity-v1": "layer", 2: "per_kv_head"}
_SIGNATURE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
)


class RotationsNotFoundError(FileNotFoundError):
    """Rotations could not be found locally and could not be fetched from the Hugging Face hub."""


def bundled_rotations_dir(name: str) -> Path:
    """Directory of the rotations shipped with the package under ``oscar_hf/assets/rotations/<name>/``."""
    return _BUNDLED_ROOT / name


def _library_version() -> str:
    import oscar_hf  # at call time: this module may be imported while the package itself is initialising

    return getattr(oscar_hf, "__version__", "0.1.0")


# ---------------------------------------------------------------------------------------------------
# Our format


def save_pretrained(rotations: RotationSet, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path:
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
        **({"kv_heads": rotations.kv_heads} if rotations.per_head else {}),
        "layer_ids": _layer_ids(rotations),
        "description": rotations.description,
        "library_version": _library_version(),
        **metadata,
    }
    save_file(tensors, str(directory / TENSORS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    logger.info("saved rotations of %d layers to %s", len(config["layer_ids"]), directory)
    return directory


def _stored_tensor(value: torch.Tensor | float | int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        # safetensors refuses tensors sharing memory (RotationSet.hadamard reuses one matrix), hence the clone.
        return value.detach().to("cpu", torch.float32).clone().contiguous()
    return torch.tensor([float(value)], dtype=torch.float32)


def _layer_ids(rotations: RotationSet) -> list[int]:
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


def _load_ours(directory: Path, per_head: bool | None = None) -> RotationSet:
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
    rotations = RotationSet(head_dim=head_dim, description=config.get("description", ""), **tables)
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
    expected = (head_dim,) if kind.endswith("eigenvalues") else (head_dim, head_dim)
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


# ---------------------------------------------------------------------------------------------------
# The official RotationZoo files


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
    return save_pretrained(rotations, dst_dir, recorded)


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
    key_path = _official_file(directory, _OFFICIAL_KEY_PATTERN, OFFICIAL_KEY_FILE, OFFICIAL_PER_HEAD_KEY_FILE, per_head)
    value_path = _official_file(
        directory, _OFFICIAL_VALUE_PATTERN, OFFICIAL_VALUE_FILE, OFFICIAL_PER_HEAD_VALUE_FILE, per_head
    )
    key_objective, key, key_eigenvalues = _read_official_file(key_path)
    value_objective, value, value_eigenvalues = _read_official_file(value_path)
    if sorted(key) != sorted(value):
        raise ValueError(
            f"{directory}: {key_path.name} has layers {_format_ids(sorted(key))} but "
            f"{value_path.name} has layers {_format_ids(sorted(value))}"
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
    )
    info = {"key_objective": key_objective, "value_objective": value_objective,
            "key_file": key_path.name, "value_file": value_path.name}
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
            + (f", and may hold {OFFICIAL_PER_HEAD_KEY_FILE} and {OFFICIAL_PER_HEAD_VALUE_FILE})" if per_head is False
               else ")")
        )
    if len(files) == 1:
        return files[0]
    if directory / preferred in files:
        return directory / preferred
    raise ValueError(f"{directory} holds several {pattern} files {[f.name for f in files]}; keep one per folder")


def _holds_official(directory: Path) -> bool:
    return any(directory.glob(_OFFICIAL_KEY_PATTERN)) or any(directory.glob(_OFFICIAL_VALUE_PATTERN))


def _read_official_file(path: Path) -> tuple[str, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """(objective, rotations, eigenvalues) of one RotationZoo file, keyed by int layer id."""
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
    if data.get("source_grouping", "layer") != grouping:
        raise ValueError(
            f"{path} has source_grouping {data.get('source_grouping')!r}; format_version {version!r} files have "
            f"{grouping!r}"
        )
    layers = data["layers"]
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{path}: 'layers' must be a non-empty dict of layer id -> entry")
    rotations: dict[int, torch.Tensor] = {}
    eigenvalues: dict[int, torch.Tensor] = {}
    for key, entry in layers.items():
        layer_id = _official_layer_id(path, key, entry)
        if layer_id in rotations:
            raise ValueError(f"{path} lists layer {layer_id} twice")
        rotations[layer_id], eigenvalue = _official_entry(path, layer_id, entry, per_head=grouping == "per_kv_head")
        if eigenvalue is not None:
            eigenvalues[layer_id] = eigenvalue
    return str(data.get("objective", "")), rotations, eigenvalues


def _official_layer_id(path: Path, key: Any, entry: Any) -> int:
    # The reference loader accepts python int and str layer keys alike.
    if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and key.isdigit())):
        raise ValueError(f"{path}: layer key {key!r} is not a layer id")
    layer_id = int(key)
    if isinstance(entry, dict) and "layer_id" in entry and int(entry["layer_id"]) != layer_id:
        raise ValueError(f"{path}: the entry under layer {key!r} says layer_id={entry['layer_id']!r}")
    return layer_id


def _official_entry(
    path: Path, layer_id: int, entry: Any, per_head: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rotation, eigenvalues or None) of one layer: ``[D, D]`` and ``[D]``, or per KV head ``[H_kv, D, D]``
    and ``[H_kv, D]`` (eigenvalues may also be absent there)."""
    rotation = entry.get("rotation") if isinstance(entry, dict) else None
    if not isinstance(rotation, torch.Tensor):
        raise ValueError(f"{path}: layer {layer_id} has no 'rotation' tensor")
    if rotation.ndim != 2 + per_head or rotation.shape[-1] != rotation.shape[-2]:
        expected = "[H_kv, D, D] (per_kv_head)" if per_head else "[D, D]"
        raise ValueError(f"{path}: the rotation of layer {layer_id} has shape {tuple(rotation.shape)}, expected {expected}")
    eigenvalues = entry.get("eigenvalues")  # absent in the identity files; informational only
    if eigenvalues is None:
        return rotation.to(torch.float32), None
    if not isinstance(eigenvalues, torch.Tensor) or tuple(eigenvalues.shape) != tuple(rotation.shape[:-1]):
        shape = tuple(eigenvalues.shape) if isinstance(eigenvalues, torch.Tensor) else type(eigenvalues).__name__
        expected = tuple(rotation.shape[:-1])
        raise ValueError(f"{path}: the eigenvalues of layer {layer_id} have shape {shape}, expected {expected}")
    return rotation.to(torch.float32), eigenvalues.to(torch.float32)


# ---------------------------------------------------------------------------------------------------
# Local directories and the hub


def from_pretrained(
    name_or_path: str | Path,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    local_files_only: bool | None = None,
    cache_dir: str | Path | None = None,
    per_head: bool | None = None,
) -> RotationSet:
    """Load rotations from a local directory or a Hugging Face hub repo, in our or the RotationZoo layout.

    Args:
        name_or_path: a local directory, or a hub repo id (e.g. ``"Zhongzhu/OSCAR-RotationZoo"``).
        subfolder: folder inside it that holds the files (e.g. ``"Qwen3-8B/seq20000_prompt83_group128"``).
        revision: hub branch, tag or commit (ignored for local directories).
        local_files_only: only read the local hub cache; ``None`` follows ``HF_HUB_OFFLINE``.
        cache_dir: hub cache folder (default: huggingface_hub's).
        per_head: None takes the best the folder holds (per-KV-head rotations where present);
            True asks for per-head and False for shared rotations, an error where those are missing.

    Raises:
        RotationsNotFoundError: the hub cannot be reached (or offline mode is on) and the files
            are not cached, or the repo/revision does not exist.
        FileNotFoundError / ValueError: the folder holds no valid rotations.
    """
    local = _local_directory(name_or_path)
    if local is not None:
        if revision is not None:
            logger.info("revision=%r is ignored for the local directory %s", revision, local)
        return _load_directory(local / subfolder if subfolder else local, per_head)
    repo_id, patterns = str(name_or_path), _hub_patterns(subfolder)
    folder = subfolder.strip("/") if subfolder else None
    snapshot = _download(
        repo_id, patterns, folder=folder, local=f"DIR/{folder}" if folder else "DIR",
        revision=revision, local_files_only=local_files_only, cache_dir=cache_dir,
    )
    directory = snapshot / subfolder if subfolder else snapshot
    if not directory.is_dir() or not any(directory.iterdir()):
        raise RotationsNotFoundError(
            f"the hub repo {repo_id}{f'@{revision}' if revision else ''} holds no rotation files matching {patterns}"
            + ("" if subfolder else "; for the RotationZoo layout pass subfolder='<Model>/<calibration>'")
        )
    return _load_directory(directory, per_head)


def _local_directory(name_or_path: str | Path) -> Path | None:
    """The local directory meant by ``name_or_path``, or None when it names a hub repo."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; pass the directory that holds the rotation files")
    if isinstance(name_or_path, Path) or not _is_repo_id(str(name_or_path)):
        raise FileNotFoundError(f"rotation directory {path} does not exist (and it is not a hub repo id either)")
    return None


def _is_repo_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _load_directory(directory: Path, per_head: bool | None = None) -> RotationSet:
    """Rotations in ``directory``, whichever layout (ours or RotationZoo) it holds."""
    if not directory.is_dir():
        raise FileNotFoundError(f"rotation directory {directory} does not exist")
    if (directory / CONFIG_FILE).is_file() or (directory / TENSORS_FILE).is_file():
        return _load_ours(directory, per_head)
    if _holds_official(directory):
        return load_official(directory, per_head)
    found = sorted(p.name for p in directory.iterdir())[:12]
    raise FileNotFoundError(
        f"{directory} holds no rotations: expected {TENSORS_FILE} + {CONFIG_FILE} (oscar-hf) or "
        f"{OFFICIAL_KEY_FILE} + {OFFICIAL_VALUE_FILE} (RotationZoo); it holds {found or 'nothing'}"
    )


def _hub_patterns(subfolder: str | None) -> list[str]:
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    names = (TENSORS_FILE, CONFIG_FILE, _OFFICIAL_KEY_PATTERN, _OFFICIAL_VALUE_PATTERN)
    return [prefix + name for name in names]


def _hub_offline(local_files_only: bool | None) -> bool:
    """Explicit ``local_files_only``, else ``HF_HUB_OFFLINE`` as set now (huggingface_hub reads it only at import)."""
    if local_files_only is not None:
        return bool(local_files_only)
    from_env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return from_env or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def _download(
    repo_id: str,
    patterns: list[str],
    *,
    folder: str | None,
    local: str,
    revision: str | None,
    local_files_only: bool | None,
    cache_dir: str | Path | None,
) -> Path:
    """``snapshot_download`` of ``patterns``, with errors that say what to do instead.

    ``folder`` is the repo folder the patterns select and ``local`` what to pass instead once it
    is copied to a local ``DIR``; both only shape the error message.
    """
    offline = _hub_offline(local_files_only)
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=patterns,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            library_name="oscar-hf",
            library_version=_library_version(),
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        reason = (
            "offline mode is on (HF_HUB_OFFLINE=1 or local_files_only=True)" if offline
            else "the Hugging Face hub is unreachable"
        )
        message = _unreachable_message(repo_id, patterns, folder, local, revision, reason)
        raise RotationsNotFoundError(message) from error
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise RotationsNotFoundError(
            f"the Hugging Face hub has no {repo_id!r}{f' at revision {revision!r}' if revision else ''} "
            f"(or it is private or gated: log in with `hf auth login`); there is no local directory "
            f"{repo_id!r} either. Hub error: {error}"
        ) from error
    return Path(snapshot)


def _unreachable_message(
    repo_id: str, patterns: list[str], folder: str | None, local: str, revision: str | None, reason: str
) -> str:
    options = (f" --include '{folder}/*'" if folder else "") + (f" --revision {revision}" if revision else "")
    return (
        f"Could not get rotations from the hub repo {repo_id!r}{f' at revision {revision!r}' if revision else ''}: "
        f"{reason}, and the local hub cache does not hold {patterns} (there is no local directory {repo_id!r} "
        f"either). Download them where the hub is reachable (`hf download {repo_id}{options} --local-dir DIR`), "
        f"copy DIR here and pass the local directory instead: OscarCache.from_zoo(model, {local!r}) or "
        f"oscar_hf.rotations.zoo.from_pretrained({local!r})" + ("; or unset HF_HUB_OFFLINE." if "offline" in reason else ".")
    )


def push_to_hub(
    rotations_or_directory: RotationSet | str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    commit_message: str = "Upload OSCAR rotations",
    token: str | None = None,
) -> huggingface_hub.CommitInfo:
    """Upload rotations to the hub repo ``repo_id`` (created if needed) and return the commit.

    A :class:`RotationSet` is saved with :func:`save_pretrained` first (save it yourself to add
    metadata); a directory must hold valid rotations (ours or RotationZoo), and only its rotation
    files (and a ``README.md`` model card) are uploaded.
    """
    if isinstance(rotations_or_directory, RotationSet):
        with tempfile.TemporaryDirectory(prefix="oscar-rotations-") as tmp:
            directory = save_pretrained(rotations_or_directory, tmp)
            return _upload(directory, repo_id, private, commit_message, token)
    return _upload(Path(rotations_or_directory), repo_id, private, commit_message, token)


def _upload(directory: Path, repo_id: str, private: bool | None, commit_message: str, token: str | None):
    _load_directory(directory)  # refuse to publish a folder that would not load
    patterns = [TENSORS_FILE, CONFIG_FILE, _OFFICIAL_KEY_PATTERN, _OFFICIAL_VALUE_PATTERN, "README.md"]
    api = huggingface_hub.HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=str(directory), commit_message=commit_message, allow_patterns=patterns
        )
    except OfflineModeIsEnabled as error:
        raise ConnectionError(f"cannot push to {repo_id}: offline mode is on (unset HF_HUB_OFFLINE)") from error
    logger.info("pushed rotations from %s to %s", directory, repo_id)
    return commit


# ---------------------------------------------------------------------------------------------------
# Picking the rotations for a model


def resolve_rotations(
    model: PreTrainedModel | PretrainedConfig,
    rotations: str | Path | RotationSet = _BUNDLED_KEYWORD,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    local_files_only: bool | None = None,
    cache_dir: str | Path | None = None,
    calibration: str | None = None,
    per_head: bool | None = None,
    method: str | OscarConfig = "oscar-int2",
) -> RotationSet:
    """The rotations ``rotations`` names, checked against ``model``.

    Args:
        model: the model (or its config) the rotations are for.
        rotations: ``"default"`` for the set bundled with the package for this model; a local
            directory (ours or RotationZoo layout); or a hub repo id. For the RotationZoo
            (``"Zhongzhu/OSCAR-RotationZoo"``, or a local copy of it) without ``subfolder``, the
            folder ``<Model>/<calibration>`` is derived from the model's name and ``calibration``
            (needed only when the zoo holds several calibrations for the model).
        subfolder, revision, local_files_only, cache_dir: as in :func:`from_pretrained`.
        calibration: RotationZoo calibration tag, e.g. ``"seq20000_prompt83_group128"``.
        per_head: which rotations of a folder to take, as in :func:`from_pretrained`.
        method: the cache method the rotations are for. One with ``shared_rotations``
            (``oscar-int2-paper``) takes a folder's shared rotations (unless ``per_head`` says otherwise)
            and the bundled set made without the clip search; the others the clip-searched one.

    Raises:
        ValueError: no bundled set fits the model, the zoo folder cannot be determined, or the
            rotations' head_dim, KV heads or layers differ from the model's full-attention layers.
    """
    shared = resolve_method(method).shared_rotations
    if shared and per_head is None:
        per_head = False
    config = _model_config(model)
    hub = {"revision": revision, "local_files_only": local_files_only, "cache_dir": cache_dir}
    if isinstance(rotations, RotationSet):
        resolved, source = rotations, "the given RotationSet"
    elif isinstance(rotations, str) and rotations == _BUNDLED_KEYWORD:
        if subfolder is not None or revision is not None or calibration is not None:
            raise ValueError("subfolder, revision and calibration apply to a directory or hub repo, not to 'default'")
        name = _bundled_for(config, searched=not shared)
        resolved, source = from_pretrained(bundled_rotations_dir(name), per_head=per_head), f"the bundled set {name!r}"
    else:
        if subfolder is None:
            subfolder = _zoo_subfolder(config, rotations, calibration, hub)
        elif calibration is not None:
            raise ValueError("pass either subfolder= or calibration=, not both")
        resolved = from_pretrained(rotations, subfolder=subfolder, per_head=per_head, **hub)
        source = f"{rotations}" + (f" (subfolder {subfolder})" if subfolder else "")
    _check_matches(resolved, config, source)
    return resolved


def _model_config(model: PreTrainedModel | PretrainedConfig) -> PretrainedConfig:
    return model.config if isinstance(model, PreTrainedModel) else model


def _model_name(config: PretrainedConfig) -> str:
    return str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "")


def full_attention_layer_ids(config: PreTrainedModel | PretrainedConfig) -> list[int]:
    """Layers whose ``layer_types`` entry is ``full_attention`` (all layers when the config has no ``layer_types``)."""
    text = _model_config(config).get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None)
    if not layer_types:
        return list(range(text.num_hidden_layers))
    return [i for i, kind in enumerate(layer_types) if kind == "full_attention"]


def model_signature(model: PreTrainedModel | PretrainedConfig) -> dict[str, Any]:
    """The architecture facts a bundled rotation set records (``model_signature``) to recognise its model."""
    text = _model_config(model).get_text_config(decoder=True)
    signature = {key: getattr(text, key, None) for key in _SIGNATURE_KEYS}
    signature["head_dim"] = head_dim_of(text)
    return signature


def _check_matches(rotations: RotationSet, config: PretrainedConfig, source: str) -> None:
    """Rotations must have the model's head_dim and cover exactly its full-attention layers."""
    model = _model_name(config) or "this model"
    text = config.get_text_config(decoder=True)
    head_dim = head_dim_of(text)
    if rotations.head_dim != head_dim:
        raise ValueError(
            f"rotations from {source} have head_dim={rotations.head_dim} but {model} has head_dim={head_dim}"
        )
    if rotations.kv_heads not in (None, kv_heads_of(text)):
        raise ValueError(
            f"rotations from {source} hold one R per KV head for {rotations.kv_heads} KV heads but {model} has "
            f"{kv_heads_of(text)} KV heads; they were made for another model"
        )
    expected, present = full_attention_layer_ids(config), _layer_ids(rotations)
    if present != expected:
        missing, extra = sorted(set(expected) - set(present)), sorted(set(present) - set(expected))
        differences = [f"{what} {_format_ids(ids)}" for what, ids in (("missing", missing), ("extra", extra)) if ids]
        raise ValueError(
            f"rotations from {source} cover layers {_format_ids(present)} but the full-attention layers of "
            f"{model} are {_format_ids(expected)} ({', '.join(differences)}); they were made for another model"
        )


def _format_ids(ids: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"[0-3, 7]"``: readable for 36- or 92-layer models."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "[" + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs) + "]"


# --- "default": the sets bundled with the package


def _bundled_sets() -> dict[str, dict[str, Any]]:
    """name -> config.json of every rotation set under ``oscar_hf/assets/rotations/``."""
    if not _BUNDLED_ROOT.is_dir():
        return {}
    return {
        folder.name: load_rotation_config(folder)
        for folder in sorted(_BUNDLED_ROOT.iterdir())
        if (folder / CONFIG_FILE).is_file()
    }


def _bundled_for(config: PretrainedConfig, searched: bool = True) -> str:
    """The bundled set made for this model (with or without the clip search): by name (hub id or folder
    name), else by architecture signature."""
    sets = {n: c for n, c in _bundled_sets().items() if _clip_searched(c) == searched}
    name = _model_name(config)
    by_name = [n for n, c in sets.items() if _same_model(name, c.get("model_id"))]
    if by_name:
        return by_name[0]
    # The default model is loaded from a converted local copy whose path names no hub id.
    signature = model_signature(config)
    by_signature = [n for n, c in sets.items() if _signature_matches(c.get("model_signature"), signature)]
    if len(by_signature) == 1:
        logger.info("using bundled rotations %r: their recorded model signature matches %s", by_signature[0], name)
        return by_signature[0]
    if by_signature:
        raise ValueError(
            f"several bundled rotation sets fit this model's architecture: {by_signature}; pass one explicitly, "
            "e.g. OscarCache.from_zoo(model, oscar_hf.rotations.zoo.bundled_rotations_dir(NAME))"
        )
    raise ValueError(_no_bundled_message(name, signature, sets))


def _clip_searched(config: dict[str, Any]) -> bool:
    """Whether a set's config records per-layer clips from the clip search (else the fixed ratios)."""
    return not isinstance(config.get("clip"), dict)


def _same_model(name: str, model_id: str | None) -> bool:
    if not name or not model_id:
        return False
    return name == model_id or Path(name).name.lower() == model_id.rsplit("/", 1)[-1].lower()


def _signature_matches(recorded: dict[str, Any] | None, signature: dict[str, Any]) -> bool:
    return bool(recorded) and all(signature.get(key) == value for key, value in recorded.items())


def _no_bundled_message(name: str, signature: dict[str, Any], sets: dict[str, dict[str, Any]]) -> str:
    bundled = ", ".join(f"{n} (for {c.get('model_id', '?')})" for n, c in sets.items()) or "none"
    return (
        f"no rotations are bundled for {name or 'this model'} ({signature}); bundled sets: {bundled}. "
        "Calibrate rotations for it (`oscar-hf calibrate`, see `oscar-hf calibrate --help`, or "
        "oscar_hf.rotations.calibration.calibrate(model, batches) and oscar_hf.rotations.zoo.save_pretrained(rotations, DIR)) "
        "and pass the directory, OscarCache.from_zoo(model, DIR); or pass a hub repo id, e.g. "
        f"OscarCache.from_zoo(model, {ROTATION_ZOO!r}) for the models of the official RotationZoo."
    )


# --- the RotationZoo layout <Model>/<calibration>/


def _zoo_subfolder(
    config: PretrainedConfig, rotations: str | Path, calibration: str | None, hub: dict[str, Any]
) -> str | None:
    """``<Model>/<calibration>`` when ``rotations`` is a RotationZoo root, else None (the files sit at its top)."""
    if not _is_zoo_root(rotations):
        if calibration is not None:
            raise ValueError(
                f"calibration= picks a folder of the RotationZoo layout <Model>/<calibration>/, but {rotations} "
                "is not a RotationZoo root; pass subfolder= instead"
            )
        return None
    model_folder = Path(_model_name(config).rstrip("/")).name
    if not model_folder:
        raise ValueError(
            f"cannot tell which model folder of {rotations} to use: the model's config has no name_or_path; "
            "pass subfolder='<Model>/<calibration>'"
        )
    if calibration is not None:
        return f"{model_folder}/{calibration}"
    root = _zoo_root(rotations, model_folder, hub)
    return _only_calibration(root, model_folder, rotations, hub)


def _is_zoo_root(rotations: str | Path) -> bool:
    if isinstance(rotations, str) and rotations.lower() == ROTATION_ZOO.lower():
        return True
    # A local copy of the zoo: <Model>/<calibration>/ folders of RotationZoo files, none at its top.
    path = Path(rotations).expanduser()
    return path.is_dir() and not _holds_official(path) and bool(_zoo_entries(path))


def _zoo_root(rotations: str | Path, model_folder: str, hub: dict[str, Any]) -> Path:
    """The zoo root holding (at least) every calibration of ``model_folder``; downloads them from the hub."""
    path = Path(rotations).expanduser()
    if path.is_dir():
        return path
    patterns = [f"{model_folder}/*/{_OFFICIAL_KEY_PATTERN}", f"{model_folder}/*/{_OFFICIAL_VALUE_PATTERN}"]
    # A local copy of the zoo root works as well: the same folder is derived from it.
    return _download(str(rotations), patterns, folder=model_folder, local="DIR", **hub)


def _zoo_entries(root: Path) -> list[str]:
    """``<Model>/<calibration>`` of every folder under ``root`` that holds RotationZoo files."""
    if not root.is_dir():
        return []
    return sorted(
        f"{folder.parent.name}/{folder.name}"
        for folder in root.glob("*/*")
        if folder.is_dir() and _holds_official(folder)
    )


def _only_calibration(root: Path, model_folder: str, source: str | Path, hub: dict[str, Any]) -> str:
    entries = _zoo_entries(root)
    mine = [entry for entry in entries if entry.split("/")[0].lower() == model_folder.lower()]
    if len(mine) == 1:
        return mine[0]
    if mine:
        tags = [entry.split("/")[1] for entry in mine]
        raise ValueError(f"{source} has several calibrations for {model_folder}: {tags}; pick one with calibration=...")
    available = entries if Path(source).expanduser().is_dir() else _hub_listing(str(source), hub)
    listing = available if available is not None else "(could not list the hub repo; offline?)"
    raise ValueError(
        f"{source} has no rotations for {model_folder!r} (the last part of the model's name_or_path). "
        f"Available: {listing}. Pass subfolder='<Model>/<calibration>' to pick a folder, or calibrate your own "
        "rotations (`oscar-hf calibrate`)."
    )


def _hub_listing(repo_id: str, hub: dict[str, Any]) -> list[str] | None:
    """``<Model>/<calibration>`` folders of a hub repo, or None when it cannot be listed (offline)."""
    if _hub_offline(hub["local_files_only"]):
        return None
    try:
        files = huggingface_hub.HfApi().list_repo_files(repo_id, revision=hub["revision"])
    except Exception as error:  # only feeds an error message; its own failure must not hide that error
        logger.info("could not list %s: %s", repo_id, error)
        return None
    pattern = re.compile(r"([^/]+/[^/]+)/[kv]_rotation_[^/]*\.pt")
    return sorted({match.group(1) for f in files if (match := pattern.fullmatch(f))})
