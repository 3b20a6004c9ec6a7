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
import time
from pathlib import Path
from typing import Any

import torch


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


def command_line(program: str | None = None, argv: list[str] | None = None) -> str:
    """The command that produced a result: ``program`` (default ``python -m <module>`` for a module run as a
    script, else ``python <script>``) and its arguments."""
    argv = sys.argv[1:] if argv is None else argv
    module = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    program = program or (f"python -m {module}" if module else f"python {Path(sys.argv[0]).as_posix()}")
    return " ".join([program, *(shlex.quote(a) for a in argv)])


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
