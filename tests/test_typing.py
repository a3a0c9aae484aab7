"""Typing rules mypy cannot state (mypy itself runs in CI: `uv run mypy`, config in pyproject.toml).

gem-kernels and gem-precision are checked with mypy's strict flags, except that the modules holding Triton
kernels may have unannotated functions: a kernel's parameters are Triton values and Triton's JIT reads
their annotations. This test keeps that exemption to the kernels: every other function there, launch
wrappers included, is fully annotated.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STRICT = [ROOT / "packages" / "gem-kernels" / "src", ROOT / "packages" / "gem-precision" / "src"]


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    return any("triton" in ast.unparse(d) and "jit" in ast.unparse(d) for d in fn.decorator_list)


def unannotated(source: str) -> list[str]:
    """``name (line)`` of each function (not a Triton kernel) with an unannotated parameter or return."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_triton_kernel(node):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]
        params = [p for p in params if p.arg not in ("self", "cls")]
        # As mypy: an __init__ with annotated parameters needs no "-> None".
        no_return = node.returns is None and not (node.name == "__init__" and params)
        if no_return or any(p.annotation is None for p in params):
            out.append(f"{node.name} (line {node.lineno})")
    return out


def test_the_rule_sees_a_missing_annotation_and_spares_kernels():
    src = (
        "@triton.jit\ndef kernel(X, N: tl.constexpr):\n    pass\n"
        "def launch(x) -> None:\n    pass\n"
        "def ok(self, x: int, *a: int, **k: int) -> int:\n    return x\n"
        "def no_return(x: int):\n    pass\n"
    )
    assert unannotated(src) == ["launch (line 4)", "no_return (line 8)"]


@pytest.mark.parametrize("path", sorted(p for d in STRICT for p in d.rglob("*.py")), ids=lambda p: p.name)
def test_every_function_but_a_triton_kernel_is_annotated(path: Path):
    assert unannotated(path.read_text()) == []
