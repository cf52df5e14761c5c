"""The import graph of the gpumempool package: no cycles, lazy or not, and
no module importing another module's private names, or reaching them as
attributes of a module it imported (``from . import _errors`` then
``_errors._lock = ...``).

Every import statement counts, wherever it is: at the top of a module,
inside a function (a lazy import), or under ``if TYPE_CHECKING:``. A lazy
import hides a cycle from the interpreter, not from the reader: the modules
still depend on each other. Subscribing (gpumempool._lifecycle) is how a
lower module hears from a higher one.

Read from the source tree with ast; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gpumempool"
SOURCE = ROOT / PACKAGE
#: Modules generated at build time (gopy's wrappers and extension): not
#: part of the source tree, and nothing they import is ours to judge.
GENERATED = (f"{PACKAGE}._core",)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    found: dict[str, Path] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if not name.startswith(GENERATED):
            found[name] = path
    return found


def is_module(name: str, known: dict[str, Path]) -> bool:
    """Whether a dotted name is a module of the package: a .py file, or an
    extension module the source tree declares with a stub (.pyi)."""
    if name in known or name.startswith(GENERATED):
        return True
    return (ROOT / Path(*name.split("."))).with_suffix(".pyi").is_file()


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name of the module an ``from X import ...`` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(known: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """The package's import edges (module -> modules of the package it
    imports), and the uses of another module's private names: imported by
    name, or read or set as an attribute of a module imported whole."""
    graph: dict[str, set[str]] = {name: set() for name in known}
    private: list[str] = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        bound: dict[str, str] = {}  # local name -> package module it stands for
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = resolve(name, is_package, node)
                if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if is_module(sub, known):
                        targets.append(sub)  # `from . import torch`: the submodule
                        bound[alias.asname or alias.name] = sub
                        continue
                    targets.append(source)
                    dunder = alias.name.startswith("__") and alias.name.endswith("__")
                    if alias.name.startswith("_") and not dunder and source != name:
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        private.append(f"{where}: from {source} import {alias.name}")
            for target in targets:
                if target.startswith(GENERATED):
                    continue
                if target in known and target != name:
                    graph[name].add(target)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                attr, module = node.attr, bound[node.value.id]
                dunder = attr.startswith("__") and attr.endswith("__")
                if attr.startswith("_") and not dunder and module != name and not module.startswith(GENERATED):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{attr}")
    return graph, private


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One cycle of the graph as a path (first node repeated at the end), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color[nxt] == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = BLACK
        return None

    for start in sorted(graph):
        if color[start] == WHITE:
            found = visit(start)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph, _ = imports(modules())
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_imports_another_module_s_private_names() -> None:
    _, private = imports(modules())
    assert private == [], "\n".join(private)


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above would pass vacuously if the walk missed imports
    inside functions or under TYPE_CHECKING: a made-up package with such a
    cycle and such a private import must be caught."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import _hidden\n    from . import b as bb\n    bb._hidden = 2\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import c\n_hidden = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom ..b import __doc__\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SOURCE", pkg)
    graph, private = imports(modules())
    assert graph[f"{PACKAGE}.sub.c"] == {f"{PACKAGE}.a", f"{PACKAGE}.b"}
    assert find_cycle(graph) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.sub.c", f"{PACKAGE}.a"]
    assert private == [f"{PACKAGE}/a.py:2: from {PACKAGE}.b import _hidden", f"{PACKAGE}/a.py:4: bb._hidden"]


#: The layers of gpumempool.trace, lowest first: a module imports only
#: modules of lower layers (of the package's own modules; what is outside
#: gpumempool.trace is judged by the tests above).
TRACE_LAYERS = (
    ("_format",),
    ("_reader",),
    ("_trace",),
    ("_policy", "_pressure"),
    ("_importer",),
    ("_recorder",),
    ("",),  # the package's __init__: every public name
)


def test_the_trace_package_imports_downward_only() -> None:
    graph, _ = imports(modules())
    prefix = f"{PACKAGE}.trace"
    layer = {f"{prefix}.{m}" if m else prefix: i for i, names in enumerate(TRACE_LAYERS) for m in names}
    found = {name for name in graph if name == prefix or name.startswith(prefix + ".")}
    assert found == set(layer), "a module of gpumempool.trace missing from TRACE_LAYERS (or gone)"
    upward = [f"{name} -> {dep}" for name in sorted(found) for dep in sorted(graph[name])
              if dep in layer and layer[dep] >= layer[name]]
    assert upward == [], "imports that do not go down the layers of gpumempool.trace:\n" + "\n".join(upward)
