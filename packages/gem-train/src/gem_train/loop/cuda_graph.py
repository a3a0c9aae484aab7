"""The whole training step as one CUDA graph per bucket of jagged sizes (``train.cuda_graphs``, one CUDA
process).

The compiled step launches thousands of kernels one by one (per-layer graphs, the optimizers, clipping); on
base-h200 the GPU idles ~25% of a step waiting for them (gem-train BENCHMARKS.md). A CUDA graph replays
all of a step's kernels with one launch, but only for fixed shapes and fixed memory, and a batch's jagged
sizes change every step. :class:`GraphedSteps` therefore

1. learns a :class:`~gem_train.data.buckets.BucketLadder` from the first ``ladder_batches`` batches (run
   eagerly as usual), and pads every later batch to its bucket (:func:`~gem_train.data.buckets.pad_batch`:
   exact, dummy examples carry the padding);
2. runs a bucket's first ``warmup`` padded steps eagerly on a side stream (compilation, autotuning, the
   optimizers' lazy state), then captures :meth:`BuiltRun.device_step` on a padded batch of that bucket
   into a graph (one memory pool shared by all buckets: only one graph runs at a time, and each graph's
   outputs are copied out before the next replay), and replays it for that batch;
3. replays the bucket's graph for each later batch of the bucket after copying the padded batch into the
   graph's static input tensors; a batch that fits no bucket runs eagerly, unpadded.

What the graph holds and why it composes:

- the learning rate is a device tensor that the graph reads; each step's value is written into it before
  the replay (``set_lr`` fills tensor learning rates in place). AdamW must be fused (``capturable``: its
  step counters live on the device); it is switched to ``capturable`` here;
- gradient clipping (multi-tensor norms and scaling) and the non-finite skip (``found_inf``, computed in the
  graph and read by the optimizers on the device) are inside the graph; so is the row-wise Adagrad;
- the step's ``[loss, grad norm]`` and per-task losses are cloned out of the graph's memory after the replay,
  so a step left unread (``train.overlap_steps``) survives the next replay;
- data loading overlaps as before: batches arrive on the device one step ahead (``DevicePrefetcher``); the
  padding and the copies into the static inputs are a few small kernels before the replay;
- FP8 weight casts cached by gem-precision are refreshed by a host-side check that a replay does not
  run, so the cache is marked stale before each capture and the casts are part of the graph;
- autocast's cache of casted weights is off (``BuiltRun.autocast_cache``), as torch's CUDA-graph notes ask;
- before a capture the eager steps' cached memory is released (``empty_cache``) for the graph pool.

The CPU never uses graphs (there is nothing to capture): its steps, and resuming them, are unchanged.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gem_model import GemBatch
from gem_precision import invalidate_fp8_weights
from gem_train.data.buckets import BucketLadder, pad_batch, sequence_totals
from gem_train.loop.step import BuiltRun, PendingStep

__all__ = ["GraphStats", "GraphedSteps", "copy_batch_into", "make_capturable"]


def make_capturable(opt: torch.optim.Optimizer, lr: Tensor) -> None:
    """Switch a fused AdamW to ``capturable`` with the tensor learning rate ``lr`` shared by its groups."""
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        if not opt.defaults.get("fused"):
            raise ValueError(
                "train.cuda_graphs needs the fused AdamW (optim.adamw_impl = 'fused' or 'auto' on CUDA): its "
                "update runs inside the captured graph with its step counters on the device"
            )
        for group in opt.param_groups:
            group["capturable"] = True
            group["lr"] = lr
        opt.defaults["capturable"] = True


def copy_batch_into(dst: GemBatch, src: GemBatch) -> None:
    """Copy every tensor of ``src`` into ``dst`` (same shapes: one bucket), in place; host ints must agree."""
    pairs: list[tuple[Tensor, Tensor]] = [
        (dst.dense, src.dense), (dst.request_time, src.request_time), (dst.labels, src.labels),
        (dst.label_mask, src.label_mask), (dst.sparse.values(), src.sparse.values()),
        (dst.sparse.lengths(), src.sparse.lengths()),
    ]  # fmt: skip
    dw, sw = dst.sparse.weights_or_none(), src.sparse.weights_or_none()
    if dw is not None and sw is not None:
        pairs.append((dw, sw))
    for name, d in dst.sequences.items():
        s = src.sequences[name]
        if d.max_len != s.max_len:
            raise ValueError(f"copy_batch_into: max_len of {name!r} differs ({d.max_len} vs {s.max_len})")
        pairs += [(d.offsets, s.offsets), (d.item_ids, s.item_ids), (d.action_ids, s.action_ids),
                  (d.timestamps, s.timestamps)]  # fmt: skip
        if d.event_features is not None and s.event_features is not None:
            pairs.append((d.event_features, s.event_features))
    for d_t, s_t in pairs:
        if d_t.shape != s_t.shape:
            raise ValueError(f"copy_batch_into: shapes differ ({tuple(d_t.shape)} vs {tuple(s_t.shape)})")
        d_t.copy_(s_t, non_blocking=True)


@dataclass
class GraphStats:
    """What the graphed steps did: steps by path, captures and their cost, padding."""

    eager_steps: int = 0  # before the ladder existed, in warm-up, and batches no bucket holds
    overflow_steps: int = 0  # of those, batches no bucket holds
    replays: int = 0
    captures: int = 0
    capture_s: float = 0.0
    pool_bytes: int = 0  # memory the captures reserved (the shared graph pool)
    real_events: int = 0
    padded_events: int = 0
    per_bucket: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["padded_fraction"] = 1 - self.real_events / self.padded_events if self.padded_events else 0.0
        return d


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: GemBatch  # the static inputs
    values: Tensor
    per_task: dict[str, Tensor]


class GraphedSteps:
    """The training steps of ``run`` through CUDA graphs (see the module docstring).

    Args:
        run: a one-process CUDA run whose optimizers skip on the device (``run.can_queue_steps``).
        ladder: the buckets; None learns them from the first ``ladder_batches`` batches.
        warmup: eager padded steps per bucket before its capture (0 only where every bucket's shapes already
            ran: compiled, autotuned, the optimizers' state made).
        growth: the ladder's capacity ratio when it is learned.
    """

    def __init__(
        self,
        run: BuiltRun,
        ladder: BucketLadder | None = None,
        *,
        warmup: int = 1,
        ladder_batches: int = 8,
        growth: float = 1.08,
    ) -> None:
        self._check_device(run)
        if run.dist.world_size != 1:
            raise ValueError("train.cuda_graphs supports one process (collectives are not captured yet)")
        if not run.can_queue_steps:
            raise ValueError("train.cuda_graphs needs optimizers that skip non-finite steps on the device")
        self.run = run
        self.ladder = ladder
        self.warmup = max(0, warmup)
        self.ladder_batches = ladder_batches
        self.growth = growth
        self.stats = GraphStats()
        self._seen_totals: list[dict[str, int]] = []
        self._warm: Counter[tuple[int, ...]] = Counter()
        self._graphs: dict[tuple[int, ...], _Graph] = {}
        self._pool, self._side = self._device_handles(run)
        self._lr = torch.tensor(run.cfg.optim.lr, dtype=torch.float32, device=run.device)
        for opt in run.optimizers:
            make_capturable(opt, self._lr)
        run.autocast_cache = False

    # -- the CUDA-specific parts (a CPU test replaces them to check the bookkeeping) ------------------------

    def _check_device(self, run: BuiltRun) -> None:
        if run.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (train.cuda_graphs is ignored on the CPU)")

    def _device_handles(self, run: BuiltRun) -> tuple[Any, Any]:
        """The graph memory pool the buckets share and the warm-up side stream."""
        return torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=run.device)

    def queue_step(self, batch: GemBatch, step: int) -> PendingStep:
        """Step ``step`` on ``batch`` (on the device), unread: replayed from its bucket's graph when there is
        one (captured now if the bucket is warm), else eager."""
        run = self.run
        run.set_step_lr(step)  # into the tensor the graphs read
        totals = sequence_totals(batch)
        if self.ladder is None:
            self._seen_totals.append(totals)
            if len(self._seen_totals) >= self.ladder_batches:
                self.ladder = self._learn_ladder(batch.batch_size)
            return self._eager(batch, padded=False)
        bucket = self.ladder.bucket(totals, batch.batch_size)
        if bucket is None:
            self.stats.overflow_steps += 1
            return self._eager(batch, padded=False)
        padded = pad_batch(batch, self.ladder, bucket)
        self.stats.real_events += sum(totals.values())
        self.stats.padded_events += sum(bucket)
        key = "x".join(map(str, bucket))
        self.stats.per_bucket[key] = self.stats.per_bucket.get(key, 0) + 1
        g = self._graphs.get(bucket)
        if g is None:
            if self._warm[bucket] < self.warmup:
                self._warm[bucket] += 1
                return self._eager(padded, padded=True)
            g = self._capture(padded)  # the static inputs hold this batch already
            self._graphs[bucket] = g
        else:
            copy_batch_into(g.batch, padded)
        g.graph.replay()
        self.stats.replays += 1
        # The replay stepped the optimizers without their Python hooks: an eager forward (evaluation, an
        # unbucketed batch) must recast the FP8 weights.
        invalidate_fp8_weights(self.run.model)
        return PendingStep(g.values.clone(), {k: v.clone() for k, v in g.per_task.items()})

    def _learn_ladder(self, batch_size: int) -> BucketLadder:
        return BucketLadder.from_sample(self.run.spec, batch_size, self._seen_totals, growth=self.growth)

    def _eager(self, batch: GemBatch, *, padded: bool) -> PendingStep:
        """An eager step; padded warm-up steps run on a side stream, as graph capture wants."""
        self.stats.eager_steps += 1
        if not padded or self._side is None:
            values, per_task = self.run.device_step(batch)
            return PendingStep(values, per_task)
        cur = torch.cuda.current_stream(self.run.device)
        self._side.wait_stream(cur)
        with torch.cuda.stream(self._side):
            values, per_task = self.run.device_step(batch)
        cur.wait_stream(self._side)
        return PendingStep(values, per_task)

    def _capture(self, batch: GemBatch) -> _Graph:
        torch.cuda.synchronize(self.run.device)
        torch.cuda.empty_cache()  # the eager steps' cached blocks go back, for the graph pool to take
        reserved = torch.cuda.memory_reserved(self.run.device)
        t0 = time.perf_counter()
        # Host-side decisions a replay would not repeat: make the FP8 weight casts part of the graph.
        invalidate_fp8_weights(self.run.model)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (the loader's pinning, a prefetcher) may use CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            values, per_task = self.run.device_step(batch)
        torch.cuda.synchronize(self.run.device)
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        self.stats.pool_bytes += torch.cuda.memory_reserved(self.run.device) - reserved
        return _Graph(graph, batch, values, per_task)
