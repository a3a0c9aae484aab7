"""The release check (tools/check_release.py, run in CI) passes on the repository and catches each kind of
inconsistency a version bump can leave behind, on a copy of the packages' metadata."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_release", ROOT / "tools" / "check_release.py")
assert _spec is not None and _spec.loader is not None
check_release = importlib.util.module_from_spec(_spec)
sys.modules["check_release"] = check_release
_spec.loader.exec_module(check_release)

PACKAGES = [p.parent.name for p in sorted((ROOT / "packages").glob("*/pyproject.toml"))]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files the check reads, copied: root and package pyproject.toml, changelogs, READMEs, __init__.py
    and _stack.py."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for pkg in PACKAGES:
        src, dst = ROOT / "packages" / pkg, tmp_path / "packages" / pkg
        mod = pkg.replace("-", "_")
        (dst / "src" / mod).mkdir(parents=True)
        for name in ("pyproject.toml", "CHANGELOG.md", "README.md"):
            shutil.copy(src / name, dst / name)
        for name in ("__init__.py", "_stack.py"):
            if (src / "src" / mod / name).exists():
                shutil.copy(src / "src" / mod / name, dst / "src" / mod / name)
    return tmp_path


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= 1, (path, old)
    path.write_text(text.replace(old, new, count))


def _bump(tree: Path, pkg: str, new: str) -> None:
    """What RELEASING.md's step 1 asks of the bumped package itself: pyproject, __version__, changelog."""
    d, mod = tree / "packages" / pkg, pkg.replace("-", "_")
    _edit(d / "pyproject.toml", 'version = "0.1.0"', f'version = "{new}"')
    _edit(d / "src" / mod / "__init__.py", '__version__ = "0.1.0"', f'__version__ = "{new}"')
    _edit(
        d / "CHANGELOG.md",
        "## 0.1.0 (unreleased)",
        f"## {new} (unreleased)\n- A change.\n\n## 0.1.0 — 2026-12-03",
    )


def test_the_repository_passes():
    assert check_release.check(ROOT) == []


def test_the_copy_passes(tree: Path):
    assert check_release.check(tree) == []


def test_a_version_changed_in_pyproject_only(tree: Path):
    _edit(tree / "packages" / "gem-precision" / "pyproject.toml", 'version = "0.1.0"', 'version = "0.1.1"')
    problems = check_release.check(tree)
    assert "gem-precision: pyproject.toml version 0.1.1 != __version__ 0.1.0" in problems
    assert "gem-precision: CHANGELOG.md's newest section is 0.1.0, not 0.1.1" in problems


def test_a_minor_bump_must_move_the_ranges_of_the_packages_above(tree: Path):
    _bump(tree, "gem-kernels", "0.2.0")
    problems = check_release.check(tree)
    # gem-model and gem-train both require gem-kernels; each is told the range to write.
    assert sorted(p for p in problems if "gem-kernels" in p) == [
        "gem-model dependencies: gem-kernels<0.2,>=0.1 should be gem-kernels<0.3,>=0.2 "
        "(the series of gem-kernels 0.2.0)",
        "gem-train dependencies: gem-kernels<0.2,>=0.1 should be gem-kernels<0.3,>=0.2 "
        "(the series of gem-kernels 0.2.0)",
    ]
    for pkg in ("gem-model", "gem-train"):
        _edit(
            tree / "packages" / pkg / "pyproject.toml", '"gem-kernels>=0.1,<0.2"', '"gem-kernels>=0.2,<0.3"'
        )
    assert check_release.check(tree) == []


def test_a_patch_bump_needs_no_change_above(tree: Path):
    _bump(tree, "gem-precision", "0.1.1")
    assert check_release.check(tree) == []


def test_an_extra_that_does_not_exist_below(tree: Path):
    _edit(
        tree / "packages" / "gem-train" / "pyproject.toml",
        '"gem-model[cpu]>=0.1,<0.2"',
        '"gem-model[cpus]>=0.1,<0.2"',
    )
    assert "gem-train [cpu]: gem-model has no extra ['cpus']" in check_release.check(tree)


@pytest.mark.parametrize(
    ("heading", "problem"),
    [
        ("## Unreleased", "is not '## X.Y.Z (unreleased)' or '## X.Y.Z — YYYY-MM-DD'"),
        ("## 0.1.0 - 2026-12-03", "is not '## X.Y.Z (unreleased)' or '## X.Y.Z — YYYY-MM-DD'"),
        ("## 0.0.9 — 2026-11-01\n\n## 0.1.0 (unreleased)", "newest section is 0.0.9, not 0.1.0"),
    ],
)
def test_changelog_headings(tree: Path, heading: str, problem: str):
    _edit(tree / "packages" / "gem-model" / "CHANGELOG.md", "## 0.1.0 (unreleased)", heading)
    assert any(p.startswith("gem-model: CHANGELOG.md") and problem in p for p in check_release.check(tree))


def test_changelog_sections_newest_first(tree: Path):
    _edit(
        tree / "packages" / "gem-model" / "CHANGELOG.md",
        "## 0.1.0 (unreleased)",
        "## 0.1.0 (unreleased)\n\n## 0.2.0 — 2026-01-01",
    )
    assert "gem-model: CHANGELOG.md sections are not newest first, each version once" in check_release.check(
        tree
    )


def _bump_stack(text: str) -> str:
    return text.replace("fbgemm-gpu-cpu==1.8.0", "fbgemm-gpu-cpu==1.9.0").replace(
        "fbgemm-gpu==1.8.0", "fbgemm-gpu==1.9.0"
    )


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        # One package's extra moved to the next fbgemm, the other's not.
        (
            lambda t: _edit(
                t / "packages/gem-model/pyproject.toml", "fbgemm-gpu-cpu==1.8.0", "fbgemm-gpu-cpu==1.9.0"
            ),
            "[cpu] extras pin different stacks",
        ),
        # Every extra moved, but the workspace's override and the READMEs not.
        (
            lambda t: [
                (p := t / f"packages/{n}/pyproject.toml").write_text(_bump_stack(p.read_text()))
                for n in ("gem-model", "gem-parallel")
            ],
            "workspace override fbgemm-gpu==1.8.0 != extras' 1.9.0",
        ),
        (
            lambda t: _edit(
                t / "packages/gem-parallel/README.md", '"fbgemm-gpu-cpu==1.8.0"', '"fbgemm-gpu-cpu==1.6.0"'
            ),
            "gem-parallel/README.md: CPU install line pins fbgemm-gpu-cpu ['1.6.0'], not 1.8.0",
        ),
        (
            lambda t: _edit(t / "pyproject.toml", '"torch==2.13.0"', '"torch==2.14.1"'),
            "workspace pin torch==2.14.1 is not what the [cpu] extras allow (<2.14,>=2.13)",
        ),
        (
            lambda t: _edit(
                t / "packages/gem-kernels/pyproject.toml", '"torch>=2.11,<2.14"', '"torch>=2.11,<2.15"'
            ),
            "torch ranges differ between packages",
        ),
        (
            lambda t: [
                _edit(t / f"packages/{n}/pyproject.toml", '"torch>=2.13,<2.14"', '"torch>=2.14,<2.15"', 2)
                for n in ("gem-model", "gem-parallel")
            ],
            "[cpu] torch <2.15,>=2.14 is outside the packages' torch range <2.14,>=2.11",
        ),
        (
            lambda t: _edit(t / "packages/gem-parallel/src/gem_parallel/_stack.py", "fbgemm", "FBGEMM"),
            "gem_model/_stack.py and gem_parallel/_stack.py differ: change both",
        ),
    ],
    ids=[
        "extras-differ",
        "override",
        "readme",
        "workspace-torch",
        "torch-ranges",
        "extra-torch",
        "stack-copy",
    ],
)
def test_stack_inconsistencies(tree: Path, edit: Callable[[Path], object], problem: str):
    edit(tree)
    problems = check_release.check(tree)
    assert any(problem in p for p in problems), problems


def test_release_mode_wants_a_dated_section_and_a_new_tag(tree: Path):
    assert check_release.check(tree, "gem-precision") == [
        "gem-precision: CHANGELOG.md section 0.1.0 has no release date (still '(unreleased)')"
    ]
    _edit(
        tree / "packages" / "gem-precision" / "CHANGELOG.md", "## 0.1.0 (unreleased)", "## 0.1.0 — 2026-12-03"
    )
    assert check_release.check(tree, "gem-precision") == []
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    subprocess.run([*git, "tag", "gem-precision-v0.1.0"], check=True)
    assert check_release.check(tree, "gem-precision") == [
        "gem-precision: tag gem-precision-v0.1.0 exists already: bump the version"
    ]


def test_the_command_line_reports_and_fails(tree: Path):
    _edit(tree / "packages" / "gem-model" / "src" / "gem_model" / "__init__.py", '"0.1.0"', '"0.1.2"')
    cmd = [sys.executable, str(ROOT / "tools" / "check_release.py"), "--root", str(tree)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "__version__ 0.1.2" in proc.stdout
    assert re.search(r"release check passed", proc.stdout) is None
