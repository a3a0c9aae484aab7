"""Helpers shared by the benchmark scripts: timing, the HBM copy rate, batches of uniform lengths, the
common command-line options and the JSON results file.

The scripts are run as files (``python packages/gem-kernels/benchmarks/bench_x.py``), so this directory
is on ``sys.path`` and they import this module as ``common``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch


def timeit(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on the GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_rate(device: str, numel: int, time_ms: Callable[[Callable[[], object]], float]) -> tuple[float, int]:
    """Milliseconds (timed by ``time_ms``) and bytes (read + written) of a device-to-device copy of
    ``numel`` bf16 elements."""
    x = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    return time_ms(lambda: y.copy_(x)), 2 * x.numel() * 2


def uniform_lengths(
    batch: int, max_len: int, valid: float, generator: torch.Generator, offsets_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` lengths uniform in ``[max_len * (2 * valid - 1), max_len]`` (mean ``valid * max_len``)
    drawn from ``generator``, and their ``[batch + 1]`` offsets (CPU tensors)."""
    low = round(max_len * (2 * valid - 1))
    lengths = torch.randint(low, max_len + 1, (batch,), generator=generator)
    offsets = torch.zeros(batch + 1, dtype=offsets_dtype)
    offsets[1:] = lengths.cumsum(0)
    return lengths, offsets


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """``--batch``, ``--max-len``, ``--valid`` (defaults: GEM's benchmark shape, lengths in [800, 2000])."""
    parser.add_argument("--batch", type=int, default=1152)
    parser.add_argument("--max-len", type=int, default=2000)
    parser.add_argument("--valid", type=float, default=0.7, help="mean length / max length")


def add_run_args(parser: argparse.ArgumentParser, out_name: str) -> None:
    """``--iters``, ``--copy-mib``, ``--small`` and ``--out`` (default ``$OUT/<out_name>``)."""
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--copy-mib", type=int, default=4096)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), out_name))


def write_results(
    path: str, rows: list[dict], copy_tbs: float, tokens: int, args: argparse.Namespace
) -> None:
    """The rows and the run's settings as JSON (nothing when ``path`` is empty)."""
    if path:
        with open(path, "w") as f:
            json.dump({"rows": rows, "copy_TBs": copy_tbs, "tokens": tokens, "args": vars(args)}, f, indent=1)
