"""The one layout of gem-kernels and gem-precision (gem issue 19), checked on their sources with ``ast``.

- No module imports another module's ``_private`` name (``from m import _x``) or reaches for one through a
  module object (``m._x``): helpers shared between modules are public inside the package.
- The import graph of each package (function-level imports included, ``if TYPE_CHECKING:`` blocks not) has
  no cycle; in particular ``mx_tensor`` / ``mx`` and the MX Triton kernels no longer import each other.
- The PyTorch paths (``torch_ops``) never import the Triton kernels, and the kernels never import the public
  faces that dispatch to them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "gem_kernels": ROOT / "packages" / "gem-kernels" / "src" / "gem_kernels",
    "gem_precision": ROOT / "packages" / "gem-precision" / "src" / "gem_precision",
}
FACES = {
    "gem_kernels": {"attention", "block", "jagged", "rotary"},
    "gem_precision": {"mx", "rowwise", "linear", "activations", "convert"},
}


def _modules(pkg: str) -> dict[str, ast.Module]:
    """Dotted module name -> parsed source, for every module of ``pkg``."""
    out = {}
    for py in sorted(PACKAGES[pkg].rglob("*.py")):
        rel = py.relative_to(PACKAGES[pkg].parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = ast.parse(py.read_text(), filename=str(py))
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (at module level or in a function), none under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    """The modules of the package that ``node`` imports: ``from p import m`` names module ``p.m``, and ``p``
    itself only when it binds a name defined in ``p`` (a submodule importing its siblings through their
    package, ``from gem_kernels.attention import cpu``, does not depend on the package's face)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    base = node.module or ""
    subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
    own_names = len(subs) < len(node.names)
    return ({base} if base in modules and own_names else set()) | subs


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_no_private_name_crosses_modules(pkg):
    mods = _modules(pkg)
    bad = []
    for name, tree in mods.items():
        aliases = {}  # local name -> package module it is bound to
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == pkg:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in mods:
                        aliases[a.asname or a.name] = full
                    elif _private(a.name):
                        bad.append(f"{name}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
            ):
                bad.append(f"{name}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert bad == [], "\n".join(bad)


def _graph(pkg: str) -> dict[str, set[str]]:
    mods = _modules(pkg)
    names = set(mods) - {pkg}  # every module imports the package itself first; that edge is no cycle
    return {m: set().union(*[_targets(n, names) for n in _imports(t)]) - {m} for m, t in mods.items()}


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_import_graph_has_no_cycle(pkg):
    graph = _graph(pkg)
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n] if n in path else [m, n]
            if n not in state and (c := cycle_from(n, [*path, n])):
                return c
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            assert cycle_from(m, [m]) is None


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_torch_ops_and_kernels_stay_apart(pkg):
    graph = _graph(pkg)
    faces = {f"{pkg}.{f}" for f in FACES[pkg]}
    for m, deps in graph.items():
        if m.startswith(f"{pkg}.torch_ops"):
            assert not {d for d in deps if d.startswith(f"{pkg}.triton_kernels")}, m
        if m.startswith(f"{pkg}.triton_kernels"):
            assert not deps & faces, m


def test_checks_can_fail():
    """The checks above see a private import, a cycle and a TYPE_CHECKING-only import for what they are."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import b\nfrom c import _d\n"
    )
    got = [n.module for n in _imports(tree)]
    assert got == ["typing", "c"]
    assert _private("_d") and not _private("__all__")
