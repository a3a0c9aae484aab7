"""Persistent autotuning: the choices of ``triton.autotune`` and of the attention variant, kept on disk.

This is gem-kernels' one tuning cache: every autotuner of the package is built by :func:`autotune` and every
``auto`` variant choice goes through :func:`choose` (tests/test_tune_cache.py checks that no other
``triton.autotune`` exists). Nothing here relies on Triton's own ``cache_results``, and switching it on for
these autotuners adds nothing: a cached bucket is pruned to its one config before Triton would consult its
own file. (The compiled binaries are Triton's kernel cache, ``TRITON_CACHE_DIR``: a compile cache, not a
tuning cache.)

Without it every new process re-times every candidate of every new shape bucket (20-40 s per bucket on
the H200). With it the first process times once and writes its choice; later processes, on the same
device and Triton with the same kernel source, read the choice and time nothing.

Folder: ``$GEM_KERNELS_CACHE`` if set, else ``$XDG_CACHE_HOME/gem/kernels`` (``~/.cache/gem/kernels``);
``GEM_KERNELS_CACHE=off`` (or ``0``, ``none``, ``false``) disables it. One small JSON file per entry, named
by the SHA-256 of its key, under ``v1/``:
``{"schema": 1, "key": [...], "choice": "<label>", "timings": {"<label>": ms}}``.

Key: ``[kind, kernel identity, device, Triton version, bucket]``. The device is its name, compute
capability and SM count; the kernel identity hashes the kernels' sources (Triton's ``cache_key`` of a
``JITFunction``, which covers the ``@triton.jit`` helpers it calls, else the module file) and the labels of
the candidates; the bucket is the autotune key (bucketed shapes, constexprs, dtypes).

Concurrency: each entry is written whole to a temporary file in the same folder and moved into place with
``os.replace`` (atomic on POSIX), so a reader sees the old file, the new one or none, never half of one;
two processes tuning the same bucket both write a valid file (the last one wins). A file that is not valid
JSON, has another schema or key, or names a choice that is not a current candidate is ignored (the bucket
is re-timed and the file replaced). Nothing read is executed: a choice is only matched against the labels
of the candidates in the code.

Why not Triton's own ``autotune(cache_results=True)`` (in 3.6 and 3.7)? It is switched off under
``TRITON_INTERPRET=1`` (so untestable on a CPU), keys on the compiler target (``cuda:90``), not the device,
raises on a corrupt file, and cannot hold the tiled-vs-one-tile choice. Here the same public pieces of
``triton.autotune`` are used instead: ``prune_configs_by`` answers a cached bucket with its one chosen
config, and ``do_bench`` skips the timing of a lone cached config and records the timings of a real tuning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
# torch and triton are imported where needed: the cache itself is standard library only (tests run
# concurrent writers as bare processes).

ENV = "GEM_KERNELS_CACHE"
SCHEMA = 1
_OFF = ("0", "off", "none", "false", "no", "disable", "disabled")
# A bench function as ``triton.autotune(do_bench=...)`` calls it: (kernel_call, quantiles) -> times (ms).
Bench = Callable[[Callable[[], Any], Sequence[float]], list[float]]


# At most this many candidates per kernel are compiled and timed for a new bucket (the first listed, the
# H200's pick, first): 1 times nothing. Each costs a compilation (~2 s on the H200's host) on a first call.
# Unset: :func:`tune_candidates` (1 on sm_90, where the lists were tuned, else 2).
_env_candidates = os.environ.get("GEM_KERNELS_TUNE_CANDIDATES")
TUNE_CANDIDATES: int | None = int(_env_candidates) if _env_candidates else None
if TUNE_CANDIDATES is not None and TUNE_CANDIDATES < 1:
    raise ValueError(f"GEM_KERNELS_TUNE_CANDIDATES must be >= 1, got {TUNE_CANDIDATES}")


@functools.cache
def _on_sm90() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def tune_candidates() -> int:
    """Candidates per kernel timed on a new bucket: ``GEM_KERNELS_TUNE_CANDIDATES`` if set, else 1 on
    sm_90 (each list starts with the H200's measured pick: on base-h200 a second one bought nothing, a step
    of 141.8 ms with one against 143.0 with two, and one cut the cold warm-up from 156 to 119 s), else 2."""
    if TUNE_CANDIDATES is not None:
        return TUNE_CANDIDATES
    return 1 if _on_sm90() else 2


def cache_dir() -> Path | None:
    """The cache folder (created on the first write), or None when disabled by ``GEM_KERNELS_CACHE``."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or "~/.cache"
    return Path(base).expanduser() / "gem" / "kernels"


def device_tag(device: torch.device | None = None) -> str:
    """``"<name> sm_<cc> <SMs>SM"`` of a CUDA device; ``"interpreter"`` under ``TRITON_INTERPRET=1``."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpreter"
    import torch

    if not torch.cuda.is_available():
        return "interpreter"
    p = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return f"{p.name} sm_{p.major}{p.minor} {p.multi_processor_count}SM"


def triton_version() -> str:
    import triton

    return str(triton.__version__)


def kernel_identity(kernels: Sequence[Any], labels: Sequence[str]) -> str:
    """SHA-256 (hex, 16 chars) of the kernels' sources and the candidates' labels.

    A ``JITFunction`` gives Triton's ``cache_key`` (its source and that of every jit function it calls);
    otherwise (the interpreter's functions) the source file of the kernel's module is hashed."""
    h = hashlib.sha256()
    for k in kernels:
        key = getattr(k, "cache_key", None)
        if not isinstance(key, str):
            fn = k
            while hasattr(fn, "fn"):
                fn = fn.fn
            key = Path(inspect.getfile(fn)).read_text()
        h.update(key.encode())
        h.update(b"\0")
    h.update(json.dumps(list(labels)).encode())
    return h.hexdigest()[:16]


def _jsonable(x: Any) -> Any:
    """Key parts as JSON values: numbers, strings, bools and None as they are, the rest (dtypes) by str."""
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return str(x)


def _path(folder: Path, key: list[Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return folder / f"v{SCHEMA}" / f"{digest}.json"


def load(key: Sequence[Any], labels: Sequence[str]) -> str | None:
    """The cached choice of ``key`` if it is one of ``labels``; None if absent, disabled or invalid."""
    folder = cache_dir()
    if folder is None:
        return None
    k = _jsonable(list(key))
    try:
        data = json.loads(_path(folder, k).read_text())
    except (OSError, ValueError):  # absent, unreadable, partial or not JSON: re-tune
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("key") != k:
        return None
    choice = data.get("choice")
    return choice if isinstance(choice, str) and choice in labels else None


_write_failed = False


def store(key: Sequence[Any], choice: str, timings: dict[str, float] | None = None) -> None:
    """Write the entry of ``key`` atomically (temporary file + ``os.replace``); warn once on failure."""
    global _write_failed
    folder = cache_dir()
    if folder is None:
        return
    k = _jsonable(list(key))
    path = _path(folder, k)
    finite = {n: (t if math.isfinite(t) else None) for n, t in (timings or {}).items()}  # strict JSON
    body = json.dumps({"schema": SCHEMA, "key": k, "choice": choice, "timings": finite})
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not _write_failed:
            _write_failed = True
            warnings.warn(f"gem-kernels tune cache not written ({e}); set {ENV}=off to silence", stacklevel=2)


def config_label(config: Any) -> str:
    """A stable label of a ``triton.Config``: kwargs, warps, stages (``BLOCK_M=64,BLOCK_N=32,w4,s3``)."""
    kw = ",".join(f"{n}={v}" for n, v in sorted(config.kwargs.items()))
    return f"{kw},w{config.num_warps},s{config.num_stages}"


def default_bench(kernel_call: Callable[[], Any], quantiles: Sequence[float]) -> list[float]:
    """Times a candidate: Triton's ``do_bench`` with a short budget on CUDA (compilation dominates the
    tuning, and medians of ~20 runs separate the candidates); one wall-clock run under the interpreter."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        t0 = time.perf_counter()
        kernel_call()
        return [(time.perf_counter() - t0) * 1e3] * len(quantiles)
    import triton.testing

    out = triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=list(quantiles))
    return list(out) if isinstance(out, (list, tuple)) else [float(out)] * len(quantiles)


class PersistentTuning:
    """The ``prune_configs_by`` and ``do_bench`` hooks that make one ``triton.autotune`` persistent.

    ``triton.autotune`` calls ``early_config_prune`` once per new key in a process (its own in-memory
    cache answers repeats), then ``do_bench`` for each remaining config in order, then keeps the fastest.
    Here the pruner first narrows the candidates with ``prune`` (shape class, resources), then looks the
    bucket up on disk: a hit returns that one config, whose "timing" is skipped. A miss lets every
    candidate be timed; after the last one the fastest is stored.

    ``key_names``: the autotune key (argument names); the tensors' dtypes are added, as Triton does.
    ``bench``: the timer (``default_bench``; tests pass a fake). ``timed`` counts the real timings.
    """

    def __init__(
        self,
        name: str,
        kernel: Any,
        configs: Sequence[Any],
        key_names: Sequence[str],
        prune: Callable[..., list[Any]] | None = None,
        bench: Bench | None = None,
    ) -> None:
        self.name = name
        self.kernel = kernel
        self.labels = [config_label(c) for c in configs]
        self.key_names = list(key_names)
        self.prune = prune
        self.bench: Bench = bench or default_bench
        self.timed = 0
        self._identity: str | None = None
        self._pending: tuple[list[Any], list[Any]] | None = None  # (disk key, candidates being timed)
        self._timings: list[list[float]] = []
        self._skip = False

    def key(self, named_args: dict[str, Any], kwargs: dict[str, Any]) -> list[Any]:
        """The disk key of one launch (``named_args``: positional arguments by name; ``kwargs``: the rest)."""
        if self._identity is None:
            self._identity = kernel_identity([self.kernel], self.labels)
        every = {**named_args, **kwargs}
        device = next(
            (a.device for a in every.values() if hasattr(a, "device") and hasattr(a, "dtype")), None
        )
        bucket = [every.get(n) for n in self.key_names]
        bucket += [str(a.dtype) for a in every.values() if hasattr(a, "dtype")]
        return ["autotune", self.name, self._identity, device_tag(device), triton_version(), bucket]

    def early_config_prune(self, configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        candidates = self.prune(configs, named_args, **kwargs) if self.prune else list(configs)
        key = self.key(named_args, kwargs)
        labels = [config_label(c) for c in candidates]
        self._timings, self._pending, self._skip = [], None, False
        if len(candidates) > 1:
            hit = load(key, labels)
            if hit is not None:
                self._skip = True
                return [candidates[labels.index(hit)]]
        self._pending = (key, candidates)
        return candidates

    def do_bench(self, kernel_call: Callable[[], Any], quantiles: Sequence[float]) -> list[float]:
        if self._skip or (self._pending is not None and len(self._pending[1]) == 1):
            return [0.0] * len(quantiles)  # nothing to choose: the launch that follows compiles it
        try:
            times = self.bench(kernel_call, quantiles)
        except BaseException:
            self._timings.append([float("inf")] * len(quantiles))  # Triton turns some errors into inf
            self._finish()
            raise
        self.timed += 1
        self._timings.append(list(times))
        self._finish()
        return times

    def _finish(self) -> None:
        """After the last candidate's timing, store the fastest (by median, as Triton compares them)."""
        if self._pending is None or len(self._timings) < len(self._pending[1]):
            return
        key, candidates = self._pending
        self._pending = None
        best = min(range(len(candidates)), key=lambda i: self._timings[i])
        if self._timings[best][0] == float("inf"):
            return
        timings = {config_label(c): t[0] for c, t in zip(candidates, self._timings, strict=True)}
        store(key, config_label(candidates[best]), timings)


def autotune(
    name: str,
    kernel: Any,
    configs: list[Any],
    key: list[str],
    prune: Callable[..., list[Any]] | None = None,
    bench: Bench | None = None,
    reset_to_zero: list[str] | None = None,
) -> Any:
    """``triton.autotune(configs, key)(kernel)`` whose choices persist (see :class:`PersistentTuning`).

    ``reset_to_zero``: argument names zeroed before each timed run (Triton's option: a work counter).
    The hooks are reachable as ``result.persistent`` (tests count ``result.persistent.timed``)."""
    import triton

    tuning = PersistentTuning(name, kernel, configs, key, prune, bench)
    tuned = triton.autotune(
        configs,
        key=key,
        prune_configs_by={"early_config_prune": tuning.early_config_prune},
        do_bench=tuning.do_bench,
        reset_to_zero=reset_to_zero,
    )(kernel)
    tuned.persistent = tuning
    return tuned


def choose(
    key: Sequence[Any],
    kernels: Sequence[Any],
    candidates: dict[str, Callable[[], float]],
    device: torch.device | None = None,
) -> tuple[str, bool]:
    """Pick among named implementations: ``(name, from_cache)``; a cache miss times each (ms) and stores.

    ``key``: the bucket (JSON-able parts, dtypes by str); ``kernels``: what the implementations run (their
    sources enter the key); ``candidates``: name -> a function that times it; ``device``: where they run."""
    labels = list(candidates)
    full = ["choice", kernel_identity(kernels, labels), device_tag(device), triton_version(), list(key)]
    hit = load(full, labels)
    if hit is not None:
        return hit, True
    timings = {n: t() for n, t in candidates.items()}
    best = min(timings, key=lambda n: timings[n])
    store(full, best, timings)
    return best, False


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Neither read nor write the cache inside the block (sets ``GEM_KERNELS_CACHE=off``)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = "off"
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = old
