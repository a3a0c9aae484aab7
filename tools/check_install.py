"""Build the five wheels and sdists, check what they carry, and install each package alone with pip.

What a user's pip does, not what the lock says: for each package a fresh virtual environment (the
machine's ``python3 -m venv``, its own pip), then ``pip install`` of that wheel alone, plus the local wheels
of its gem dependencies, plus ``[cpu]`` where it has one, with pip's own resolver against the index (and
the machine's find-links, where the CPU torch wheel lies), no lock and no constraints. Then, in each:
``pip check``, and ``tools/install_smoke.py PACKAGE`` (an op forward/backward, a ``to_mx`` round trip, a
tiny GemModel step, ``gem-train --help`` and a 5-step train).

Then a few of the package's own tests (:data:`OWN_TESTS`) run in that environment, with only the test tools
added (``tools/check_layers.py``'s ``TEST_TOOLS``, at the root ``dev`` group's versions): the other gem
packages are not installed there, so a test that imports one fails. (tools/check_layers.py keeps every test
file to the package's own imports; this shows it on real installs.) pytest runs from the work folder
(``PYTHONSAFEPATH``: nothing from the checkout on ``sys.path``) with the workspace's pytest settings, so
the package is the installed wheel.

Packages with torchrec take the two-step CPU install their README documents: torchrec requires the
distribution ``fbgemm-gpu``, which on PyPI is the CUDA build, and pip writes it over fbgemm-gpu-cpu's
files; the second step (``pip install --force-reinstall --no-deps fbgemm-gpu-cpu==X``) puts the CPU build
back. For gem-model the check also shows that the state between the two steps, and a real wrong pairing
(the fbgemm-gpu-cpu built for the next torch), fail at ``import gem_model`` with gem's own diagnosis.

For gem-train, whose extras cover gem-model's and gem-parallel's, ``pip install --dry-run`` of
``gem-train[cuda]`` checks that the CUDA line of the READMEs resolves (CI has no GPU to run it on).

Downloads go once into a shared wheelhouse: each environment resolves with ``pip download`` (files
already there are not fetched again), then installs from the wheelhouse with ``--no-index``, which holds
exactly the files the resolution chose. (pip's HTTP cache does not keep files served without cache
headers, as this machine's index mirror serves them.) The environments go to a RAM folder (/dev/shm) when
it has room: writing and deleting torch's and fbgemm's files is most of the wall time on a shared disk.

Usage: ``python3 tools/check_install.py [--only PKG ...] [--work DIR] [--venvs DIR] [--keep]``;
exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["gem-kernels", "gem-precision", "gem-parallel", "gem-model", "gem-train"]
# A small, fast, representative part of each package's own test suite (pytest node ids under packages/PKG/),
# run in the package's lone environment. Each file must exist: a renamed one fails the check, not drops out.
OWN_TESTS: dict[str, list[str]] = {
    "gem-kernels": [
        "tests/test_import.py",
        "tests/test_rotary.py",
        "tests/test_jagged_ops.py",
    ],
    "gem-precision": [
        "tests/test_import.py",
        "tests/test_input_checks.py",
        "tests/test_mx_reference.py",
        "tests/test_rowwise_fallback.py",
    ],
    "gem-parallel": [
        "tests/test_import.py",
        "tests/test_toy_model.py",
        "tests/test_sparse_plan.py",
        # 2 gloo ranks started from the installed wheel (python -m gem_parallel.testing) on the toy model.
        "tests/test_parallelize_errors.py::test_misconfigurations_fail_on_every_rank_at_once",
    ],
    "gem-model": [
        "tests/test_import.py",
        "tests/test_stack_check.py",
        "tests/test_gem_batch.py",
        "tests/test_gem_model.py::test_forward_shapes_and_dtypes",
        "tests/test_gem_model.py::test_pooled_embeddings_follow_the_feature_names_whatever_the_key_order_of_the_bags",
    ],
    "gem-train": ["tests/test_import.py", "tests/test_train_config.py", "tests/test_train_optim.py"],
}
PIP_NET = ["--retries", "5", "--timeout", "120", "--progress-bar", "off"]


def required_test_tools() -> list[str]:
    """The test tools' requirements (``pytest>=8.3``, ...): check_layers.py's, at the root's versions."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import check_layers
    finally:
        sys.path.pop(0)
    return check_layers.required_test_tools(ROOT)


def own_tests(pkg: str) -> list[str]:
    """:data:`OWN_TESTS` of ``pkg`` as absolute node ids; raises if a file is missing."""
    ids = [str(ROOT / "packages" / pkg / t) for t in OWN_TESTS[pkg]]
    missing = [i for i in ids if not Path(i.split("::")[0]).is_file()]
    if missing:
        raise SystemExit(f"OWN_TESTS of {pkg}: no such test file {missing} (update tools/check_install.py)")
    return ids


def _project(pkg: str) -> dict:
    return tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def gem_dependencies(pkg: str) -> list[str]:
    """The gem packages ``pkg`` needs, transitively (dependencies and extras), in PACKAGES order."""
    seen: set[str] = set()
    todo = [pkg]
    while todo:
        project = _project(todo.pop())
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        for dep in map(_name, reqs):
            if dep.startswith("gem-") and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return [p for p in PACKAGES if p in seen]


def cpu_pin(pkg: str, dist: str) -> str | None:
    """The requirement on ``dist`` that ``pkg[cpu]`` brings (following gem extras), e.g. ``x==1.8.0``."""
    for req in _project(pkg).get("optional-dependencies", {}).get("cpu", []):
        if _name(req) == dist:
            return req.split(";")[0].strip()
        if _name(req).startswith("gem-") and "[cpu]" in req and (pin := cpu_pin(_name(req), dist)):
            return pin
    return None


def _cuda_pins(pkg: str) -> list[str]:
    """The exact pins ``pkg[cuda]`` brings, following gem extras."""
    out = []
    for req in _project(pkg).get("optional-dependencies", {}).get("cuda", []):
        if _name(req).startswith("gem-") and "[cuda]" in req:
            out += _cuda_pins(_name(req))
        else:
            out.append(req.split(";")[0].strip())
    return sorted(set(out))


def _venv_root(work: Path) -> Path:
    """Where the environments go: RAM (/dev/shm) when it holds two at once with room to spare."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 16 * 2**30:
        return Path(tempfile.mkdtemp(prefix="gem-install-venvs-", dir=shm))
    return work


def _run(
    cmd: list[str],
    *,
    cwd: Path | None = None,
    check: bool = True,
    timeout: float = 1800,
    env: dict | None = None,
):
    env = {
        k: v
        for k, v in {**os.environ, **(env or {})}.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:] + proc.stderr[-6000:])
        raise SystemExit(f"FAILED ({proc.returncode}): {' '.join(map(str, cmd))}")
    return proc


def build(dist: Path) -> None:
    for pkg in PACKAGES:
        _run(["uv", "build", "--quiet", "--package", pkg, "--out-dir", str(dist)], cwd=ROOT)


def check_distributions(dist: Path) -> None:
    """Every wheel and sdist carries the root LICENSE byte for byte and py.typed; metadata says so."""
    license_text = (ROOT / "LICENSE").read_bytes()
    for pkg in PACKAGES:
        mod, version = pkg.replace("-", "_"), _project(pkg)["version"]
        with zipfile.ZipFile(dist / f"{mod}-{version}-py3-none-any.whl") as whl:
            names = set(whl.namelist())
            assert whl.read(f"{mod}-{version}.dist-info/licenses/LICENSE") == license_text, pkg
            assert f"{mod}/py.typed" in names, f"{pkg}: no py.typed in the wheel"
            meta = whl.read(f"{mod}-{version}.dist-info/METADATA").decode()
            assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta, pkg
        with tarfile.open(dist / f"{mod}-{version}.tar.gz") as sdist:
            lic = sdist.extractfile(f"{mod}-{version}/LICENSE")
            assert lic is not None and lic.read() == license_text, f"{pkg}: sdist LICENSE"
            assert f"{mod}-{version}/src/{mod}/py.typed" in sdist.getnames(), (
                f"{pkg}: no py.typed in the sdist"
            )
    print(f"  {len(PACKAGES)} wheels and sdists carry LICENSE (Apache-2.0) and py.typed")


def _wheel(dist: Path, pkg: str) -> Path:
    return dist / f"{pkg.replace('-', '_')}-{_project(pkg)['version']}-py3-none-any.whl"


def _import_error(py: Path, module: str, cwd: Path) -> str:
    """The ImportError message of ``import module`` in ``py``'s environment ("" if the import works)."""
    proc = _run([str(py), "-c", f"import {module}"], cwd=cwd, check=False)
    if proc.returncode == 0:
        return ""
    at = proc.stderr.rfind("ImportError: ")
    assert at >= 0, f"import {module} failed without an ImportError:\n{proc.stderr[-3000:]}"
    return proc.stderr[at:]


class Check:
    """One package in its own fresh environment. ``resolve`` runs alone (it writes the shared
    wheelhouse); ``install_and_test`` may run beside other packages' (it only reads it)."""

    def __init__(
        self, pkg: str, dist: Path, wheelhouse: Path, work: Path, venvs: Path, python: str, tools: list[str]
    ) -> None:
        self.pkg, self.dist, self.wheelhouse, self.work, self.python = pkg, dist, wheelhouse, work, python
        self.tools, self.tests = tools, own_tests(pkg)
        self.venv = venvs / f"venv-{pkg}"
        self.py = self.venv / "bin" / "python"
        has_cpu = "cpu" in _project(pkg).get("optional-dependencies", {})
        self.args = [f"{_wheel(dist, pkg)}[cpu]" if has_cpu else str(_wheel(dist, pkg))]
        self.args += [str(_wheel(dist, dep)) for dep in gem_dependencies(pkg)]
        # --no-compile: byte-compiling torch's thousands of modules costs CPU and checks nothing here.
        self.local = ["--no-index", "--find-links", str(wheelhouse), "--no-compile"]
        self.log: list[str] = []
        self.times: dict[str, float] = {}

    def _pip(self, *args: str) -> str:
        return _run([str(self.py), "-m", "pip", *args], cwd=self.work).stdout

    def _timed(self, step: str, t0: float) -> None:
        self.times[step] = time.perf_counter() - t0

    def resolve(self) -> None:
        t0 = time.perf_counter()
        _run([self.python, "-m", "venv", str(self.venv)])
        self._pip("download", *PIP_NET, "--dest", str(self.wheelhouse), *self.args)
        if self.tests:  # the test tools, added to the environment after the smoke test
            self._pip("download", *PIP_NET, "--dest", str(self.wheelhouse), *self.tools)
        self._timed("resolve+download", t0)

    def install_and_test(self) -> None:
        t0 = time.perf_counter()
        report = self.work / f"report-{self.pkg}.json"
        self._pip("install", *self.local, "--report", str(report), *self.args)
        installed = {
            _name(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]
        }
        shown = ("torch", "triton", "numpy", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu")
        versions = ", ".join(f"{d} {installed[d]}" for d in shown if d in installed)
        self.log.append(f"{self.pkg}: {len(installed)} distributions; {versions}")
        if "torchrec" in installed:
            self._cpu_fix_up()
        self._timed("install", t0)
        t0 = time.perf_counter()
        self.log.append(self._pip("check").strip())
        smoke = [str(self.py), str(ROOT / "tools" / "install_smoke.py"), self.pkg]
        self.log.append(_run(smoke, cwd=self.work).stdout.strip())
        self._timed("smoke", t0)
        if self.tests:
            t0 = time.perf_counter()
            self._own_tests()
            self._timed("own tests", t0)
        if self.pkg == "gem-model":
            t0 = time.perf_counter()
            self._wrong_pairing(installed["torch"])
            self._timed("wrong pairing", t0)
        if "cuda" in _project(self.pkg).get("optional-dependencies", {}) and self.pkg == PACKAGES[-1]:
            t0 = time.perf_counter()
            self._cuda_resolves()
            self._timed("[cuda] resolution", t0)
        t0 = time.perf_counter()
        shutil.rmtree(self.venv)  # here, so that it overlaps the other environments' work
        self._timed("clean-up", t0)

    def _own_tests(self) -> None:
        """The package's :data:`OWN_TESTS` in this environment, plus the test tools only."""
        self._pip("install", *self.local, *self.tools)
        self._pip("check")
        folder = self.work / f"tests-{self.pkg}"  # pytest's working folder: nothing of the checkout in it
        folder.mkdir(exist_ok=True)
        ini = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT)]  # the workspace's pytest settings
        cmd = [str(self.py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *ini, *self.tests]
        proc = _run(
            cmd,
            cwd=folder,
            check=False,
            timeout=900,
            env={"PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1"},
        )
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        if proc.returncode != 0 or " passed" not in summary:
            sys.stdout.write(proc.stdout[-8000:] + proc.stderr[-4000:])
            raise SystemExit(f"FAILED: {self.pkg}'s own tests in its lone environment: {summary}")
        files = ", ".join(sorted({Path(t.split("::")[0]).name for t in self.tests}))
        self.log.append(f"own tests ({files}): {summary.strip('= ')}")

    def _cpu_fix_up(self) -> None:
        """Step 2 of the README's CPU install: the CPU build of fbgemm back over the CUDA build."""
        pin = cpu_pin(self.pkg, "fbgemm-gpu-cpu")
        assert pin, f"{self.pkg} installs torchrec but its [cpu] extra pins no fbgemm-gpu-cpu"
        if self.pkg == "gem-model":  # between the steps: gem's diagnosis, if pip wrote the CUDA build last
            error = _import_error(self.py, "gem_model", self.work)
            assert not error or "--force-reinstall --no-deps" in error, error
            self.log.append(
                "after step 1 alone, import gem_model "
                + ("fails with gem's fix-up command" if error else "works (pip wrote the CPU build last)")
            )
        self._pip("install", *self.local, "--force-reinstall", "--no-deps", pin)

    def _wrong_pairing(self, torch_version: str) -> None:
        """fbgemm-gpu-cpu of the next release (built for the next torch) fails with gem's diagnosis."""
        pin = cpu_pin(self.pkg, "fbgemm-gpu-cpu") or ""
        major, minor = map(int, pin.split("==")[1].split(".")[:2])
        wrong = f"fbgemm-gpu-cpu=={major}.{minor + 1}.0"
        self._pip("download", *PIP_NET, "--no-deps", "--dest", str(self.wheelhouse), wrong)
        self._pip("install", *self.local, "--force-reinstall", "--no-deps", wrong)
        error = _import_error(self.py, "gem_model", self.work)
        want = f"fbgemm-gpu-cpu {major}.{minor + 1}.0 is built for torch 2.{minor + 6}, but torch is "
        want += torch_version
        assert want in error and '"gem-model[cpu]"' in error, error
        self.log.append(f"wrong pairing ({wrong}): {error.splitlines()[0][:150]}...")
        self.log.extend(error.splitlines()[1:])

    def _cuda_resolves(self) -> None:
        """``pip install --dry-run PKG[cuda]``: the CUDA extras resolve to the pinned set, no CPU build."""
        args = [f"{_wheel(self.dist, self.pkg)}[cuda]", *self.args[1:]]
        report = self.work / f"report-{self.pkg}-cuda.json"
        self._pip("download", *PIP_NET, "--dest", str(self.wheelhouse), *args)
        self._pip("install", *self.local, "--dry-run", "--ignore-installed", "--report", str(report), *args)
        chosen = {
            _name(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]
        }
        want = {_name(r): r.split("==")[1] for r in _cuda_pins(self.pkg) if "==" in r}
        got = {d: chosen.get(d) for d in want}
        assert got == want and "fbgemm-gpu-cpu" not in chosen, (got, want)
        self.log.append(f"{self.pkg}[cuda] resolves: " + ", ".join(f"{d} {v}" for d, v in got.items()))

    def report(self) -> str:
        times = ", ".join(f"{k} {v:.0f}s" for k, v in self.times.items())
        return "\n    ".join([f"  {self.log[0]}", *self.log[1:], f"times: {times}"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=PACKAGES, help="check only these packages")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--venvs", type=Path, help="folder of the environments (default: RAM if room)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (wheelhouse, reports)")
    parser.add_argument("--jobs", type=int, default=2, help="environments installed and tested at once")
    parser.add_argument("--python", default=shutil.which("python3") or sys.executable)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gem-install-"))
    work.mkdir(parents=True, exist_ok=True)
    dist, wheelhouse = work / "dist", work / "wheelhouse"
    venvs = args.venvs or _venv_root(work)
    venvs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        python = _run([args.python, "-VV"]).stdout.strip()
        print(f"python: {python}; work: {work}; environments: {venvs}", flush=True)
        build(dist)
        check_distributions(dist)
        print(f"  built and checked in {time.perf_counter() - start:.0f}s", flush=True)
        tools = required_test_tools()
        checks = [
            Check(pkg, dist, wheelhouse, work, venvs, args.python, tools) for pkg in args.only or PACKAGES
        ]
        for check in checks:
            check.resolve()
        print(f"  resolved and downloaded in {time.perf_counter() - start:.0f}s", flush=True)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(c.install_and_test): c for c in checks}
            for future in as_completed(futures):
                future.result()
                print(futures[future].report(), flush=True)
    finally:
        if venvs != work:
            shutil.rmtree(venvs, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"install check passed in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
