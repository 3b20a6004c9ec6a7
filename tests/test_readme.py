"""The README states exactly two set-up commands, and CI runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup_commands() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^(pip install torch==\S+ && .+)$", readme, flags=re.MULTILINE)


def test_readme_has_exactly_two_setup_commands():
    commands = setup_commands()
    assert len(commands) == 2
    assert commands[0].endswith("oscar-hf demo") and "pytest" in commands[1]


def test_ci_runs_both_readme_commands_verbatim():
    """The test command as a line of its own; the demo command inside the fresh environment's subshell."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    demo, tests = setup_commands()
    assert tests in ci.splitlines()
    assert f"&&\n      {demo})" in ci and 'python -m venv "$user_env/venv"' in ci
