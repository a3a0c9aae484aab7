"""prewarm_triton: Triton's per-process source hash computed off the first kernel call, fork-safe.

Each check runs in a fresh interpreter: ``triton_key`` is cached per process, and the test process may
have computed it already."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_TRITON_KEY = """
try:
    from triton.runtime.cache import triton_key
except ImportError:
    from triton.compiler.compiler import triton_key
"""


def _run(code: str, **env: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_KEY + textwrap.dedent(code)],
        env=full_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_prewarm_computes_the_hash_once_in_the_background() -> None:
    out = _run("""
        import time
        from gem_kernels import prewarm_triton
        before = triton_key.cache_info().currsize
        assert prewarm_triton(wait=True) and prewarm_triton()  # a second call starts nothing new
        t0 = time.perf_counter(); triton_key(); after_s = time.perf_counter() - t0
        info = triton_key.cache_info()
        print(before, info.currsize, info.hits, f"{after_s:.4f}")
    """)
    before, size, hits, after_s = out.split()
    assert (before, size) == ("0", "1"), out
    assert int(hits) >= 1 and float(after_s) < 0.05, out  # the later call is the cached one


def test_prewarm_is_off_under_the_interpreter() -> None:
    out = _run(
        """
        from gem_kernels import prewarm_triton
        print(prewarm_triton(wait=True), triton_key.cache_info().currsize)
        """,
        TRITON_INTERPRET="1",
    )
    assert out == "False 0"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_waits_for_the_prewarm_thread() -> None:
    out = _run("""
        import os
        import gem_kernels.prewarm as pw
        pw.prewarm_triton()  # returns at once; the hash takes ~0.3 s
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print(pw._thread.is_alive(), triton_key.cache_info().currsize)
    """)
    assert out == "False 1", out
