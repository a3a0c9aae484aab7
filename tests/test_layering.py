"""The layering check passes on the workspace and fails on deliberate violations, in every package's src/,
tests/ and benchmarks/."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
check_layers = importlib.util.module_from_spec(_spec)
sys.modules["check_layers"] = check_layers
_spec.loader.exec_module(check_layers)


def _python_only(folder: str, names: list[str]) -> set[str]:
    return {
        n for n in names if n == "__pycache__" or (not n.endswith(".py") and not Path(folder, n).is_dir())
    }


def _copy_workspace(tmp_path: Path) -> Path:
    """The workspace's Python files and pyproject.toml files (root included: its `dev` group)."""
    dst = tmp_path / "ws"
    for pkg in (ROOT / "packages").glob("*/pyproject.toml"):
        target = dst / "packages" / pkg.parent.name
        for folder in ("src", "tests", "benchmarks"):
            if (pkg.parent / folder).is_dir():
                shutil.copytree(pkg.parent / folder, target / folder, ignore=_python_only)
        shutil.copy(pkg, target / "pyproject.toml")
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def _write(ws: Path, rel: str, text: str) -> Path:
    path = ws / "packages" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


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


def test_undeclared_workspace_import_in_tests_is_caught(tmp_path):
    ws = _copy_workspace(tmp_path)
    bad = _write(
        ws, "gem-parallel/tests/test_bad.py", "import pytest\n\n\ndef test_x():\n    import gem_model\n"
    )
    violations = check_layers.check_workspace(ws)
    assert [(v.file, v.line, v.message) for v in violations] == [
        (bad, 5, "gem_parallel imports 'gem_model', which it does not declare")
    ]


def test_undeclared_import_in_benchmarks_is_caught(tmp_path):
    ws = _copy_workspace(tmp_path)
    bad = _write(
        ws, "gem-precision/benchmarks/bench_bad.py", "import torch\nfrom torchrec import KeyedJaggedTensor\n"
    )
    violations = check_layers.check_workspace(ws)
    assert [(v.file, v.line) for v in violations] == [(bad, 2)]
    assert "'torchrec'" in violations[0].message


def test_private_reach_is_caught_in_tests_and_benchmarks(tmp_path):
    ws = _copy_workspace(tmp_path)
    # gem-train declares every other package, so only the private rule can catch these.
    _write(
        ws,
        "gem-train/tests/test_bad.py",
        "from gem_model._stack import x\nfrom gem_kernels import _dispatch\n",
    )
    _write(ws, "gem-train/benchmarks/bench_bad.py", "from gem_parallel.comm_bytes import _nbytes\n")
    # A package's own private names are its own business, in its tests too.
    _write(ws, "gem-parallel/tests/test_own.py", "from gem_parallel.comm_bytes import _nbytes\n")
    violations = check_layers.check_workspace(ws)
    assert sorted((v.file.name, v.line) for v in violations) == [
        ("bench_bad.py", 1),
        ("test_bad.py", 1),
        ("test_bad.py", 2),
    ]
    assert all("private module" in v.message for v in violations)


def test_tests_may_use_test_tools_and_their_own_helpers_benchmarks_may_not(tmp_path):
    ws = _copy_workspace(tmp_path)
    _write(ws, "gem-kernels/tests/my_helpers.py", "import torch\n")
    _write(ws, "gem-kernels/benchmarks/my_bench_model.py", "import torch\n")
    ok = "import hypothesis\nimport pytest\nimport my_helpers\nimport my_bench_model\n"
    _write(ws, "gem-kernels/tests/test_ok.py", ok)
    _write(ws, "gem-kernels/benchmarks/bench_ok.py", "import my_bench_model\nimport gem_kernels\n")
    assert check_layers.check_workspace(ws) == []
    # A benchmark imports neither the test tools nor the tests' helpers; no package imports another's helpers.
    bad = _write(ws, "gem-kernels/benchmarks/bench_bad.py", "import pytest\nimport my_helpers\n")
    other = _write(ws, "gem-model/tests/test_bad.py", "import my_helpers\n")
    found = sorted((v.file, v.line) for v in check_layers.check_workspace(ws))
    assert found == sorted([(bad, 1), (bad, 2), (other, 1)])


def test_importorskip_excuses_a_third_party_import_not_a_workspace_one(tmp_path):
    ws = _copy_workspace(tmp_path)
    skip = "import pytest\n\n\ndef test_x():\n    pytest.importorskip({0!r})\n    import {0}\n"
    _write(ws, "gem-kernels/tests/test_optional.py", skip.format("sklearn"))
    assert check_layers.check_workspace(ws) == []
    bad = _write(ws, "gem-parallel/tests/test_skip.py", skip.format("gem_model"))
    assert [(v.file, v.line) for v in check_layers.check_workspace(ws)] == [(bad, 6)]


def test_an_import_guarded_by_import_error_is_optional_outside_src(tmp_path):
    ws = _copy_workspace(tmp_path)
    guarded = "try:\n    import {0}\nexcept ImportError:\n    {0} = None\n"
    _write(ws, "gem-train/benchmarks/compare.py", guarded.format("lightgbm"))
    assert check_layers.check_workspace(ws) == []
    # A workspace package is never optional, and src may not guard its way around a dependency.
    bad_ws = _write(ws, "gem-kernels/benchmarks/b.py", guarded.format("gem_model"))
    bad_src = _write(ws, "gem-kernels/src/gem_kernels/opt.py", guarded.format("lightgbm"))
    found = sorted((v.file, v.line) for v in check_layers.check_workspace(ws))
    assert found == sorted([(bad_ws, 2), (bad_src, 2)])


def test_test_tools_must_be_in_the_dev_group(tmp_path):
    ws = _copy_workspace(tmp_path)
    assert [r.split(">")[0] for r in check_layers.required_test_tools(ws)] == list(check_layers.TEST_TOOLS)
    root = ws / "pyproject.toml"
    root.write_text(root.read_text().replace('"hypothesis>=6.100",', ""))
    with pytest.raises(ValueError, match="hypothesis"):
        check_layers.check_workspace(ws)
