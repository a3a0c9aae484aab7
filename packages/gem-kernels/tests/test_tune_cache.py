"""The persistent autotune cache (``gem_kernels.tune_cache``), on the CPU.

Fast tests drive the real ``triton.autotune`` with a fake kernel and a fake timer (the autotuner's
protocol, no compilation): a fresh autotuner ("a new process") reads the choice and times nothing; a
corrupt, foreign or stale file is ignored and replaced; ``GEM_KERNELS_CACHE=off`` reads and writes nothing;
the key changes with the device, the Triton version, the kernel source and the bucket; concurrent writer
processes leave a valid file. The slow test runs the attention kernels through their autotuners in two
interpreter processes sharing one cache folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gem_kernels import tune_cache

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
# The fake timer's times (ms) per BLOCK: 32 is the fastest.
TIMES = {16: 3.0, 32: 1.0, 64: 2.0}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(tune_cache.ENV, str(tmp_path))
    return tmp_path


class FakeKernel:
    """Enough of a JITFunction for ``triton.autotune``: ``fn``, ``arg_names``, ``run``; records BLOCKs."""

    def __init__(self, source: str = "v1") -> None:
        def kernel(x: Any, n: int, BLOCK: int) -> None: ...

        self.fn = kernel
        self.arg_names = ["x", "n"]
        self.cache_key = f"fake-kernel-{source}"  # what a JITFunction hashes its source into
        self.launched: list[int] = []

    def run(self, *args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> None:
        self.launched.append(kwargs["BLOCK"])


class FakeTimer:
    def __init__(self, kernel: FakeKernel) -> None:
        self.kernel, self.calls = kernel, 0

    def __call__(self, kernel_call: Any, quantiles: Any) -> list[float]:
        self.calls += 1
        kernel_call()
        return [TIMES[self.kernel.launched[-1]]] * len(quantiles)


def _tuned(source: str = "v1", prune: Any = None) -> tuple[Any, FakeKernel, FakeTimer]:
    import triton

    kernel = FakeKernel(source)
    timer = FakeTimer(kernel)
    configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2) for b in TIMES]
    return tune_cache.autotune("fake", kernel, configs, ["n"], prune=prune, bench=timer), kernel, timer


def _launch(tuned: Any, n: int = 100) -> None:
    tuned[(1,)](FakeArray(), n)


class FakeArray:
    dtype = "float16"
    device = "cpu"


def _entries(folder: Path) -> list[Path]:
    return sorted((folder / f"v{tune_cache.SCHEMA}").glob("*.json"))


@needs_triton
def test_second_autotuner_reads_the_choice_and_times_nothing(cache: Path) -> None:
    tuned, kernel, timer = _tuned()
    _launch(tuned)
    assert timer.calls == 3 and kernel.launched[-1] == 32  # timed all three, ran the fastest
    (entry,) = _entries(cache)
    data = json.loads(entry.read_text())
    assert data["choice"] == "BLOCK=32,w4,s2" and data["timings"]["BLOCK=64,w4,s2"] == 2.0
    _launch(tuned, 100)  # same bucket in the same process: Triton's own memory cache, no timing
    assert timer.calls == 3

    fresh, kernel2, timer2 = _tuned()  # a new process: empty memory cache, same disk cache
    _launch(fresh)
    assert timer2.calls == 0 and kernel2.launched == [32]
    assert fresh.persistent.timed == 0 and tuned.persistent.timed == 3
    _launch(fresh, 7)  # another bucket is a miss: timed and stored
    assert timer2.calls == 3 and len(_entries(cache)) == 2


@needs_triton
def test_reset_to_zero_zeroes_the_counter_before_every_timed_run_and_the_final_one(cache: Path) -> None:
    """The persistent attention kernels consume a work counter: each timed run and the launch after the
    timing must find it zeroed (``reset_to_zero`` reaches Triton's autotuner)."""
    import torch
    import triton

    seen: list[float] = []

    class CountingKernel(FakeKernel):
        def run(self, *args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> None:
            super().run(*args, grid=grid, warmup=warmup, **kwargs)
            seen.append(float(args[0].sum()))
            args[0].fill_(5.0)  # the kernel claims all the work

    kernel = CountingKernel()
    configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2) for b in TIMES]
    tuned = tune_cache.autotune(
        "fake_reset", kernel, configs, ["n"], bench=FakeTimer(kernel), reset_to_zero=["x"]
    )
    counter = torch.full((2,), 5.0)
    tuned[(1,)](counter, 100)
    assert seen == [0.0] * 4  # three timed runs and the final launch, each from zero


@needs_triton
def test_pruned_to_one_candidate_is_not_timed(cache: Path) -> None:
    tuned, kernel, timer = _tuned(prune=lambda configs, named_args, **kw: configs[:1])
    _launch(tuned)
    assert timer.calls == 0 and kernel.launched == [16] and _entries(cache) == []


@needs_triton
@pytest.mark.parametrize("garbage", ["", "{", "not json", "[1, 2]", '{"schema": 1}', "\x00\xff"])
def test_corrupt_file_is_ignored_and_replaced(cache: Path, garbage: str) -> None:
    tuned, _, _ = _tuned()
    _launch(tuned)
    (entry,) = _entries(cache)
    entry.write_text(garbage)
    fresh, kernel, timer = _tuned()
    _launch(fresh)
    assert timer.calls == 3 and kernel.launched[-1] == 32  # re-timed
    assert json.loads(entry.read_text())["choice"] == "BLOCK=32,w4,s2"  # and rewritten whole


@needs_triton
def test_foreign_key_or_unknown_choice_is_ignored(cache: Path) -> None:
    tuned, _, _ = _tuned()
    _launch(tuned)
    (entry,) = _entries(cache)
    data = json.loads(entry.read_text())
    for bad in ({**data, "choice": "BLOCK=128,w4,s2"}, {**data, "key": [*data["key"][:-1], [1]]},
                {**data, "schema": 0}, {**data, "choice": ["BLOCK=32,w4,s2"]}):  # fmt: skip
        entry.write_text(json.dumps(bad))
        fresh, _, timer = _tuned()
        _launch(fresh)
        assert timer.calls == 3


@needs_triton
def test_disabled_reads_and_writes_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tuned, _, _ = _tuned()
    _launch(tuned)
    assert len(_entries(cache)) == 1
    for off in ("off", "0", "none"):
        monkeypatch.setenv(tune_cache.ENV, off)
        assert tune_cache.cache_dir() is None
        fresh, _, timer = _tuned()
        _launch(fresh, 3)  # a new bucket: timed, not stored
        _launch(fresh, 100)  # the cached bucket: timed again
        assert timer.calls == 6
    assert len(_entries(cache)) == 1


def test_default_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(tune_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune_cache.cache_dir() == tmp_path / "gem" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tune_cache.cache_dir() == Path("~/.cache/gem/kernels").expanduser()


@needs_triton
def test_key_changes_with_device_triton_source_and_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    tuned, _, _ = _tuned()
    tuning = tuned.persistent
    base = tuning.key({"x": FakeArray(), "n": 100}, {})
    assert base == tuning.key({"x": FakeArray(), "n": 100}, {})
    assert base != tuning.key({"x": FakeArray(), "n": 101}, {})  # bucket
    assert base != _tuned("v2")[0].persistent.key({"x": FakeArray(), "n": 100}, {})  # kernel source
    monkeypatch.setattr(tune_cache, "triton_version", lambda: "0.0.0")
    assert base != tuning.key({"x": FakeArray(), "n": 100}, {})
    monkeypatch.undo()
    monkeypatch.setattr(tune_cache, "device_tag", lambda device=None: "NVIDIA H100 sm_90 132SM")
    assert base != tuning.key({"x": FakeArray(), "n": 100}, {})
    assert tune_cache.kernel_identity([tuning.kernel], ["a"]) != tune_cache.kernel_identity(
        [tuning.kernel], ["b"]
    )


def test_choose_stores_the_fastest_and_a_new_call_reads_it(cache: Path) -> None:
    calls: list[str] = []

    def timer(name: str, ms: float) -> Any:
        return lambda: calls.append(name) or ms

    kernels = [FakeKernel()]
    cands = {"tiled": timer("tiled", 2.0), "onetile": timer("onetile", 1.0)}
    assert tune_cache.choose(["fwd", 64], kernels, cands) == ("onetile", False)
    assert tune_cache.choose(["fwd", 64], kernels, cands) == ("onetile", True)
    assert calls == ["tiled", "onetile"]
    # An implementation that failed (inf) is stored as JSON null, and the other one chosen.
    inf = {"tiled": timer("tiled", 2.0), "onetile": timer("onetile", float("inf"))}
    assert tune_cache.choose(["bwd", 64], kernels, inf) == ("tiled", False)
    assert all(json.loads(p.read_text())["timings"].get("onetile", 0) in (None, 1.0) for p in _entries(cache))


WRITER = textwrap.dedent(
    """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("tc", sys.argv[1])
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)
    for i in range(int(sys.argv[3])):
        tc.store(["race", 1], sys.argv[2], {sys.argv[2]: float(i)})
    """
)


def test_concurrent_writers_leave_a_valid_file(cache: Path) -> None:
    """Four processes rewrite one entry 300 times each while this one reads the file raw: every read finds
    no file or a whole entry (strict JSON, a writer's label), never a partial one; no temporary file is
    left behind."""
    labels = [f"w{i}" for i in range(4)]
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, tune_cache.__file__, label, "300"])
        for label in labels
    ]
    path = tune_cache._path(cache, ["race", 1])
    seen: set[str] = set()
    try:
        while any(p.poll() is None for p in procs):
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            seen.add(json.loads(text)["choice"])  # raises on a partial file
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert tune_cache.load(["race", 1], labels) in labels and seen <= set(labels)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_unwritable_folder_warns_once_and_tunes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(tune_cache.ENV, str(blocker / "sub"))  # a folder under a file cannot be created
    monkeypatch.setattr(tune_cache, "_write_failed", False)
    with pytest.warns(UserWarning, match="not written"):
        tune_cache.store(["k"], "a")
    tune_cache.store(["k"], "a")  # no second warning (pytest would not fail on one; the flag says it)
    assert tune_cache._write_failed and tune_cache.load(["k"], ["a"]) is None


@needs_triton
@pytest.mark.slow
def test_attention_autotuners_share_a_cache_across_interpreter_processes(tmp_path: Path) -> None:
    """Two interpreter processes, one cache folder: the first times the candidates of the attention
    autotuners and the tiled-vs-one-tile choice, the second times nothing and gets the same results."""
    driver = Path(__file__).with_name("tune_cache_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1", GEM_KERNELS_CACHE=str(tmp_path))
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(json.loads(proc.stdout.split("JSON:", 1)[1]))
    first, second = runs
    assert first["timed"] == {"fwd": 2, "fwd_short_kv": 2}
    assert second["timed"] == {"fwd": 0, "fwd_short_kv": 0}
    assert first["variants"] == second["variants"] and len(first["variants"]) == 1
    assert first["files"] == second["files"] and len(first["files"]) == 3  # fwd, one-tile fwd, variant
    # Same kernels, same inputs: the same outputs; fp16 against fp64 within a few fp16 ulps.
    assert first["err"] == second["err"] and first["err"] < 2e-3
    assert first["cross_err"] == second["cross_err"] and first["cross_err"] < 1e-5


H200_SMEM = 232448  # shared_memory_per_block_optin of the H200 (227 KiB)


@needs_triton
@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_attention_candidates_by_shape_and_dtype_class(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: at most two candidates per bucket; fp32: one; all fit shared memory and are autotuner
    configs; key tiles no longer than the keys' bucket where one fits."""
    import torch

    from gem_kernels.attention import variants

    # The count is its own test's; the lists are this one's.
    monkeypatch.setattr(tune_cache, "TUNE_CANDIDATES", 2)
    from gem_kernels.attention.triton.autotuners import tiled_configs

    configs = {
        (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in tiled_configs(kernel)
    }
    for bq, bkv in ((4096, 4096), (2048, 16), (2048, 64), (32, 4096), (16, 2048)):
        for dtype, most in ((torch.bfloat16, 2), (torch.float32, 1)):
            for d in (16, 64, 128, 256):
                cands = variants.candidates_for(kernel, bq, bkv, dtype, d, d, H200_SMEM)
                assert 1 <= len(cands) <= most and set(cands) <= configs
                elsize = dtype.itemsize
                assert all(
                    variants.smem_bytes(kernel, c[0], c[1], c[3], d, d, elsize) <= H200_SMEM for c in cands
                ) or (
                    len(cands) == 1 and d == 256  # nothing fits: the smallest is kept (Triton will say)
                )
                if bkv <= 64 and d <= 128:
                    assert all(c[1] <= bkv for c in cands)
    # fp32 D=128: the bf16 general list's 128x64, 3-stage tiles would not fit; the fp32 tile does.
    assert variants.smem_bytes("fwd", 128, 128, 3, 128, 128, 4) > H200_SMEM
    (fp32,) = variants.candidates_for(kernel, 4096, 4096, torch.float32, 128, 128, H200_SMEM)
    assert fp32[0] * fp32[1] <= 64 * 64 and fp32[3] == 2
    # A tight limit prunes the big tiles first.
    big = variants.candidates_for(kernel, 4096, 4096, torch.bfloat16, 128, 128, None)
    tight = variants.candidates_for(kernel, 4096, 4096, torch.bfloat16, 128, 128, 150_000)
    assert len(tight) >= 1 and all(
        variants.smem_bytes(kernel, c[0], c[1], c[3], 128, 128, 2) <= 150_000 for c in tight
    )
    assert len(big) == 2 and len(tight) == 1


@needs_triton
def test_tune_candidates_default_is_one_on_sm90_else_two(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from gem_kernels.attention import variants

    monkeypatch.setattr(tune_cache, "TUNE_CANDIDATES", None)  # GEM_KERNELS_TUNE_CANDIDATES unset
    for sm90, want in ((True, 1), (False, 2)):
        monkeypatch.setattr(tune_cache, "_on_sm90", lambda sm90=sm90: sm90)
        assert tune_cache.tune_candidates() == want
        got = variants.candidates_for("fwd", 4096, 4096, torch.bfloat16, 128, 128, H200_SMEM)
        assert got == variants.CANDIDATES["fwd"]["general"][:want]
    monkeypatch.setattr(tune_cache, "TUNE_CANDIDATES", 3)  # the variable wins on any device
    assert tune_cache.tune_candidates() == 3


@needs_triton
def test_tune_candidates_one_compiles_the_first_pick_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from gem_kernels.attention import variants

    monkeypatch.setattr(tune_cache, "TUNE_CANDIDATES", 1)
    for kernel in ("fwd", "dq", "dkdv"):
        (only,) = variants.candidates_for(kernel, 4096, 4096, torch.bfloat16, 128, 128, H200_SMEM)
        assert only == variants.CANDIDATES[kernel]["general"][0]


@needs_triton
def test_tune_cache_is_the_one_autotune_cache_of_the_package() -> None:
    """Every ``triton.autotune`` of gem-kernels goes through :func:`tune_cache.autotune`: the sources call
    ``triton.autotune`` nowhere else, and every autotuner the imported modules hold (module globals and
    the values of module-level dicts) carries the disk-cache hooks. Nothing needs Triton's own
    ``cache_results`` (a cached bucket is pruned to its one config before Triton would consult it)."""
    import ast
    import importlib
    import pkgutil

    from triton.runtime.autotuner import Autotuner

    import gem_kernels

    src = Path(gem_kernels.__file__).parent
    callers = set()
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "autotune"
                and ast.unparse(node) == "triton.autotune"
            ):
                callers.add(path.relative_to(src).as_posix())
    assert callers == {"tune_cache.py"}
    found = []
    for info in pkgutil.walk_packages([str(src)], prefix="gem_kernels."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            for v in value.values() if isinstance(value, dict) else (value,):
                if isinstance(v, Autotuner):
                    found.append(v)
    assert len({id(t) for t in found}) >= 11  # the attention kernels' (testing.autotuners())
    assert all(isinstance(getattr(t, "persistent", None), tune_cache.PersistentTuning) for t in found)
