"""Per-process start-up work of the Triton path, moved off the first kernel call.

Before its first compile or cache lookup in a process, Triton hashes its own sources and its ~0.5 GB
``libtriton`` shared library (``triton_key()``, cached for the rest of the process): 0.31 s on the CPU
machine, 0.37 s of the 0.67 s first call of a cached bucket on the H200 (gem-kernels BENCHMARKS.md). No
disk cache removes it. :func:`prewarm_triton` computes it in a background thread, so a job that calls it at
start-up (before building its data and model) finds it done at its first kernel call. The hash of a large
buffer releases the GIL, so the thread costs the main thread little.

Fork safety: a ``fork`` while the thread walks Triton's packages (which imports them) could leave the
child with an import lock held by a thread that does not exist there. An ``os.register_at_fork`` hook makes
a fork wait for the thread to finish first (at most the hash's time).
"""

from __future__ import annotations

import os
import threading

from gem_kernels.dispatch import HAS_TRITON, triton_interpreted

__all__ = ["prewarm_triton"]

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _hash_triton() -> None:
    try:
        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # Triton before 3.3 kept it in the compiler module
            from triton.compiler.compiler import (
                triton_key,  # type: ignore[attr-defined,no-redef,unused-ignore]
            )
        triton_key()
    except Exception:  # best effort: the first kernel call computes it (and raises what is wrong)
        pass


def _wait_before_fork() -> None:
    thread = _thread
    if thread is not None:
        thread.join()


def prewarm_triton(*, wait: bool = False) -> bool:
    """Start computing Triton's per-process source hash in a daemon thread (once per process).

    Args:
        wait: block until it is done.

    Returns:
        True when the thread was started now or earlier; False where there is nothing to warm: Triton not
        installed, or its CPU interpreter (``TRITON_INTERPRET=1``), which compiles nothing.
    """
    global _thread
    if not HAS_TRITON or triton_interpreted():
        return False
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_hash_triton, name="gem-kernels-prewarm", daemon=True)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(before=_wait_before_fork)
            _thread.start()
        thread = _thread
    if wait:
        thread.join()
    return True
