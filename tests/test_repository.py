"""Nothing of the machine a checkout was made on in what the repository ships: no absolute paths, no
data folder beside the checkout as a default, no citation of notes the repository does not contain.
Result files record their commands with portable paths (the data folder as ``$OSCAR_HF_DATA_DIR``); a test
log keeps the tool's own output, and CI's script names where CI keeps the data."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from oscar_hf.provenance import DATA_DIR_ENV, command_line

ROOT = Path(__file__).resolve().parents[1]
ABSOLUTE = re.compile(r"(?<![\w.$~])/(?:work|root|home|tmp|Users|mnt|opt)/")
OUTSIDE = re.compile(r"\.\./shared\b|oscar-reference\.md|peers\.md")
EXEMPT = ("eval/results/gpu_tests.log", ".ci/run", "tests/test_repository.py")  # this file: the patterns


def leaks(path: str, text: str) -> list[str]:
    """``path:line: text`` of every line that names a machine's path or an outside document."""
    return [
        f"{path}:{number}: {line.strip()[:120]}"
        for number, line in enumerate(text.splitlines(), 1)
        if ABSOLUTE.search(line) or OUTSIDE.search(line)
    ]


def test_tracked_files_name_no_machine_paths_or_outside_notes():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = ROOT / name
        if name.startswith(EXEMPT) or not path.is_file() or path.suffix in {".png", ".pt", ".safetensors", ".gz"}:
            continue
        try:
            found += leaks(name, path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    assert not found, "\n".join(found)


def test_the_check_sees_a_leak():
    machine = "/" + "work/shared/data"  # built here, so that this file names no machine path itself
    assert leaks("a.py", f'DATA = "{machine}"\nnotes = "see oscar-reference.md"\nok = "$HOME/x"') == [
        f'a.py:1: DATA = "{machine}"',
        'a.py:2: notes = "see oscar-reference.md"',
    ]
    assert leaks("b.md", "python -m x --data-dir ../shared/data") and not leaks("c.md", "`oscar_hf/core/cache.py`")


def test_results_record_commands_without_machine_paths(tmp_path, monkeypatch):
    """A result's command names the data folder by its variable and nothing else of the machine it ran on."""
    data, work = tmp_path / "data", tmp_path / "work"
    data.mkdir(), work.mkdir()
    monkeypatch.setenv(DATA_DIR_ENV, str(data))
    monkeypatch.chdir(work)
    argv = ["--data-dir", str(data), "--text", str(data / "w" / "t.raw"), "--out", str(tmp_path / "runs" / "r1")]
    argv += [f"--config={work / '.cfg' / 'c.json'}", "--set", 'models=["a b"]', "eval/configs/x.json", "../work/y"]
    command = command_line("prog", argv)
    assert command == (
        "prog --data-dir $OSCAR_HF_DATA_DIR --text $OSCAR_HF_DATA_DIR/w/t.raw --out r1 --config=.cfg/c.json "
        "--set 'models=[\"a b\"]' eval/configs/x.json y"
    )
    assert not leaks("result.md", command) and leaks("result.md", " ".join(argv))


def test_every_package_of_the_library_is_installed():
    """A wheel holds only the packages pyproject.toml lists: a new subpackage left out would install a
    library that fails at import."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "oscar_hf").rglob("__init__.py")}
    assert found | {"oscar_hf.kernels"} == listed


IMPORT_PATH_EDIT = re.compile(r"\bsys\.path\s*(?:\.\s*(?:insert|append|extend)\b|\+?=)")


def test_no_python_file_edits_the_import_path():
    """Scripts run as modules of an installed package (``python -m eval.bench_gpu``), tools import the
    installed package: nothing puts folders on the import path by hand."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    found = [
        f"{name}:{number}"
        for name in files.split()
        if (ROOT / name).is_file()
        for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1)
        if IMPORT_PATH_EDIT.search(line) and name != "tests/test_repository.py"
    ]
    assert not found, found
    assert IMPORT_PATH_EDIT.search("sys" + ".path.insert(0, here)") and IMPORT_PATH_EDIT.search("sys" + ".path += [x]")


def test_the_repository_tracks_no_symbolic_links():
    """A symbolic link checks out as a plain text file where links are off (Windows' default)."""
    entries = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert not [line for line in entries.splitlines() if line.startswith("120000 ")]


def test_the_kernels_import_from_the_top_level_folder():
    """In a checkout and an editable install ``oscar_hf.kernels`` is the top-level ``kernels/`` folder (a wheel
    copies that folder in, as pyproject.toml's package-dir says)."""
    import tomllib

    import oscar_hf.kernels.decode_attention as module

    assert Path(module.__file__).resolve().parent == ROOT / "kernels"
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert package_dir == {"oscar_hf.kernels": "kernels"}
