"""gem-train's benchmark scripts (``benchmarks/*.py``: scripts, not a package), loaded as modules by the
tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """A fresh module of ``benchmarks/<name>.py``, run from its file."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)  # dataclasses look their module up by name while the class is built
    spec.loader.exec_module(mod)
    return mod
