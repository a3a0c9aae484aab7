"""Testing aids: the multi-process test harness (here) and a toy model (:mod:`.toy_model`).

Run a function on several CPU processes over gloo, with a deadline: the multi-process test harness.

Each rank is a fresh ``python -m gem_parallel.testing`` subprocess (no fork of a process that already holds
torch threads; no pickling of test functions). The target is named by file and function, so test modules
work whatever pytest's import mode. Every rank joins a gloo process group (its rendezvous store held by
the parent, so a rank that fails at once cannot break another's start-up) with ``timeout_s`` as its
collective timeout; the parent kills every rank still running at the deadline. Results come back through
``torch.save``/``torch.load(weights_only=True)`` files, so a rank returns tensors, numbers, strings and plain
containers of them.

Example::

    # in tests/test_x.py
    def _worker(rank: int, world_size: int, n: int) -> dict:
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return {"sum": t}

    def test_all_reduce():
        out = run_distributed(__file__, "_worker", world_size=2, kwargs={"n": 3})
        assert out[0]["sum"].tolist() == [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistributedRunError", "RankFailure", "free_port", "run_distributed"]


class DistributedRunError(RuntimeError):
    """A rank failed or the run passed its deadline; ``failures`` holds every rank's outcome."""

    def __init__(self, message: str, failures: list[RankFailure]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass
class RankFailure:
    """How one rank ended: its exit code (None: killed at the deadline), error type and message."""

    rank: int
    returncode: int | None
    error_type: str | None
    message: str
    stderr_tail: str


def free_port() -> int:
    """A TCP port that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_distributed(
    file: str | os.PathLike,
    func: str,
    world_size: int,
    *,
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    expect_failure: bool = False,
    env: dict[str, str] | None = None,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``func(rank, world_size, **kwargs)`` from ``file`` on ``world_size`` gloo ranks.

    Args:
        file: the Python file defining ``func`` (a test module's ``__file__``).
        func: a module-level function name; it runs after the process group is up.
        kwargs: keyword arguments for ``func`` (plain data: they travel through ``torch.save``).
        timeout_s: collective timeout of the process group, and the deadline of the whole run (plus
            start-up): a rank still alive then is killed.
        expect_failure: return each rank's :class:`RankFailure` (``returncode`` 0 for a rank that
            succeeded) instead of raising when some rank fails.
        env: extra environment variables for every rank.
        threads_per_rank: torch intra-op threads per rank (the machines running CI have 2 cores).

    Returns:
        Per rank (in rank order), what ``func`` returned; with ``expect_failure``, per-rank failures.

    Raises:
        DistributedRunError: a rank failed or the deadline passed (unless ``expect_failure``).
    """
    with tempfile.TemporaryDirectory(prefix="gem-dist-") as tmp:
        tmpdir = Path(tmp)
        torch.save(kwargs or {}, tmpdir / "kwargs.pt")
        # The rendezvous store lives here, not on rank 0: a rank 0 that fails at once (a bad config) must
        # not take the store down while another rank is still joining (that rank would report a
        # DistNetworkError instead of its own error).
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s + 60.0),
        )  # fmt: skip
        port = store.port
        child_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": str(threads_per_rank),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "PYTHONWARNINGS": "ignore",
            **(env or {}),
        }
        procs = []
        for rank in range(world_size):
            cmd = [
                sys.executable, "-m", "gem_parallel.testing",
                "--file", str(Path(file).resolve()), "--func", func, "--rank", str(rank),
                "--world-size", str(world_size), "--dir", str(tmpdir), "--timeout-s", str(timeout_s),
                "--threads", str(threads_per_rank),
            ]  # fmt: skip
            err = open(tmpdir / f"stderr_{rank}.txt", "w")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen(cmd, env={**child_env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                           stdout=err, stderr=subprocess.STDOUT), err))  # fmt: skip
        # Start-up (imports) is not part of the collective timeout; allow for it on a loaded machine.
        deadline = time.monotonic() + timeout_s + 60.0
        codes: list[int | None] = [None] * world_size
        while time.monotonic() < deadline and any(c is None for c in codes):
            for rank, (p, _) in enumerate(procs):
                if codes[rank] is None:
                    codes[rank] = p.poll()
            time.sleep(0.05)
        for rank, (p, err) in enumerate(procs):
            if codes[rank] is None:
                p.kill()
                p.wait()
            err.close()
        outcomes = [_outcome(tmpdir, rank, codes[rank]) for rank in range(world_size)]
        failed = [o for o in outcomes if o.returncode != 0]
        if expect_failure:
            return outcomes
        if failed:
            lines = [
                f"rank {o.rank}: "
                + ("killed at the deadline" if o.returncode is None else _describe_exit(o.returncode))
                + (f": {o.error_type}: {o.message}" if o.error_type else "")
                for o in outcomes
            ]
            # A rank killed by a signal (a crash) is the cause: its peers then fail on a closed connection.
            crashed = [o for o in failed if o.returncode is not None and o.returncode < 0]
            worst = crashed[0] if crashed else next((o for o in failed if o.error_type), failed[0])
            raise DistributedRunError(
                f"{func} on {world_size} ranks failed:\n  " + "\n  ".join(lines)
                + f"\n--- rank {worst.rank} output (tail) ---\n{worst.stderr_tail}",
                outcomes,
            )  # fmt: skip
        return [torch.load(tmpdir / f"result_{r}.pt", weights_only=True) for r in range(world_size)]


def _describe_exit(code: int) -> str:
    """``exit 1``, or ``killed by SIGSEGV`` for a negative (signal) return code."""
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _outcome(tmpdir: Path, rank: int, code: int | None) -> RankFailure:
    stderr = (tmpdir / f"stderr_{rank}.txt").read_text(errors="replace")
    err_file = tmpdir / f"error_{rank}.txt"
    etype, msg = None, ""
    if err_file.exists():
        etype, _, msg = err_file.read_text().partition("\n")
    return RankFailure(rank, code, etype or None, msg, stderr[-6000:])


def _load_function(file: str, func: str) -> Callable[..., Any]:
    spec = importlib.util.spec_from_file_location(f"_gem_dist_target_{abs(hash(file))}", file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn: Callable[..., Any] = getattr(module, func)
    return fn


def _worker_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("--func", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--timeout-s", type=float, required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    # A crash in native code (a segfault in a kernel or in gloo) prints every thread's Python stack to
    # this rank's stderr file, which the parent reports.
    faulthandler.enable(all_threads=True)
    out = Path(a.dir)
    torch.set_num_threads(a.threads)
    try:
        fn = _load_function(a.file, a.func)
        kwargs = torch.load(out / "kwargs.pt", weights_only=True)
        timeout = datetime.timedelta(seconds=a.timeout_s)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world_size, timeout=timeout)
        result = fn(a.rank, a.world_size, **kwargs)
        torch.save(result, out / f"result_{a.rank}.pt")
    except BaseException as e:  # report any failure (also KeyboardInterrupt) to the parent
        (out / f"error_{a.rank}.txt").write_text(f"{type(e).__name__}\n{e}")
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no destructor may wait on peers that are gone
    if dist.is_initialized():
        dist.destroy_process_group()
    # The result is on disk; end without interpreter finalization. A gloo worker thread can still be releasing
    # a finished collective's work (FSDP2's all-gathers) whose tensors Python owns; if that happens while the
    # interpreter finalizes, its GIL acquire ends the thread and the C++ runtime aborts the process (SIGABRT
    # after success: pytorch/pytorch#190489; seen here in about 1 of 12 runs of a checkpoint test).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
