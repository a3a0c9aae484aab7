"""Each package's version in pyproject.toml matches its __version__."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_version_matches(pkg: Path):
    project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
    module = importlib.import_module(project["name"].replace("-", "_"))
    assert module.__version__ == project["version"]
    assert (pkg / "CHANGELOG.md").exists() and (pkg / "README.md").read_text().strip()
