"""The package's import graph: layers import only downwards, nothing imports in a cycle, and the
library never reaches into eval/ or the kernel-development tools.

Layers, bottom to top: leaf modules (``oscar_hf.quant``, ``oscar_hf.log``, ``oscar_hf.provenance``,
``oscar_hf._version``, ``oscar_hf.config``, ``oscar_hf.model_info``), ``kernels`` (``oscar_hf.kernels``),
``rotations`` (rotation sets, their files, the hub), ``core`` (the cache), ``calibration`` (what fits
rotations with the cache), ``evaluation``, ``cli``. The package ``__init__`` is the public facade above
them all; no module registers anything in another package when imported. Every import counts, including those
inside functions and under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "oscar_hf"
LEAVES = {
    "oscar_hf.quant",
    "oscar_hf.log",
    "oscar_hf.provenance",
    "oscar_hf._version",
    "oscar_hf.config",
    "oscar_hf.model_info",
}
LAYERS = ["leaf", "kernels", "rotations", "core", "calibration", "evaluation", "cli", "facade"]
# Lines a module may have: past the first number a warning, past the second a failure. Kernels run
# longer (a launch's arguments one per line, as the formatter writes them).
SIZE_LIMITS = {"kernels": (600, 800)}
MODULE_LIMITS = (400, 500)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)  # a module under oscar_hf/
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def library_modules() -> dict[str, Path]:
    """Every module of the installed package: oscar_hf/ and the kernels it ships (not kernels/tools)."""
    modules = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}  # rglob skips the kernels link
    # oscar_hf/kernels links to kernels/, whose top level ships; kernels/tools holds development scripts.
    modules.update({f"oscar_hf.kernels.{path.stem}": path for path in sorted((ROOT / "kernels").glob("*.py"))})
    return modules


def layer_of(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    if module == "oscar_hf":
        return "facade"
    return module.split(".")[1]


def imports_of(path: Path, module: str) -> set[str]:
    """Modules ``path`` imports, resolved to absolute names, wherever the import statement sits."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def library_graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {name: {m for m in imports_of(path, name) if m in modules and m != name} for name, path in modules.items()}


def test_layers_import_only_downwards():
    wrong = []
    for module, targets in library_graph().items():
        for target in targets:
            if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(module)):
                wrong.append(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    assert not wrong, "\n".join(wrong)


def test_kernels_import_only_leaf_modules_of_the_package():
    graph = library_graph()
    reached = {t for m, ts in graph.items() if layer_of(m) == "kernels" for t in ts if layer_of(t) != "kernels"}
    assert reached <= LEAVES


def test_there_is_no_import_cycle():
    graph, state, cycles = library_graph(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(library_modules()))
def test_library_modules_stay_small_and_never_import_eval(module: str):
    path = library_modules()[module]
    warn, limit = SIZE_LIMITS.get(layer_of(module), MODULE_LIMITS)
    lines = len(path.read_text().splitlines())
    assert lines <= limit, f"{module} is over {limit} lines: split it by responsibility"
    if lines > warn:
        warnings.warn(f"{module} has {lines} lines, over {warn}: split it by responsibility as it grows")
    assert not any(name == "eval" or name.startswith("eval.") for name in imports_of(path, module))


def import_time_calls_into_other_packages(source: str, module: str) -> list[str]:
    """Statements at a module's top level that call a function imported from another of the package's
    layers for its effect (a registration hook), not for a value."""
    tree = ast.parse(source)
    foreign = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("oscar_hf")
        and layer_of(node.module) != layer_of(module)
        for alias in node.names
    }
    calls = []
    for node in tree.body:
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)) if isinstance(node, ast.Expr) else ():
            root = call.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in foreign:
                calls.append(f"{module}:{call.lineno} calls {root.id} of {foreign[root.id]}")
    return calls


def test_no_module_registers_into_another_package_when_imported():
    found = [c for m, p in library_modules().items() for c in import_time_calls_into_other_packages(p.read_text(), m)]
    assert not found, "\n".join(found)
    hook = "from oscar_hf.core.cache import install_reader\n\ninstall_reader(print)\n"
    assert import_time_calls_into_other_packages(hook, "oscar_hf.rotations.resolve") == [
        "oscar_hf.rotations.resolve:3 calls install_reader of oscar_hf.core.cache"
    ]


def test_the_checker_sees_a_cycle_and_an_upward_import(monkeypatch):
    """The graph checks above must be able to fail: a core module importing the cli is both."""
    graph = library_graph()
    graph["oscar_hf.core.cache"] = graph["oscar_hf.core.cache"] | {"oscar_hf.cli.main"}
    monkeypatch.setattr(sys.modules[__name__], "library_graph", lambda: graph)
    with pytest.raises(AssertionError, match="core.cache"):
        test_layers_import_only_downwards()
    with pytest.raises(AssertionError, match="->"):
        test_there_is_no_import_cycle()


LAYER_MODULES = {"oscar_hf.core.layer", *(f"oscar_hf.core.{p.stem}" for p in (PACKAGE / "core").glob("layer_*.py"))}


def layer_private_names() -> set[str]:
    """The underscore attributes an OscarLayer defines: its methods' and those its code sets on ``self``."""
    from oscar_hf.core.layer import OscarLayer

    names = {
        name
        for cls in OscarLayer.__mro__
        if cls.__module__ in LAYER_MODULES
        for name in vars(cls)
        if name.startswith("_") and not name.startswith("__")
    }
    for module in LAYER_MODULES:
        source = library_modules()[module].read_text()
        names.update(re.findall(r"self\.(_[a-z][a-z_]*)\b", source))
    return names


def private_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every attribute read or write of ``names`` in ``source`` on anything but ``self``."""
    return [
        (node.lineno, node.attr)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]


def test_no_module_outside_the_layer_touches_its_private_state():
    """A layer's private state has one owner, the layer's own modules (layer.py and layer_*.py): the cache,
    the attention adapter, frozen decoding, benchmarks and tools go through its public methods."""
    names = layer_private_names()
    assert {"_pending", "_plan", "_demoted_ahead", "_leave_static"} <= names  # the scan sees the layer's state
    outside = [p for m, p in library_modules().items() if m not in LAYER_MODULES]
    outside += sorted((ROOT / "eval").rglob("*.py")) + sorted((ROOT / "kernels" / "tools").glob("*.py"))
    uses = [
        f"{path.relative_to(ROOT)}:{line} .{name}"
        for path in outside
        for line, name in private_uses(path.read_text(), names)
    ]
    assert not uses, "\n".join(uses)


def test_the_private_state_check_can_fail():
    source = "def peek(layer):\n    return layer._pending\n\nclass Own:\n    def f(self):\n        self._pending = 1\n"
    assert private_uses(source, {"_pending"}) == [(2, "_pending")]
