"""The one layout of gem-kernels and gem-precision (gem issues 19 and 33), checked on their sources (``ast``).

- Every op family is a subpackage with the same shape (generative-recommenders': an op face, a reference,
  a Triton folder or module): ``ops.py`` (checks, custom ops, autograd, dispatch), ``reference.py`` (the
  PyTorch reference: CPU path and test oracle) and ``triton.py`` or ``triton/`` (the kernels and their
  launchers), the face re-exported by the family's ``__init__``.
- No module imports another module's ``_private`` name (``from m import _x``) or reaches for one through a
  module object (``m._x``): helpers shared between modules are public inside the package.
- The import graph of each package (function-level imports included, ``if TYPE_CHECKING:`` blocks not) has
  no cycle; in particular ``MXTensor`` (``mx/tensor.py``), the MX face and the MX kernels do not import each
  other (``MXTensor.dequantize`` goes through ``mx/dequantize.py`` and dispatch).
- The PyTorch paths (``reference``, ``cpu``) never import the Triton kernels, and the kernels never import
  the faces that dispatch to them.
- No source file is over 500 lines.
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
FAMILIES = {
    "gem_kernels": ("attention", "block", "jagged", "rotary", "swiglu"),
    "gem_precision": ("mx", "packed", "rowwise"),
}
# Faces that are not op families: the layer, the activation compression and the model conversion.
OTHER_FACES = {"gem_kernels": set(), "gem_precision": {"linear", "activations", "convert"}}
MAX_LINES = 500


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


def _faces(pkg: str) -> set[str]:
    """Every face module: each family's package and its ``ops`` module, and the other faces."""
    fams = {f"{pkg}.{f}" for f in FAMILIES[pkg]} | {f"{pkg}.{f}.ops" for f in FAMILIES[pkg]}
    return fams | {f"{pkg}.{f}" for f in OTHER_FACES[pkg]}


def _is_triton(module: str) -> bool:
    return "triton" in module.split(".")[1:] or module.endswith("_triton")


def _is_torch_path(module: str) -> bool:
    return module.rsplit(".", 1)[-1] in ("reference", "cpu")


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_every_family_has_a_face_a_reference_and_triton_kernels(pkg):
    for family in FAMILIES[pkg]:
        folder = PACKAGES[pkg] / family
        assert (folder / "__init__.py").is_file() and (folder / "ops.py").is_file(), family
        assert (folder / "reference.py").is_file(), family
        assert (folder / "triton.py").is_file() or (folder / "triton" / "__init__.py").is_file(), family
        init = ast.parse((folder / "__init__.py").read_text())
        reexports = {n.module for n in ast.walk(init) if isinstance(n, ast.ImportFrom)}
        assert f"{pkg}.{family}.ops" in reexports, f"{family}/__init__.py re-exports its face"


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_torch_paths_and_kernels_stay_apart(pkg):
    graph = _graph(pkg)
    faces = _faces(pkg)
    assert any(_is_torch_path(m) for m in graph) and any(_is_triton(m) for m in graph)
    for m, deps in graph.items():
        if _is_torch_path(m):
            assert not {d for d in deps if _is_triton(d)}, m
        if _is_triton(m):
            assert not deps & faces, m


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_no_source_file_over_500_lines(pkg):
    long = {
        str(p.relative_to(PACKAGES[pkg])): n
        for p in PACKAGES[pkg].rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_checks_can_fail():
    """The checks above see a private import, a cycle and a TYPE_CHECKING-only import for what they are."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import b\nfrom c import _d\n"
    )
    got = [n.module for n in _imports(tree)]
    assert got == ["typing", "c"]
    assert _private("_d") and not _private("__all__")
