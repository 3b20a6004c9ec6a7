"""The notebooks run top to bottom on the CPU (nbclient, a real kernel), and are committed without outputs."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def code_cells(path: Path) -> list:
    return [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def test_the_three_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == ["calibration", "quickstart", "results"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    for cell in code_cells(path):
        assert not cell.outputs and cell.execution_count is None, f"{path.name}: clear the outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_uses_only_the_public_api(path):
    # no private names of the library: notebooks show what users can write
    for cell in code_cells(path):
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oscar_hf"):
                assert not any(alias.name.startswith("_") for alias in node.names), ast.unparse(node)
                assert not any(part.startswith("_") for part in node.module.split(".")), node.module


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path, monkeypatch):
    # The kernel inherits this process's environment: a session started with TRITON_INTERPRET=1 would
    # run every kernel of the real model in Triton's (slow) interpreter.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError with the failing cell and its traceback
    print(f"{path.name}: {time.perf_counter() - started:.1f} s")
    images = [
        o
        for cell in notebook.cells
        if cell.cell_type == "code"
        for o in cell.outputs
        if "image/png" in o.get("data", {})
    ]
    assert images, f"{path.name} drew no plot"
