"""Which rotations a model gets: the sets bundled with the package, RotationZoo folders, and the checks
that a set fits the model (:func:`resolve_rotations`, behind ``OscarCache.from_zoo``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import huggingface_hub
from transformers import PretrainedConfig, PreTrainedModel

from oscar_hf.config import OscarConfig, resolve_method
from oscar_hf.log import get_logger
from oscar_hf.model_info import head_dim_of
from oscar_hf.rotations.files import CONFIG_FILE, load_rotation_config
from oscar_hf.rotations.hub import download, hub_offline, load_rotations
from oscar_hf.rotations.official import OFFICIAL_KEY_PATTERN, OFFICIAL_VALUE_PATTERN, holds_official
from oscar_hf.rotations.rotation_set import RotationSet

logger = get_logger(__name__)

DEFAULT_ROTATIONS = "smollm2-135m-instruct"  # clip-searched, centered keys: what oscar-int2 is best with
DEFAULT_PAPER_ROTATIONS = "smollm2-135m-instruct-paper"  # U·H·P, fixed clips: oscar-int2-paper
ROTATION_ZOO = "Zhongzhu/OSCAR-RotationZoo"
ZOO_OPTIONS = frozenset({"subfolder", "revision", "local_files_only", "cache_dir", "calibration", "per_head"})
_BUNDLED_ROOT = Path(__file__).resolve().parents[1] / "assets" / "rotations"
_BUNDLED_KEYWORD = "default"
_SIGNATURE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
)


def bundled_rotations_dir(name: str) -> Path:
    """Directory of the rotations shipped with the package under ``oscar_hf/assets/rotations/<name>/``."""
    return _BUNDLED_ROOT / name


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
        subfolder, revision, local_files_only, cache_dir: as in :func:`load_rotations`.
        calibration: RotationZoo calibration tag, e.g. ``"seq20000_prompt83_group128"``.
        per_head: which rotations of a folder to take, as in :func:`load_rotations`.
        method: the cache method the rotations are for. One with ``shared_rotations``
            (``oscar-int2-paper``) takes a folder's shared rotations (unless ``per_head`` says otherwise)
            and the bundled set made without the clip search; the others a clip-searched one, the set
            whose bit widths were allocated against the method's own widths where one is bundled.

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
        name = _bundled_for(config, resolve_method(method))
        resolved, source = load_rotations(bundled_rotations_dir(name), per_head=per_head), f"the bundled set {name!r}"
    else:
        if subfolder is None:
            subfolder = _zoo_subfolder(config, rotations, calibration, hub)
        elif calibration is not None:
            raise ValueError("pass either subfolder= or calibration=, not both")
        resolved = load_rotations(rotations, subfolder=subfolder, per_head=per_head, **hub)
        source = f"{rotations}" + (f" (subfolder {subfolder})" if subfolder else "")
    resolved.check_fits(config, source=f"rotations from {source}")
    return resolved


def _model_config(model: PreTrainedModel | PretrainedConfig) -> PretrainedConfig:
    return model.config if isinstance(model, PreTrainedModel) else model


def _model_name(config: PretrainedConfig) -> str:
    return str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "")


def model_signature(model: PreTrainedModel | PretrainedConfig) -> dict[str, Any]:
    """The architecture facts a bundled rotation set records (``model_signature``) to recognise its model."""
    text = _model_config(model).get_text_config(decoder=True)
    signature = {key: getattr(text, key, None) for key in _SIGNATURE_KEYS}
    signature["head_dim"] = head_dim_of(text)
    return signature


def _bundled_sets() -> dict[str, dict[str, Any]]:
    """name -> config.json of every rotation set under ``oscar_hf/assets/rotations/``."""
    if not _BUNDLED_ROOT.is_dir():
        return {}
    return {
        folder.name: load_rotation_config(folder)
        for folder in sorted(_BUNDLED_ROOT.iterdir())
        if (folder / CONFIG_FILE).is_file()
    }


def _bundled_for(config: PretrainedConfig, method: OscarConfig) -> str:
    """The bundled set made for this model, by name (hub id or folder name), else by architecture
    signature, and for ``method``'s recipe (:func:`_recipe_set`)."""
    sets, name = _bundled_sets(), _model_name(config)
    by_name = {n: c for n, c in sets.items() if _same_model(name, c.get("model_id"))}
    if by_name:
        return _recipe_set(by_name, method, name)
    # The default model is loaded from a converted local copy whose path names no hub id.
    signature = model_signature(config)
    by_signature = {n: c for n, c in sets.items() if _signature_matches(c.get("model_signature"), signature)}
    if not by_signature:
        raise ValueError(_no_bundled_message(name, signature, sets))
    chosen = _recipe_set(by_signature, method, name)
    logger.info("using bundled rotations %r: their recorded model signature matches %s", chosen, name)
    return chosen


def bundled_set_name(model_id: str, method: str | OscarConfig) -> str:
    """Name of the set bundled for the hub model ``model_id`` that ``method`` takes with ``rotations="default"``."""
    sets = {n: c for n, c in _bundled_sets().items() if _same_model(model_id, c.get("model_id"))}
    if not sets:
        raise ValueError(f"no rotations are bundled for {model_id}")
    return _recipe_set(sets, resolve_method(method), model_id)


def _recipe_set(sets: dict[str, dict[str, Any]], method: OscarConfig, model: str) -> str:
    """Among one model's bundled sets, the one for ``method``: clip-searched unless the method is the
    paper's recipe, and with bit widths allocated against the method's own K/V widths where such a set
    exists, else against 2-bit K and V (per-layer widths a method at other widths ignores)."""
    recipe = {n: c for n, c in sets.items() if _clip_searched(c) != method.shared_rotations}
    for widths in ((method.key.bits, method.value.bits), (2, 2)):
        names = [n for n, c in recipe.items() if _base_bits(c) == widths]
        if len(names) > 1:
            raise ValueError(
                f"several bundled rotation sets fit {model or 'this model'} and {method.method}: {names}; pass one "
                "explicitly, e.g. OscarCache.from_zoo(model, oscar_hf.rotations.resolve.bundled_rotations_dir(NAME))"
            )
        if names:
            return names[0]
    kind = "made without the clip search" if method.shared_rotations else "clip-searched"
    raise ValueError(
        f"no {kind} rotations are bundled for {model or 'this model'} (bundled for it: {sorted(sets)}); "
        "calibrate them with `oscar-hf calibrate`"
    )


def _base_bits(config: dict[str, Any]) -> tuple[int, int]:
    """The K/V widths a set's per-layer widths were allocated against (2/2 where it records none)."""
    base = config.get("base_bits") or {"key": 2, "value": 2}
    return base["key"], base["value"]


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
        "oscar_hf.calibrate(model, tokenizer, files).save(DIR)) "
        "and pass the directory, OscarCache.from_zoo(model, DIR); or pass a hub repo id, e.g. "
        f"OscarCache.from_zoo(model, {ROTATION_ZOO!r}) for the models of the official RotationZoo."
    )


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
    return path.is_dir() and not holds_official(path) and bool(_zoo_entries(path))


def _zoo_root(rotations: str | Path, model_folder: str, hub: dict[str, Any]) -> Path:
    """The zoo root holding (at least) every calibration of ``model_folder``; downloads them from the hub."""
    path = Path(rotations).expanduser()
    if path.is_dir():
        return path
    patterns = [f"{model_folder}/*/{OFFICIAL_KEY_PATTERN}", f"{model_folder}/*/{OFFICIAL_VALUE_PATTERN}"]
    # A local copy of the zoo root works as well: the same folder is derived from it.
    return download(str(rotations), patterns, folder=model_folder, local="DIR", **hub)


def _zoo_entries(root: Path) -> list[str]:
    """``<Model>/<calibration>`` of every folder under ``root`` that holds RotationZoo files."""
    if not root.is_dir():
        return []
    return sorted(
        f"{folder.parent.name}/{folder.name}"
        for folder in root.glob("*/*")
        if folder.is_dir() and holds_official(folder)
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
    if hub_offline(hub["local_files_only"]):
        return None
    try:
        files = huggingface_hub.HfApi().list_repo_files(repo_id, revision=hub["revision"])
    except Exception as error:  # only feeds an error message; its own failure must not hide that error
        logger.info("could not list %s: %s", repo_id, error)
        return None
    pattern = re.compile(r"([^/]+/[^/]+)/[kv]_rotation_[^/]*\.pt")
    return sorted({match.group(1) for f in files if (match := pattern.fullmatch(f))})
