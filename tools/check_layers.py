"""Enforce the package layering of the gem workspace in every package's ``src/``, ``tests/``, ``benchmarks/``.

The rules, per package (its ``pyproject.toml`` says what it declares):

- ``src/``: every import is the standard library, the package itself, or a distribution the package declares
  (``dependencies`` or any ``optional-dependencies`` extra).
- ``benchmarks/``: the same, plus the benchmarks folder's own modules (a benchmark script imports a sibling
  ``.py`` file as a top-level module, since the script's folder is on ``sys.path``).
- ``tests/``: the same as ``src/``, plus the test tools (:data:`TEST_TOOLS`) and the package's own test and
  benchmark modules (``tests/*.py`` helpers, and a benchmark module whose formulas a test checks). A test
  never imports another workspace package it does not declare, so a package's tests run after
  ``pip install`` of that package alone plus the test tools (``tools/check_install.py`` runs a few so).

The test tools are the distributions of the root ``pyproject.toml``'s ``dev`` group that a test may import:
the test runner and its plug-ins, and hypothesis. They must be listed in that group (the checker fails
otherwise), and ``tools/check_install.py`` installs these, with the group's version ranges, next to each
package it tests. The rest of the ``dev`` group is tooling that no test imports (ruff, mypy, stubs) or a
package's optional dependency (scikit-learn, which gem-train declares in its ``gbdt`` extra): a test that
needs it must be in a package that declares it.

And everywhere (src, tests, benchmarks, all packages): no import of another workspace package's private
module or name (a dotted part starting with ``_``, dunders excepted): ``from gem_kernels._checks import x``,
``from gem_kernels import _dispatch``. A package may use its own private names, in its tests too.

Only import statements are read (function-level ones included); relative imports are the package's own. A
test file that calls ``pytest.importorskip("x")`` may import ``x`` without declaring it (the test skips where
``x`` is not installed), unless ``x`` is a workspace package: a test that skips without another gem package
would hide a layering break, so that stays a violation. Likewise, in tests and benchmarks, an import inside
a ``try`` block whose ``except`` catches ``ImportError`` (or ``ModuleNotFoundError``) is optional: a benchmark
that compares against a library gem does not depend on (LightGBM) says how to install it instead. A workspace
package is never optional.

Usage: ``python tools/check_layers.py [ROOT]``; exits 1 and lists the violations if there are any.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

# Distributions whose import name is not the distribution name with "-" turned into "_".
IMPORT_NAMES: dict[str, tuple[str, ...]] = {
    "fbgemm-gpu": ("fbgemm_gpu",),
    "fbgemm-gpu-cpu": ("fbgemm_gpu",),
    "scikit-learn": ("sklearn",),
    "xgboost-cpu": ("xgboost",),
    "pyyaml": ("yaml",),
    "pytest": ("pytest", "_pytest"),
}

# The test tools a package's tests may import (distribution names; each must be in the root `dev` group).
TEST_TOOLS: tuple[str, ...] = ("pytest", "pytest-timeout", "hypothesis")

# The folders of a package that are checked, and which of its local folders each may import modules from.
SCOPES: dict[str, tuple[str, ...]] = {
    "src": (),
    "benchmarks": ("benchmarks",),
    "tests": ("tests", "benchmarks"),
}


@dataclass(frozen=True)
class Violation:
    file: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


def _dist_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def import_names(dist: str) -> tuple[str, ...]:
    """The top-level import names of distribution ``dist``."""
    return IMPORT_NAMES.get(dist, (dist.replace("-", "_"),))


def declared_imports(pyproject: Path) -> tuple[str, set[str]]:
    """The package's own import name and the import names it may use."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    allowed: set[str] = set()
    for req in reqs:
        allowed.update(import_names(_dist_name(req)))
    return project["name"].replace("-", "_"), allowed


def required_test_tools(root: Path) -> list[str]:
    """The root ``dev`` group's requirement strings of :data:`TEST_TOOLS` (e.g. ``pytest>=8.3``).

    Raises:
        ValueError: a test tool is not in the root ``dev`` group.
    """
    groups = tomllib.loads((root / "pyproject.toml").read_text()).get("dependency-groups", {})
    by_name = {_dist_name(r): r for r in groups.get("dev", []) if isinstance(r, str)}
    missing = [t for t in TEST_TOOLS if t not in by_name]
    if missing:
        raise ValueError(f"test tools {missing} are not in the root pyproject.toml's `dev` group")
    return [by_name[t] for t in TEST_TOOLS]


def local_modules(folder: Path) -> set[str]:
    """Top-level module names a script or test in ``folder`` can import from it: its ``.py`` files and its
    sub-folders."""
    if not folder.is_dir():
        return set()
    return {p.stem for p in folder.glob("*.py")} | {
        p.name for p in folder.iterdir() if p.is_dir() and p.name.isidentifier()
    }


def _import_statements(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """Each absolute import statement as (line, the dotted names it binds or reads)."""
    out: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, [a.name]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, [node.module] + [f"{node.module}.{a.name}" for a in node.names]))
    return out


def _optional_imports(tree: ast.AST) -> set[str]:
    """Top-level names a file passes to ``importorskip`` as a literal string."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        arg = node.args[0]
        if name == "importorskip" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            out.add(arg.value.split(".")[0])
    return out


def _guarded_imports(tree: ast.AST) -> set[str]:
    """Top-level names imported inside a ``try`` whose handlers catch
    ``ImportError``/``ModuleNotFoundError``."""
    out: set[str] = set()
    catches = {"ImportError", "ModuleNotFoundError"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for h in node.handlers:
            types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
            caught |= {t.id for t in types if isinstance(t, ast.Name)}
        if not caught & catches:
            continue
        for stmt in node.body:
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Import):
                    out |= {a.name.split(".")[0] for a in sub.names}
                elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                    out.add(sub.module.split(".")[0])
    return out


def _statement_violation(own: str, allowed: set[str], workspace: set[str], names: list[str]) -> str | None:
    top = names[0].split(".")[0]
    if top == own or top in sys.stdlib_module_names or top == "__future__":
        return None
    if top not in allowed:
        return f"{own} imports {top!r}, which it does not declare"
    if top in workspace:
        for name in names:
            if any(p.startswith("_") and not p.endswith("__") for p in name.split(".")[1:]):
                return f"{own} reaches into a private module: {name}"
    return None


def check_package(pkg_dir: Path, workspace_packages: set[str], test_tools: set[str]) -> list[Violation]:
    """The violations in ``pkg_dir``'s ``src/``, ``tests/`` and ``benchmarks/`` (see the module docstring).

    ``test_tools``: the import names of :data:`TEST_TOOLS`, allowed in ``tests/`` only.
    """
    own, declared = declared_imports(pkg_dir / "pyproject.toml")
    violations: list[Violation] = []
    for scope, local_folders in SCOPES.items():
        allowed = set(declared)
        for folder in local_folders:
            allowed |= local_modules(pkg_dir / folder) - workspace_packages
        if scope == "tests":
            allowed |= test_tools
        for py in sorted((pkg_dir / scope).rglob("*.py")):
            tree = ast.parse(py.read_text(), filename=str(py))
            optional = _optional_imports(tree) if scope == "tests" else set()
            if scope != "src":
                optional |= _guarded_imports(tree)
            optional -= workspace_packages
            for line, names in _import_statements(tree):
                message = _statement_violation(own, allowed | optional, workspace_packages, names)
                if message:
                    violations.append(Violation(py, line, message))
    return violations


def check_workspace(root: Path) -> list[Violation]:
    pkg_dirs = sorted(p.parent for p in (root / "packages").glob("*/pyproject.toml"))
    names = {declared_imports(p / "pyproject.toml")[0] for p in pkg_dirs}
    test_tool_reqs = required_test_tools(root)
    tools = {name for req in test_tool_reqs for name in import_names(_dist_name(req))}
    out: list[Violation] = []
    for p in pkg_dirs:
        out += check_package(p, names, tools)
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    violations = check_workspace(root)
    for v in violations:
        print(v)
    print(f"layering: {len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
