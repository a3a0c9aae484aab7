"""The layering check passes on the workspace and fails on deliberate violations."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
check_layers = importlib.util.module_from_spec(_spec)
sys.modules["check_layers"] = check_layers
_spec.loader.exec_module(check_layers)


def _copy_workspace(tmp_path: Path) -> Path:
    dst = tmp_path / "ws"
    for pkg in (ROOT / "packages").glob("*/pyproject.toml"):
        target = dst / "packages" / pkg.parent.name
        shutil.copytree(pkg.parent / "src", target / "src")
        shutil.copy(pkg, target / "pyproject.toml")
    return dst


def test_workspace_respects_layering():
    violations = check_layers.check_workspace(ROOT)
    assert violations == [], "\n".join(map(str, violations))


def test_undeclared_workspace_import_is_caught(tmp_path):
    ws = _copy_workspace(tmp_path)
    bad = ws / "packages" / "gem-kernels" / "src" / "gem_kernels" / "bad.py"
    bad.write_text("import gem_model\n")
    violations = check_layers.check_workspace(ws)
    assert [v.message for v in violations] == ["gem_kernels imports 'gem_model', which it does not declare"]


def test_undeclared_third_party_import_is_caught(tmp_path):
    ws = _copy_workspace(tmp_path)
    bad = ws / "packages" / "gem-precision" / "src" / "gem_precision" / "bad.py"
    bad.write_text("from torchrec import KeyedJaggedTensor\n")
    violations = check_layers.check_workspace(ws)
    assert len(violations) == 1 and "'torchrec'" in violations[0].message


def test_private_module_reach_is_caught(tmp_path):
    ws = _copy_workspace(tmp_path)
    bad = ws / "packages" / "gem-model" / "src" / "gem_model" / "bad.py"
    bad.write_text("from gem_kernels._checks import check_values\nfrom gem_kernels import _dispatch\n")
    violations = check_layers.check_workspace(ws)
    assert len(violations) == 2
    assert all("private module" in v.message for v in violations)


def test_declared_import_is_allowed(tmp_path):
    ws = _copy_workspace(tmp_path)
    ok = ws / "packages" / "gem-model" / "src" / "gem_model" / "ok.py"
    ok.write_text("import torch\nimport gem_kernels\nfrom torchrec import KeyedJaggedTensor\nimport json\n")
    assert check_layers.check_workspace(ws) == []


def test_cli_exit_code(tmp_path):
    ws = _copy_workspace(tmp_path)
    (ws / "packages" / "gem-kernels" / "src" / "gem_kernels" / "bad.py").write_text("import gem_train\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_layers.py"), str(ws)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert "1 violation" in proc.stdout
