"""Where the training loop's time goes between the GPU's kernels: a profiler window over a few loop steps.

:class:`LoopProfiler` records ``torch.profiler`` (CPU ops of every thread, CUDA kernels) from the start of
step ``at`` to the end of step ``at + steps - 1`` of the trainer's own loop, and :func:`summarize` turns it
into what tells a host-bound loop from a GPU-bound one:

- ``wall_ms_per_step``: the window's wall time per step;
- ``gpu_busy_ms_per_step``: the union of kernel intervals per step (overlapping kernels counted once), and
  ``gpu_idle_share`` = 1 - busy / wall: the time the GPU waited for the host;
- ``gaps``: the longest GPU idle intervals, each with the host ops of the main thread that ran during it
  (top-level ones, by overlap);
- ``self_cpu_ms_by_thread``: self CPU time per thread (the main thread launches; a loader or pinning
  thread competing for the GIL shows here);
- ``top_cpu_ops``: the ops with the most self CPU time, and ``top_kernels`` by GPU time;
- ``host``: :func:`host_breakdown`, what each host thread spends its time on.

Used by ``quality_run.py --profile-at S --profile-steps N`` (writes ``<recipe>/loop_profile.json``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.autograd import DeviceType


class LoopProfiler:
    """Starts a profiler before step ``at`` (1-based, as the trainer counts finished steps) and stops it
    after step ``at + steps - 1``; :attr:`summary` holds :func:`summarize`'s result then."""

    def __init__(self, at: int, steps: int, cuda: bool) -> None:
        self.at, self.steps, self.cuda = at, steps, cuda
        self.summary: dict[str, Any] | None = None
        self._prof: torch.profiler.profile | None = None

    def before(self, step: int) -> None:
        """Call before running 1-based step ``step``."""
        if step == self.at and self._prof is None and self.summary is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()

    def after(self, step: int) -> None:
        """Call after step ``step`` returned (its loss read on the host: the GPU work of it is done)."""
        if self._prof is not None and step == self.at + self.steps - 1:
            if self.cuda:
                torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            self.summary = summarize(self._prof, self.steps)
            self._prof = None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


# CUDA runtime/driver calls that enqueue work on the GPU (one per kernel launch, copy or memset).
LAUNCH_APIS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch",
})  # fmt: skip


def host_region(name: str) -> str:
    """The kind of a top-level host event (what a host thread is doing when it is not waiting)."""
    if name.startswith(("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph")):
        return "compiled graphs (inductor wrappers, guards)"
    if name.startswith(("gem_kernels::", "gem_precision::")):
        return "gem custom ops (eager)"
    if name.startswith("Optimizer."):
        return "optimizer"
    if name.startswith("autograd::engine"):
        return "autograd engine (eager backward nodes)"
    if name.startswith(("fbgemm::", "torchrec", "## ")) or "Embedding" in name:
        return "embeddings (TorchRec / fbgemm)"
    if name in LAUNCH_APIS or name.startswith(("cuda", "cu")):
        return "CUDA API"
    if name.startswith("aten::"):
        return "eager aten ops"
    return "other"


def host_breakdown(events: list[Any], steps: int, main_thread: int | None, top: int = 12) -> dict[str, Any]:
    """Per host thread (``main``, ``autograd`` = the thread running the autograd engine's nodes, others by
    id): self CPU ms per step, its top-level events' wall ms per step by :func:`host_region` and by name,
    and the launches it issued (``LAUNCH_APIS``: count and CPU ms per step). Launch counts on the CPU are 0.

    ``events``: ``prof.events()`` of a ``torch.profiler`` window over ``steps`` steps."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    autograd_threads = {e.thread for e in cpu if e.name.startswith("autograd::engine::evaluate_function")}
    autograd_threads.discard(main_thread)  # a CPU run's backward may run on the main thread

    def label(t: int) -> str:
        if t == main_thread:
            return "main"
        return "autograd" if t in autograd_threads else f"thread {t}"

    per: dict[str, dict[str, Any]] = {}
    for e in cpu:
        row = per.setdefault(label(e.thread), {
            "self_cpu_ms": 0.0, "launches": 0, "launch_api_ms": 0.0,
            "by_region": defaultdict(float), "by_top_level_op": defaultdict(float),
        })  # fmt: skip
        row["self_cpu_ms"] += e.self_cpu_time_total / 1e3
        if e.name in LAUNCH_APIS:
            row["launches"] += 1
            row["launch_api_ms"] += (e.time_range.end - e.time_range.start) / 1e3
        if e.cpu_parent is None:
            ms = (e.time_range.end - e.time_range.start) / 1e3
            row["by_region"][host_region(e.name)] += ms
            row["by_top_level_op"][e.name[:100]] += ms
    out: dict[str, Any] = {}
    for name, row in sorted(per.items(), key=lambda kv: -kv[1]["self_cpu_ms"])[:6]:
        out[name] = {
            "self_cpu_ms_per_step": row["self_cpu_ms"] / steps,
            "launches_per_step": row["launches"] / steps,
            "launch_api_ms_per_step": row["launch_api_ms"] / steps,
            "top_level_ms_per_step_by_region": {
                k: v / steps for k, v in sorted(row["by_region"].items(), key=lambda kv: -kv[1])
            },
            "top_level_ms_per_step_by_op": {
                k: v / steps for k, v in sorted(row["by_top_level_op"].items(), key=lambda kv: -kv[1])[:top]
            },
        }
    return out


def main_thread_of(events: list[Any]) -> int | None:
    """The thread with the most CPU events (the one that runs the step and launches the forward)."""
    counts: dict[int, int] = defaultdict(int)
    for e in events:
        if e.device_type == DeviceType.CPU:
            counts[e.thread] += 1
    return max(counts, key=lambda t: counts[t]) if counts else None


def summarize(prof: torch.profiler.profile, steps: int, top: int = 15) -> dict[str, Any]:
    """The loop-level numbers described in the module docstring (times in ms)."""
    events = list(prof.events())
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    if not cpu:
        return {"steps": steps, "error": "no CPU events recorded"}
    t0 = min(e.time_range.start for e in cpu)
    t1 = max(e.time_range.end for e in cpu)
    wall = (t1 - t0) / 1e3
    busy_iv = _union([(e.time_range.start, e.time_range.end) for e in kernels])
    busy = sum(b - a for a, b in busy_iv) / 1e3
    # Idle gaps between kernels inside the window, the longest first.
    gaps = [(busy_iv[i][1], busy_iv[i + 1][0]) for i in range(len(busy_iv) - 1)]
    gaps.sort(key=lambda g: g[1] - g[0], reverse=True)
    threads: dict[int, float] = defaultdict(float)
    for e in cpu:
        threads[e.thread] += e.self_cpu_time_total / 1e3
    main_thread = main_thread_of(events)
    top_level = [e for e in cpu if e.thread == main_thread and e.cpu_parent is None]
    gap_rows = []
    for a, b in gaps[:10]:
        overlap: dict[str, float] = defaultdict(float)
        for e in top_level:
            o = min(b, e.time_range.end) - max(a, e.time_range.start)
            if o > 0:
                overlap[e.name] += o / 1e3
        gap_rows.append({
            "ms": (b - a) / 1e3,
            "main_thread_ops": dict(sorted(overlap.items(), key=lambda kv: -kv[1])[:5]),
        })  # fmt: skip
    by_op: dict[str, float] = defaultdict(float)
    for e in cpu:
        by_op[e.name] += e.self_cpu_time_total / 1e3
    by_kernel: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kernel[e.name[:120]] += (e.time_range.end - e.time_range.start) / 1e3
    return {
        "steps": steps,
        "wall_ms_per_step": wall / steps,
        "gpu_busy_ms_per_step": busy / steps,
        "gpu_idle_share": 1 - busy / wall if wall > 0 else None,
        "gaps_over_1ms_per_step": sum(1 for a, b in gaps if b - a > 1e3) / steps,
        "idle_in_gaps_over_1ms_ms_per_step": sum((b - a) / 1e3 for a, b in gaps if b - a > 1e3) / steps,
        "gaps": gap_rows,
        "self_cpu_ms_by_thread": {
            ("main" if t == main_thread else str(t)): v / steps
            for t, v in sorted(threads.items(), key=lambda kv: -kv[1])[:8]
        },
        "top_cpu_ops_ms_per_step": {
            k: v / steps for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
        },
        "top_kernels_ms_per_step": {
            k: v / steps for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
        },
        "host": host_breakdown(events, steps, main_thread),
    }
