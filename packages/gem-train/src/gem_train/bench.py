"""``gem-train bench``: examples/s, step time, MFU and peak memory of a config on the current device.

Batches are generated before timing and cycled, so the numbers are the training step's (forward, loss,
backward, clipping, both optimizers), not the data generator's; the generator's own rate is measured
separately and reported as ``data_batches_per_s`` (one process, one worker).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from typing import Any

import torch

from gem_train.compile import apply_compile
from gem_train.config import TrainConfig
from gem_train.mfu import device_peak_flops
from gem_train.model_factory import build_model
from gem_train.optim import build_optimizers
from gem_train.trainer import build_source, init_distributed, multitask_loss

__all__ = ["run_bench"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(
    cfg: TrainConfig, steps: int = 20, warmup: int = 5, distinct_batches: int = 4
) -> dict[str, Any]:
    """Time ``steps`` training steps after ``warmup`` untimed ones; return the measurements."""
    d = init_distributed(cfg.run.device, cfg.run.cpu_threads)
    device = d.device
    source = build_source(cfg)
    t0 = time.perf_counter()
    host = [source.get("train", i, cfg.data.batch_size) for i in range(distinct_batches)]
    data_rate = distinct_batches / (time.perf_counter() - t0)
    built = build_model(cfg.model, source.spec, device, cfg.run.seed, cfg.precision)
    model = built.model
    opts = build_optimizers(list(model.dense_parameters()), list(model.sparse_parameters()), cfg.optim)
    dense = list(model.dense_parameters())
    train_model = apply_compile(model) if cfg.train.compile else model
    use_bf16 = cfg.train.autocast == "bf16" or (cfg.train.autocast == "auto" and device.type == "cuda")
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    batches = [lb.batch.to(device) for lb in host]
    flops = [built.flops(lb.batch) for lb in host] if built.flops else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        with ctx():
            logits = train_model(batch)
        loss = multitask_loss(logits, batch, tuple(source.spec.tasks))
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(dense, cfg.optim.grad_clip)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    for i in range(warmup):
        step(i)
    _sync(device)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        step(i)
        _sync(device)
        times.append(time.perf_counter() - t)
    mean = statistics.fmean(times)
    peak = device_peak_flops(device, cfg.train.peak_flops)
    out: dict[str, Any] = {
        "config": cfg.run.name,
        "model": f"{cfg.model.arch}:{cfg.model.name}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "batch_size": cfg.data.batch_size,
        "autocast": "bf16" if use_bf16 else "fp32",
        "steps": steps,
        "step_time_ms_mean": 1e3 * mean,
        "step_time_ms_median": 1e3 * statistics.median(times),
        "examples_per_s": cfg.data.batch_size / mean,
        "data_batches_per_s": data_rate,
        "params_total": sum(p.numel() for p in model.parameters()),
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
