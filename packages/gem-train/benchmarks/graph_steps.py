"""The training step replayed as CUDA graphs over bucketed jagged sizes, against the same step launched
kernel by kernel (``bench_speed.py --cuda-graphs``; ``gem_train.loop.cuda_graph``).

On the run ``bench_speed.py`` has just measured (compiled, warm), with its distinct batches:

1. a :class:`~gem_train.data.buckets.BucketLadder` from those batches (``BucketLadder.from_sample``) and the
   padding it costs on them;
2. ``eager_padded``: the trainer's step (``BuiltRun.queue_step``) on the padded batches, kernel by kernel,
   with the optimizers already switched to ``capturable`` (the padding's own cost, apart from the graphs');
3. ``graphs``: :class:`~gem_train.loop.cuda_graph.GraphedSteps` on the unpadded batches (it pads, copies
   into the static inputs and replays): warm-up (one eager step per bucket, then its capture), then the
   timed steps; captures, their wall time and the memory they reserved.

Every rate is against the unpadded step measured before by ``bench_speed.py`` (``step_ms_mean``), and the
model TFLOP/s count the real (unpadded) batches only.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from gem_train.data.buckets import BucketLadder, pad_batch, padded_fraction, sequence_totals
from gem_train.loop.cuda_graph import GraphedSteps


def _timed(fn: Any, n: int, device: torch.device) -> float:
    """Milliseconds per call of ``fn(i)`` over ``n`` calls (one sync at the end)."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - t0) / n


def measure_cuda_graphs(
    run: Any, batches: list[Any], flops: list[int] | None, steps: int, device: torch.device
) -> dict[str, Any]:
    totals = [sequence_totals(b) for b in batches]
    ladder = BucketLadder.from_sample(run.spec, run.cfg.data.batch_size, totals)
    out: dict[str, Any] = {
        "buckets": {k: list(v) for k, v in ladder.seq_capacities.items()},
        "batch_capacity": ladder.batch_capacity,
        "padding_on_these_batches": padded_fraction(ladder, batches),
    }
    # Every bucket's shapes run eagerly below first (compiled, tuned, optimizer state made): no warm-up.
    graphs = GraphedSteps(run, ladder, warmup=0)  # switches AdamW to capturable, a tensor learning rate
    padded = [pad_batch(b, ladder, ladder.bucket(sequence_totals(b), b.batch_size)) for b in batches]
    n = len(batches)
    base = 10_000  # step numbers apart from the benchmark's (the learning-rate schedule only)
    for i, p in enumerate(padded):  # new sizes: no recompile (dynamic), but kernels may tune once
        run.queue_step(p, base + i)
    out["eager_padded_ms"] = _timed(lambda i: run.queue_step(padded[i % n], base + i), steps, device)
    # Host syncs in one eager padded step (a capture fails on any): torch's sync debug mode counts them.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run.queue_step(padded[0], base)
            torch.cuda.synchronize(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    out["host_syncs_in_a_padded_step"] = len(syncs)
    out["host_sync_messages"] = sorted(set(syncs))[:10]
    t0 = time.perf_counter()
    pending = [graphs.queue_step(batches[i % n], base + i) for i in range(n)]  # captures, then replays
    torch.cuda.synchronize(device)
    out["graph_warmup_s"] = time.perf_counter() - t0
    out["graph_warmup_finite"] = all(p.result().finite for p in pending)
    before = graphs.stats.replays
    out["graph_ms"] = _timed(lambda i: graphs.queue_step(batches[i % n], base + n + i), steps, device)
    stats = graphs.stats.as_dict()
    out["graph_stats"] = stats
    out["timed_steps_replayed"] = stats["replays"] - before
    out["graph_pool_gib"] = stats["pool_bytes"] / 2**30
    out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if flops:
        f = statistics.fmean(flops)
        out["model_tflops_per_s_graph"] = f / (out["graph_ms"] * 1e-3) / 1e12
        out["mfu_datasheet_graph"] = f / (out["graph_ms"] * 1e-3) / run.peak_flops if run.peak_flops else None
    return out
