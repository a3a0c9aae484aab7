"""``gem-train bench``: examples/s, step time, MFU and peak memory of a config on the current device.

It times the trainer's own training step (:meth:`gem_train.loop.step.BuiltRun.train_step`: learning rate,
forward, loss, backward, clipping, both optimizers, and the step's one host sync, read one step late where the
trainer does so too), through the trainer's own :class:`gem_train.loop.step.StepPipeline`, on the run that
:func:`gem_train.loop.build.build_run` builds for training. Batches are generated before timing and cycled, so
the numbers are the step's, not the data generator's; the generator's own rate is measured separately and
reported as ``data_batches_per_s`` (one process, one worker).
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch

from gem_train.config import TrainConfig
from gem_train.loop.build import build_run
from gem_train.loop.step import StepPipeline

__all__ = ["run_bench"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(
    cfg: TrainConfig, steps: int = 20, warmup: int = 5, distinct_batches: int = 4
) -> dict[str, Any]:
    """Time ``steps`` training steps after ``warmup`` untimed ones; return the measurements."""
    run = build_run(cfg)
    device = run.device
    t0 = time.perf_counter()
    host = [run.source.get("train", i, cfg.data.batch_size) for i in range(distinct_batches)]
    data_rate = distinct_batches / (time.perf_counter() - t0)
    batches = [lb.batch.to(device) for lb in host]
    flops = [run.built.flops(lb.batch) for lb in host] if run.built.flops else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # As the trainer steps (StepPipeline): where the optimizers skip non-finite steps on the device, step
    # k's loss is read after step k + 1 is queued, so the host never holds the GPU up between steps.
    pipeline = StepPipeline(run, cfg.train.overlap_steps)

    def step(i: int) -> None:
        pipeline.push(batches[i % len(batches)], i, read=False)

    for i in range(warmup):
        step(i)
    _sync(device)
    times = []
    t_all = t = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
        now = time.perf_counter()
        times.append(now - t)  # per call; with overlap each is one step behind the device at most
        t = now
    pipeline.flush()
    _sync(device)
    mean = (time.perf_counter() - t_all) / steps
    peak = run.peak_flops
    out: dict[str, Any] = {
        "config": cfg.run.name,
        "model": f"{cfg.model.arch}:{cfg.model.name}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "batch_size": cfg.data.batch_size,
        "world_size": run.dist.world_size,
        "autocast": "bf16" if run.autocast_dtype == torch.bfloat16 else "fp32",
        "steps": steps,
        "step_time_ms_mean": 1e3 * mean,
        "step_time_ms_median": 1e3 * statistics.median(times),
        "examples_per_s": cfg.data.batch_size * run.dist.world_size / mean,
        "data_batches_per_s": data_rate,
        "params_total": sum(p.numel() for p in run.model.parameters()),
    }
    if flops is not None:
        f = statistics.fmean(flops)
        out["model_gflop_per_step"] = f / 1e9
        out["model_tflops_per_s"] = f / mean / 1e12
        out["mfu"] = f / mean / peak if peak else None
        out["peak_flops"] = peak
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out
