"""One provenance record for every result the project writes: the command, the machine and the date.

Result files (``oscar-hf eval``, calibration summaries, the benchmarks under ``eval/``) all carry
``{"command": ..., "machine": machine_info(), "date": utc_date()}`` and print it with
:func:`provenance_line`, so runs from different tools compare at a glance.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

DATA_DIR_ENV = "OSCAR_HF_DATA_DIR"  # the local data folder, as results name it


def machine_info() -> dict[str, Any]:
    """Host, GPU, CPU count, threads and library versions of this process."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
    }


def utc_date() -> str:
    """Now in UTC, as every result file records its date."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def portable_path(path: str | Path) -> str:
    """``path`` as a result records it, naming nothing of the machine it ran on: relative to the data folder
    (``$OSCAR_HF_DATA_DIR/...``) or to the working directory when inside one, else its name alone. A path
    given relative and inside the working directory stays as written."""
    text = str(path)
    if not text.startswith(("/", "..", "~")):
        return text
    resolved = Path(text).expanduser().resolve()
    data = os.environ.get(DATA_DIR_ENV)
    for base, shown in ((data, f"${DATA_DIR_ENV}"), (os.getcwd(), "")):
        if not base:
            continue
        try:
            inner = resolved.relative_to(Path(base).expanduser().resolve())
        except ValueError:
            continue
        return "/".join(filter(None, [shown, *inner.parts])) or "."
    return resolved.name


def _portable_argument(argument: str) -> str:
    """One command-line argument as a result records it (``--opt=PATH`` included), quoted for a shell."""
    option, equals, value = (
        argument.partition("=") if argument.startswith("--") and "=" in argument else ("", "", argument)
    )
    value = portable_path(value)
    variable = f"${DATA_DIR_ENV}"
    if value.startswith(variable):  # left unquoted, so that the shell expands it
        return f"{option}{equals}{variable}{shlex.quote(value[len(variable) :]) if value != variable else ''}"
    return f"{option}{equals}{shlex.quote(value)}" if equals else shlex.quote(value)


def command_line(program: str | None = None, argv: list[str] | None = None) -> str:
    """The command that produced a result: ``program`` (default ``python -m <module>`` for a module run as a
    script, else ``python <script>``) and its arguments, paths made portable (:func:`portable_path`)."""
    argv = sys.argv[1:] if argv is None else argv
    module = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    program = program or (f"python -m {module}" if module else f"python {Path(sys.argv[0]).as_posix()}")
    return " ".join([program, *(_portable_argument(a) for a in argv)])


def provenance(command: str) -> dict[str, Any]:
    """The record a result file starts with: ``command``, ``machine`` and ``date``."""
    return {"command": command, "machine": machine_info(), "date": utc_date()}


def machine_line(machine: dict[str, Any]) -> str:
    """``machine_info()`` in one line: GPUs (or none), CPUs and library versions."""
    gpu = f"{machine['gpu_count']}x {machine['gpu']}" if machine["gpu"] else "no GPU"
    return (
        f"{gpu}, {machine['cpu_count']} CPUs, torch {machine['torch']}, triton {machine['triton']}, "
        f"transformers {machine['transformers']}"
    )


def provenance_line(record: dict[str, Any]) -> str:
    """A result's provenance in one markdown line: the command, the machine and the date."""
    return f"`{record['command']}` on {machine_line(record['machine'])}, {record['date']}"


def provenance_title(record: dict[str, Any], headline: str, width: int | None = None) -> str:
    """A plot's title: ``headline``, then the result's command (wrapped at ``width`` characters if given),
    then its machine and date."""
    command = textwrap.fill(record["command"], width) if width else record["command"]
    return f"{headline}\n{command}\n{machine_line(record['machine'])}, {record['date']}"
