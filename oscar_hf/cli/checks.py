"""Checks of ``oscar-hf`` input that need no model: argparse types, input files and output paths.

Each failure is one line. The argparse types raise :class:`argparse.ArgumentTypeError` (a usage error,
exit status 2); the other checks raise :class:`ValueError`, which ``main`` prints as
``oscar-hf <command>: <message>`` (exit status 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from oscar_hf.config import METHODS


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts: an integer of at least 1."""
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse ``type`` for sizes where 0 means none."""
    return _integer(text, 0)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def names(text: str) -> list[str]:
    """Comma-separated names (at least one)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"no names in {text!r}: give a comma-separated list")
    return parts


def methods(text: str) -> list[str]:
    """Comma-separated cache methods (at least one, each one of :data:`METHODS`)."""
    chosen = names(text)
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    return chosen


def parsed(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type`` that turns the parser's ValueError into a clean usage error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__
    return convert


def read_text(path: str | Path, option: str) -> str:
    """The UTF-8 text of the file ``option`` names; a ValueError if it is missing, not UTF-8 or empty."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{option} {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{option} {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not text.strip():
        raise ValueError(f"{option} {path} is empty")
    return text


def check_files(paths: Sequence[str | Path], option: str) -> None:
    """Each of ``paths`` exists and holds UTF-8 text."""
    for path in paths:
        read_text(path, option)


def check_output(path: str | Path, option: str, folder: bool = False) -> None:
    """``path`` can be written: no existing file where a folder is needed (``path`` itself when ``folder``,
    its parents always) and, for a file, no folder at ``path``."""
    path = Path(path)
    for parent in [path, *path.parents] if folder else path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{option} {path}: {parent} is a file, not a folder")
    if not folder and path.is_dir():
        raise ValueError(f"{option} {path} is a folder, not a file")


def check_model(name: str) -> None:
    """A ``--model`` written as a path (``/``, ``.`` or ``~`` first) must be a folder: transformers would
    otherwise report it as a malformed hub id."""
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise ValueError(f"--model {name} is not a folder (give a model folder, a hub id or 'default')")


def check_folders(paths: Sequence[str | Path], option: str) -> None:
    for path in paths:
        if not Path(path).is_dir():
            raise ValueError(f"{option} {path} is not a folder")


def check_ctx(ctx: int, chosen: list[str]) -> None:
    """A window must reach past the sink and recent window: only positions after it see quantized keys."""
    first = max(METHODS[m].sink + METHODS[m].recent for m in chosen)
    if ctx < first + 2:
        raise ValueError(
            f"--ctx {ctx} leaves no position after the sink + recent window of {first} tokens: use at least {first + 2}"
        )


def check_tasks(tasks: list[str], task_dirs: list[str], folder: Path | None) -> None:
    """Every task is known and has its data (local files under ``folder``, or an online dataset)."""
    from oscar_hf.evaluation.tasks import available_tasks

    check_folders(task_dirs, "--task-dir")
    specs = available_tasks(task_dirs)
    unknown = [t for t in tasks if t not in specs]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available: {sorted(specs)}")
    for task in tasks:
        specs[task].render(folder)  # raises for missing data files


def data_folder(given: str | None) -> Path | None:
    """``--data-dir`` if given (a ValueError if it is not a folder), else ``$OSCAR_HF_DATA_DIR``, else None."""
    from oscar_hf.evaluation.data import data_dir

    if given:
        check_folders([given], "--data-dir")
        return Path(given)
    return data_dir()
