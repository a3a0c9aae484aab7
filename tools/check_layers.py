"""Enforce the package layering of the gem workspace.

Every import in ``packages/*/src`` must be the standard library, the package itself, or a distribution
the package declares in its ``pyproject.toml`` (dependencies or extras). And no package may import a
private module (a name starting with ``_``) of another package.

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


def declared_imports(pyproject: Path) -> tuple[str, set[str]]:
    """The package's own import name and the import names it may use."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    allowed: set[str] = set()
    for req in reqs:
        dist = _dist_name(req)
        allowed.update(IMPORT_NAMES.get(dist, (dist.replace("-", "_"),)))
    return project["name"].replace("-", "_"), allowed


def _import_statements(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """Each absolute import statement as (line, the dotted names it binds or reads)."""
    out: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, [a.name]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, [node.module] + [f"{node.module}.{a.name}" for a in node.names]))
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


def check_package(pkg_dir: Path, workspace_packages: set[str]) -> list[Violation]:
    own, allowed = declared_imports(pkg_dir / "pyproject.toml")
    violations: list[Violation] = []
    for py in sorted((pkg_dir / "src").rglob("*.py")):
        tree = ast.parse(py.read_text(), filename=str(py))
        for line, names in _import_statements(tree):
            message = _statement_violation(own, allowed, workspace_packages, names)
            if message:
                violations.append(Violation(py, line, message))
    return violations


def check_workspace(root: Path) -> list[Violation]:
    pkg_dirs = sorted(p.parent for p in (root / "packages").glob("*/pyproject.toml"))
    names = {declared_imports(p / "pyproject.toml")[0] for p in pkg_dirs}
    out: list[Violation] = []
    for p in pkg_dirs:
        out += check_package(p, names)
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
