"""Rotations from a local directory (ours or the official layout) or the Hugging Face hub, and back to it.

:func:`load_rotations` and :func:`push_rotations_to_hub` follow the Hugging Face conventions.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import (
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from oscar_hf._version import __version__
from oscar_hf.log import get_logger
from oscar_hf.rotations.files import CONFIG_FILE, TENSORS_FILE, load_ours, save_rotations
from oscar_hf.rotations.official import (
    OFFICIAL_KEY_FILE,
    OFFICIAL_KEY_PATTERN,
    OFFICIAL_VALUE_FILE,
    OFFICIAL_VALUE_PATTERN,
    holds_official,
    load_official,
)
from oscar_hf.rotations.rotation_set import RotationSet

logger = get_logger(__name__)


class RotationsNotFoundError(FileNotFoundError):
    """Rotations could not be found locally and could not be fetched from the Hugging Face hub."""


def load_rotations(
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
    snapshot = download(
        repo_id,
        patterns,
        folder=folder,
        local=f"DIR/{folder}" if folder else "DIR",
        revision=revision,
        local_files_only=local_files_only,
        cache_dir=cache_dir,
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
        return load_ours(directory, per_head)
    if holds_official(directory):
        return load_official(directory, per_head)
    found = sorted(p.name for p in directory.iterdir())[:12]
    raise FileNotFoundError(
        f"{directory} holds no rotations: expected {TENSORS_FILE} + {CONFIG_FILE} (oscar-hf) or "
        f"{OFFICIAL_KEY_FILE} + {OFFICIAL_VALUE_FILE} (RotationZoo); it holds {found or 'nothing'}"
    )


def _hub_patterns(subfolder: str | None) -> list[str]:
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    names = (TENSORS_FILE, CONFIG_FILE, OFFICIAL_KEY_PATTERN, OFFICIAL_VALUE_PATTERN)
    return [prefix + name for name in names]


def hub_offline(local_files_only: bool | None) -> bool:
    """Explicit ``local_files_only``, else ``HF_HUB_OFFLINE`` as set now (huggingface_hub reads it only at import)."""
    if local_files_only is not None:
        return bool(local_files_only)
    from_env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return from_env or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def download(
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
    offline = hub_offline(local_files_only)
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=patterns,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            library_name="oscar-hf",
            library_version=__version__,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        reason = (
            "offline mode is on (HF_HUB_OFFLINE=1 or local_files_only=True)"
            if offline
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
        f"oscar_hf.rotations.hub.load_rotations({local!r})"
        + ("; or unset HF_HUB_OFFLINE." if "offline" in reason else ".")
    )


def push_rotations_to_hub(
    rotations_or_directory: RotationSet | str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    commit_message: str = "Upload OSCAR rotations",
    token: str | None = None,
) -> huggingface_hub.CommitInfo:
    """Upload rotations to the hub repo ``repo_id`` (created if needed) and return the commit.

    A :class:`RotationSet` is saved with :func:`save_rotations` first (save it yourself to add
    metadata); a directory must hold valid rotations (ours or RotationZoo), and only its rotation
    files (and a ``README.md`` model card) are uploaded.
    """
    if isinstance(rotations_or_directory, RotationSet):
        with tempfile.TemporaryDirectory(prefix="oscar-rotations-") as tmp:
            directory = save_rotations(rotations_or_directory, tmp)
            return _upload(directory, repo_id, private, commit_message, token)
    return _upload(Path(rotations_or_directory), repo_id, private, commit_message, token)


def _upload(directory: Path, repo_id: str, private: bool | None, commit_message: str, token: str | None):
    _load_directory(directory)  # refuse to publish a folder that would not load
    patterns = [TENSORS_FILE, CONFIG_FILE, OFFICIAL_KEY_PATTERN, OFFICIAL_VALUE_PATTERN, "README.md"]
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
