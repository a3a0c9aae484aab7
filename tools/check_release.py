"""Release check: versions, changelogs and the ranges between gem's packages agree (RELEASING.md).

For every package under ``packages/``:

- ``version`` in its pyproject.toml is a PEP 440 release and equals ``__version__`` in its ``__init__.py``;
- its CHANGELOG.md's newest section is that version: ``## X.Y.Z (unreleased)`` while it is prepared,
  ``## X.Y.Z — YYYY-MM-DD`` once released; older sections below it, newest first;
- every requirement on another gem package (dependencies and extras) is the one minor series of that
  package's current version (``gem-kernels>=0.1,<0.2`` for 0.1.z; ``>=1.2,<2`` from 1.0 on), and an extra
  it asks for (``gem-model[cpu]``) exists there.

And across packages, the matched torch / torchrec / fbgemm stack is stated once: every package declares the
same torch range; the ``cpu`` and ``cuda`` extras of the packages that have them are the same; the workspace's
pins (root pyproject.toml: torch, torchrec, the fbgemm-gpu override) are those of the extras; each README's
CPU install line names the extras' fbgemm-gpu-cpu pin; gem-model and gem-parallel carry the same
``_stack.py`` (the import-time pairing check).

``--release PKG``: also that PKG's section is dated (not "unreleased") and its tag ``PKG-vX.Y.Z`` is not yet
in git. Usage: ``python tools/check_release.py [--root DIR] [--release PKG]``; exits 1 listing the problems.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

# pytest depends on packaging, so it is in every environment that runs the tests.
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^## (?P<version>\S+)(?: (?P<state>\(unreleased\)|— (?P<date>\d{4}-\d{2}-\d{2})))?\s*$")
STACK_EXTRAS = ("cpu", "cuda")
STACK_DISTS = ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def projects(root: Path) -> dict[str, dict[str, Any]]:
    """name -> [project] table of every package under ``root/packages``."""
    out = {}
    for path in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(path.read_text())["project"]
        out[project["name"]] = project
    return out


def _pkg_dir(root: Path, name: str) -> Path:
    return root / "packages" / name


def module_version(root: Path, name: str) -> str | None:
    """``__version__`` of the package's ``__init__.py``, read without importing it."""
    init = _pkg_dir(root, name) / "src" / name.replace("-", "_") / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            return value if isinstance(value, str) else None
    return None


def changelog_sections(text: str) -> list[tuple[str, str | None]]:
    """``(version, date or None)`` of each ``## `` section, in file order; a bad heading raises."""
    out = []
    for line in text.splitlines():
        if not line.startswith("## "):
            continue
        m = HEADING.match(line)
        if m is None or m["state"] is None:
            raise ValueError(f"heading {line!r} is not '## X.Y.Z (unreleased)' or '## X.Y.Z — YYYY-MM-DD'")
        out.append((m["version"], m["date"]))
    return out


def series(version: Version) -> SpecifierSet:
    """The compatible series of ``version``: its minor while 0.x, its major from 1.0 on."""
    if version.major == 0:
        return SpecifierSet(f">={version.major}.{version.minor},<{version.major}.{version.minor + 1}")
    return SpecifierSet(f">={version.major}.{version.minor},<{version.major + 1}")


def _requirements(project: dict[str, Any]) -> list[tuple[str, Requirement]]:
    """``(where, requirement)`` of the dependencies and every extra."""
    out = [("dependencies", Requirement(r)) for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        out += [(f"[{extra}]", Requirement(r)) for r in reqs]
    return out


def check_package(root: Path, name: str, everything: dict[str, dict[str, Any]]) -> list[str]:
    """The problems of one package (empty when it is consistent)."""
    project, problems = everything[name], []
    try:
        version = Version(project["version"])
    except InvalidVersion:
        return [f"{name}: version {project['version']!r} is not a PEP 440 version"]
    if version.is_prerelease or version.is_devrelease or version.local:
        problems.append(f"{name}: version {version} is not a plain release X.Y.Z")
    if (mod := module_version(root, name)) != project["version"]:
        problems.append(f"{name}: pyproject.toml version {project['version']} != __version__ {mod}")

    changelog = _pkg_dir(root, name) / "CHANGELOG.md"
    try:
        sections = changelog_sections(changelog.read_text()) if changelog.exists() else []
    except ValueError as e:
        sections = []
        problems.append(f"{name}: CHANGELOG.md {e}")
    if not sections or sections[0][0] != project["version"]:
        top = sections[0][0] if sections else "none"
        problems.append(f"{name}: CHANGELOG.md's newest section is {top}, not {project['version']}")
    versions = [Version(v) for v, _ in sections]
    if versions != sorted(set(versions), reverse=True):
        problems.append(f"{name}: CHANGELOG.md sections are not newest first, each version once")

    for where, req in _requirements(project):
        dep = _norm(req.name)
        if dep not in everything:
            continue
        dep_version = Version(everything[dep]["version"])
        if req.specifier != series(dep_version):
            problems.append(
                f"{name} {where}: {req} should be {dep}{series(dep_version)} "
                f"(the series of {dep} {dep_version})"
            )
        missing = req.extras - set(everything[dep].get("optional-dependencies", {}))
        if missing:
            problems.append(f"{name} {where}: {dep} has no extra {sorted(missing)}")
    return problems


def _pins(reqs: list[str]) -> dict[str, str]:
    """dist -> specifier text of the stack distributions among ``reqs``."""
    out = {}
    for r in map(Requirement, reqs):
        if _norm(r.name) in STACK_DISTS:
            out[_norm(r.name)] = str(r.specifier)
    return out


def _exact(spec: str) -> str | None:
    m = re.fullmatch(r"==([\w.]+)", spec)
    return m[1] if m else None


def check_stack(root: Path, everything: dict[str, dict[str, Any]]) -> list[str]:
    """The problems of the torch / torchrec / fbgemm stack across packages and the workspace."""
    problems = []
    torch = {n: _pins(p.get("dependencies", [])).get("torch") for n, p in everything.items()}
    if len(set(torch.values())) != 1:
        problems.append(f"torch ranges differ between packages: {torch}")
    torch_range = SpecifierSet(next(iter(torch.values())) or "")

    with_stack = {n: p for n, p in everything.items() if "cpu" in p.get("optional-dependencies", {})}
    extras: dict[str, dict[str, str]] = {}
    for extra in STACK_EXTRAS:
        seen = {}
        for n, p in with_stack.items():
            reqs = p.get("optional-dependencies", {}).get(extra)
            if reqs is None:
                problems.append(f"{n} has a [cpu] extra but no [{extra}]")
                continue
            pins = _pins(reqs)
            if pins:  # a package whose extras only forward to other gem packages' extras has none
                seen[n] = pins
        if len({tuple(sorted(v.items())) for v in seen.values()}) > 1:
            problems.append(f"[{extra}] extras pin different stacks: {seen}")
        extras[extra] = next(iter(seen.values()), {})
        extra_torch = extras[extra].get("torch")
        inside = _candidates(SpecifierSet(extra_torch or ""))
        if extra_torch and not (inside and all(torch_range.contains(v) for v in inside)):
            problems.append(
                f"[{extra}] torch {extra_torch} is outside the packages' torch range {torch_range}"
            )

    cpu = extras.get("cpu", {})
    fbgemm_cpu = _exact(cpu.get("fbgemm-gpu-cpu", ""))
    if with_stack and fbgemm_cpu is None:
        problems.append(f"the [cpu] extras pin no exact fbgemm-gpu-cpu: {cpu}")
    for extra in STACK_EXTRAS:
        if extras.get(extra) and _exact(extras[extra].get("fbgemm-gpu", "")) != fbgemm_cpu:
            problems.append(
                f"[{extra}] fbgemm-gpu {extras[extra].get('fbgemm-gpu')} != fbgemm-gpu-cpu =={fbgemm_cpu}"
            )

    workspace = tomllib.loads((root / "pyproject.toml").read_text())
    ws = _pins(workspace.get("project", {}).get("dependencies", []))
    overrides = _pins(workspace.get("tool", {}).get("uv", {}).get("override-dependencies", []))
    for dist, pin in [("torch", ws.get("torch")), ("torchrec", ws.get("torchrec"))]:
        version = _exact(pin or "")
        if version is None or not SpecifierSet(cpu.get(dist, "")).contains(version):
            problems.append(f"workspace pin {dist}{pin} is not what the [cpu] extras allow ({cpu.get(dist)})")
    if with_stack and _exact(overrides.get("fbgemm-gpu", "")) != fbgemm_cpu:
        problems.append(f"workspace override fbgemm-gpu{overrides.get('fbgemm-gpu')} != extras' {fbgemm_cpu}")

    line = re.compile(r'pip install --force-reinstall --no-deps "fbgemm-gpu-cpu==([\w.]+)"')
    for n in with_stack:
        found = set(line.findall((_pkg_dir(root, n) / "README.md").read_text()))
        if found != {fbgemm_cpu}:
            problems.append(
                f"{n}/README.md: CPU install line pins fbgemm-gpu-cpu {sorted(found)}, not {fbgemm_cpu}"
            )

    stacks = [
        _pkg_dir(root, n) / "src" / n.replace("-", "_") / "_stack.py" for n in ("gem-model", "gem-parallel")
    ]
    if all(p.exists() for p in stacks) and stacks[0].read_bytes() != stacks[1].read_bytes():
        problems.append("gem_model/_stack.py and gem_parallel/_stack.py differ: change both")
    return problems


def _candidates(spec: SpecifierSet) -> list[str]:
    """Versions to probe an overlap with ``spec``: the bounds it names, and the next patch of each."""
    out = []
    for s in spec:
        v = Version(s.version)
        out += [str(v), f"{v.major}.{v.minor}.{(v.micro or 0) + 1}"]
    return [v for v in out if spec.contains(v)]


def check_release(root: Path, name: str, everything: dict[str, dict[str, Any]]) -> list[str]:
    """Extra checks before tagging ``name``: a dated changelog section and no existing tag."""
    version = everything[name]["version"]
    problems = []
    sections = dict(changelog_sections((_pkg_dir(root, name) / "CHANGELOG.md").read_text()))
    if sections.get(version) is None:
        problems.append(f"{name}: CHANGELOG.md section {version} has no release date (still '(unreleased)')")
    tag = f"{name}-v{version}"
    tags = subprocess.run(["git", "-C", str(root), "tag", "--list", tag], capture_output=True, text=True)
    if tags.stdout.strip():
        problems.append(f"{name}: tag {tag} exists already: bump the version")
    return problems


def check(root: Path, release: str | None = None) -> list[str]:
    everything = projects(root)
    problems = [p for name in everything for p in check_package(root, name, everything)]
    problems += check_stack(root, everything)
    if release is not None:
        if release not in everything:
            return [*problems, f"--release {release}: no such package ({sorted(everything)})"]
        problems += check_release(root, release, everything)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--release", metavar="PKG", help="also check that PKG is ready to tag")
    args = parser.parse_args()
    problems = check(args.root, args.release)
    for p in problems:
        print(p)
    if problems:
        return 1
    versions = ", ".join(f"{n} {p['version']}" for n, p in projects(args.root).items())
    print(f"release check passed: {versions}" + (f"; {args.release} is ready to tag" if args.release else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
