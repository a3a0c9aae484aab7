"""``gem-train predict``: stream a dataset through a trained model and write its predictions to Parquet.

Each split is read once in a fixed order (:func:`gem_train.transfer.rows.split_plan`) and cut into shards of
``K`` consecutive batches (about ``shard_rows`` rows at most, and at least :data:`MIN_SHARDS` shards where
each keeps :data:`MIN_SHARD_ROWS` rows); shard ``j`` is written by rank ``j mod W`` (one process, or
``torchrun``), with every row's keys, each task's probability and logit and, with ``embeddings``, the model's
representation (:mod:`gem_train.transfer.representation`). Shards are atomic and name the run they belong to
(:mod:`gem_train.transfer.prediction_files`), so a rerun after a crash writes only the missing ones; rank 0
writes the manifest once every shard exists. The model runs as it was evaluated in training: its precision
recipe, and bf16 autocast where ``train.autocast`` gives it (CUDA by default), logits read in fp32. On the
CPU, freed host memory stays in the heap (:mod:`gem_train.transfer.heap`: ~1.25x the forward's rate). Batches
are forwarded together, :data:`MIN_FORWARD_ROWS` rows at least (a shard's last forward may be shorter); on
CUDA the next forward is launched before the previous one's outputs are read (:func:`forwards_in_flight`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm.auto import tqdm

from gem_model import GemBatch
from gem_train.config import TrainConfig, config_to_dict
from gem_train.data.balance import concat_batches
from gem_train.loop.distributed import all_gather_object
from gem_train.transfer.heap import keep_freed_memory
from gem_train.transfer.prediction_files import (
    PredictionFilesError,
    remove_temporaries,
    shard_columns,
    shard_info,
    shard_name,
    write_manifest,
    write_shard,
)
from gem_train.transfer.representation import RepresentationCapture
from gem_train.transfer.rows import SplitPlan, fingerprint, join_columns, split_plan

__all__ = ["InFlightForward", "PredictResult", "launch_forward", "run_predict"]

SHARD_ROWS = 65_536  # rows per shard at most (about): one shard is what a rank holds in memory at once
# A split is cut into at least this many shards where its shards keep MIN_SHARD_ROWS rows (about): shards
# are the unit of work of a torchrun's ranks, so one shard of a 65,536-row split would leave every rank but
# one idle, while each shard costs a file, its fsync and its rename (~7 ms). The layout depends on the split
# alone, never on the world size, so a rerun under another world size finds its shards.
MIN_SHARDS = 16
MIN_SHARD_ROWS = 8_192
# Rows of one forward at least (consecutive batches of a shard concatenated): the per-op and per-group costs
# of a CPU forward spread over more rows. GEM tiny's forward on one core of the 2-core CPU machine, examples/s
# by forward rows (interleaved in one process, medians of 8 rounds): 256 -> 7,806; 512 -> 9,056;
# 1,024 -> 9,795; 2,048 -> 10,543; 4,096 -> 10,383.
MIN_FORWARD_ROWS = 2048


@dataclass
class PredictResult:
    """What :func:`run_predict` did: rows per split written (or found complete), the time and the rate of
    the rows predicted now (every rank together)."""

    out: Path
    rows: dict[str, int]
    predicted_rows: int
    seconds: float
    examples_per_s: float
    manifest: dict[str, Any]


@dataclass
class InFlightForward:
    """A forward enqueued on the device, its outputs on their way to the host.

    On CUDA the logits (and representation) are copied device-to-host without blocking into page-locked
    memory and ``ready`` marks the copy's end on the stream, so the host can build and launch the next
    forward while this one runs; :meth:`wait` blocks until the host copies are valid. On the CPU the
    outputs are ready at once (``ready`` is None).
    """

    logits: torch.Tensor
    rep: torch.Tensor | None
    ready: torch.cuda.Event | None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits [B, T] float32, representation [B, D] float32 or None)``, on the host."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.logits, self.rep


@torch.inference_mode()
def launch_forward(
    model: nn.Module,
    batch: GemBatch,
    tasks: tuple[str, ...],
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    capture: RepresentationCapture | None = None,
) -> InFlightForward:
    """Enqueue ``model``'s eval-mode forward of ``batch`` and the copy of its logits (and representation)
    to the host; nothing waits for the device (see :class:`InFlightForward`). ``.wait()`` on the result gives
    ``(logits [B, T] float32, representation [B, D] float32 or None)`` on the host."""
    ctx = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    if capture is not None:
        capture.enabled = True
    try:
        with ctx:
            out = model(batch.to(device, non_blocking=True))
        logits = torch.stack([out[t].float() for t in tasks], 1)
        rep = capture.take().float() if capture is not None else None
    finally:
        if capture is not None:
            capture.enabled = False
    if device.type != "cuda":
        return InFlightForward(logits.cpu(), rep.cpu() if rep is not None else None, None)
    # A non-blocking device-to-host copy lands in page-locked memory: valid once the event has passed.
    host_logits = logits.to("cpu", non_blocking=True)
    host_rep = rep.to("cpu", non_blocking=True) if rep is not None else None
    ready = torch.cuda.Event()
    ready.record()
    return InFlightForward(host_logits, host_rep, ready)


def forwards_in_flight(device: torch.device) -> int:
    """Forwards predict keeps enqueued while the host goes on: on CUDA one, so the host files the previous
    forward's rows, writes its shard and takes the next batch from the loader (its page-locked copy to the
    device included) while the device runs this one; on the CPU none (the host is the device)."""
    return 1 if device.type == "cuda" else 0


def _as_is(item: Any) -> Any:
    return item


class _ShardBatches(IterableDataset):
    """``(split, shard, batch number, GemBatch, keys)`` of the pending shards; loader worker ``w`` of ``n``
    makes every ``n``-th shard, in order."""

    def __init__(self, plans: dict[str, SplitPlan], shards: list[tuple[str, int, int, int]]) -> None:
        super().__init__()
        self.plans, self.shards = plans, shards

    def __iter__(self) -> Iterator[tuple[str, int, int, GemBatch, dict[str, np.ndarray]]]:
        info = get_worker_info()
        worker, n = (0, 1) if info is None else (info.id, info.num_workers)
        for split, shard, lo, hi in self.shards[worker::n]:
            for b, (batch, keys) in enumerate(self.plans[split].batches(lo, hi)):
                yield split, shard, lo + b, batch, keys


@dataclass
class _Shard:
    split: str
    index: int
    lo: int
    hi: int
    meta: dict[str, Any]
    parts: list[tuple[int, dict[str, np.ndarray], np.ndarray | None]]
    pending: list[tuple[int, GemBatch, dict[str, np.ndarray]]]
    received: int = 0  # batches handed to this shard by the loader (pending, in flight or done)

    @property
    def done(self) -> bool:
        return len(self.parts) == self.hi - self.lo


def _identity(cfg: TrainConfig, run: Any, ckpt: Path, step: int, embeddings: bool) -> dict[str, Any]:
    return {
        "checkpoint": str(ckpt),
        "step": step,
        "tasks": list(run.tasks),
        "embeddings": embeddings,
        "data": fingerprint(cfg, run.source),
        "key_columns": join_columns(run.source),
    }


def _batches_per_shard(plan: SplitPlan, shard_rows: int) -> int:
    """``K``, the batches of one shard of ``plan``'s split: at most ``shard_rows`` rows (about), at least
    :data:`MIN_SHARDS` shards where each keeps :data:`MIN_SHARD_ROWS` rows; never fewer than one batch."""
    per_shard = max(-(-plan.num_batches // MIN_SHARDS), MIN_SHARD_ROWS // plan.batch_size)
    return max(1, min(shard_rows // plan.batch_size, per_shard))


def _plan_shards(
    out: Path, plans: dict[str, SplitPlan], shard_rows: int, identity: dict[str, Any], rank: int, world: int
) -> tuple[list[_Shard], dict[str, int]]:
    """This rank's shards still to write, and the rows of the complete ones (checked to be this run's)."""
    todo: list[_Shard] = []
    found: dict[str, int] = {}
    for split, plan in plans.items():
        k = _batches_per_shard(plan, shard_rows)
        n_shards = -(-plan.num_batches // k)
        mine = list(range(rank, n_shards, world))
        remove_temporaries(out, [shard_name(split, j) for j in mine])
        for j in mine:
            lo, hi = j * k, min((j + 1) * k, plan.num_batches)
            meta = {**identity, "split": split, "shard": j, "first_batch": lo, "batches": hi - lo,
                    "batch_size": plan.batch_size}  # fmt: skip
            path = out / shard_name(split, j)
            if path.exists():
                info = shard_info(path)
                if info is None:
                    raise PredictionFilesError(f"{path}: not a readable gem-train predict shard; remove it")
                diff = [key for key in meta if info.get(key) != meta[key]]
                if diff:
                    raise PredictionFilesError(
                        f"{path} belongs to another predict run (it differs in {', '.join(diff)}): use "
                        "another --out directory or remove this one"
                    )
                found[split] = found.get(split, 0) + int(info["rows"])
                continue
            todo.append(_Shard(split, j, lo, hi, meta, [], []))
    return todo, found


@dataclass
class _Launched:
    """One forward of a shard's consecutive batches, in flight."""

    shard: _Shard
    parts: list[tuple[int, GemBatch, dict[str, np.ndarray]]]
    outputs: InFlightForward


def _launch(shard: _Shard, model: nn.Module, run: Any, capture: RepresentationCapture | None) -> _Launched:
    """Enqueue the forward of the shard's buffered batches as one."""
    parts = shard.pending
    shard.pending = []
    batch = concat_batches([b for _, b, _ in parts])
    outputs = launch_forward(model, batch, run.tasks, run.device, run.autocast_dtype, capture)
    return _Launched(shard, parts, outputs)


def _finish(launched: _Launched, tasks: tuple[str, ...]) -> int:
    """Wait for a launched forward and file its batches' columns into its shard; returns the rows."""
    logits, rep = launched.outputs.wait()
    start = 0
    for number, b, keys in launched.parts:
        n = b.batch_size
        lg = logits[start : start + n].numpy()
        cols = dict(keys)
        for j, task in enumerate(tasks):
            cols[f"{task}_prob"] = (1.0 / (1.0 + np.exp(-lg[:, j].astype(np.float64)))).astype(np.float32)
            cols[f"{task}_logit"] = lg[:, j].astype(np.float32)
        emb = rep[start : start + n].numpy() if rep is not None else None
        launched.shard.parts.append((number, cols, emb))
        start += n
    return start


def _write(out: Path, shard: _Shard) -> dict[str, Any]:
    parts = sorted(shard.parts, key=lambda p: p[0])
    names = list(parts[0][1])
    cols = {k: np.concatenate([p[1][k] for p in parts]) for k in names}
    emb = np.concatenate([p[2] for p in parts]) if parts[0][2] is not None else None
    meta = dict(shard.meta)
    if emb is not None:  # per-dimension sums, so the manifest can say each split's mean and std
        e = emb.astype(np.float64)
        meta["embedding_sum"] = e.sum(0).tolist()
        meta["embedding_sumsq"] = np.square(e).sum(0).tolist()
    if not all(np.isfinite(cols[k]).all() for k in names if k.endswith("_logit")):
        raise FloatingPointError(f"non-finite predictions in {shard.split} shard {shard.index}")
    write_shard(out / shard_name(shard.split, shard.index), shard_columns(cols, emb), meta)
    return meta


def _manifest(
    out: Path, cfg: TrainConfig, run: Any, identity: dict[str, Any], plans: dict[str, SplitPlan],
    shard_rows: int, width: int, what: str,
) -> dict[str, Any]:  # fmt: skip
    """Rank 0: every shard of every split present and this run's -> the manifest (written atomically)."""
    splits: dict[str, Any] = {}
    for split, plan in plans.items():
        k = _batches_per_shard(plan, shard_rows)
        shards, rows = [], 0
        s1, s2 = np.zeros(width), np.zeros(width)
        for j in range(-(-plan.num_batches // k)):
            path = out / shard_name(split, j)
            info = shard_info(path)
            if info is None or any(info.get(key) != identity[key] for key in identity):
                raise PredictionFilesError(f"{path}: missing or of another run after every rank finished")
            shards.append({"file": path.name, "first_batch": info["first_batch"], "batches": info["batches"],
                           "rows": info["rows"], "bytes": info["bytes"]})  # fmt: skip
            rows += info["rows"]
            if width:
                s1 += np.asarray(info["embedding_sum"])
                s2 += np.asarray(info["embedding_sumsq"])
        entry: dict[str, Any] = {"rows": rows, "batches": plan.num_batches, "batch_size": plan.batch_size,
                                 "shards": shards}  # fmt: skip
        if width and rows:
            mean = s1 / rows
            entry["embedding_mean"] = mean.tolist()
            entry["embedding_std"] = np.sqrt(np.maximum(s2 / rows - mean**2, 0.0)).tolist()
        splits[split] = entry
    manifest = {
        **identity,
        "autocast": str(run.autocast_dtype).replace("torch.", "") if run.autocast_dtype else "fp32",
        "precision_recipe": cfg.precision.recipe,
        "embedding": {"dim": width, "tensor": what} if width else None,
        "columns": [*identity["key_columns"], *[f"{t}_{s}" for t in run.tasks for s in ("prob", "logit")]],
        "config": config_to_dict(cfg),
        "splits": splits,
    }
    write_manifest(out, manifest)
    return manifest


def run_predict(
    cfg: TrainConfig,
    checkpoint: str | Path,
    out: str | Path,
    splits: tuple[str, ...] = ("train", "valid", "test"),
    *,
    embeddings: bool = False,
    train_batches: int = 0,
    shard_rows: int = SHARD_ROWS,
    progress: bool = True,
    compile: bool = False,
) -> PredictResult:
    """Predict every row of ``splits`` with the model of ``checkpoint`` (its config is ``cfg``) into
    ``out`` (see the module docstring). Splits the dataset does not have (an empty validation split) are
    skipped. Every rank of a ``torchrun`` calls it; rank 0 writes the manifest and every rank returns it.
    ``compile``: the model's layers compiled by :func:`gem_parallel.compile_layers` (dynamic shapes; on the
    CPU inductor's C++ backend): a warm-up of minutes the first time (cached on disk after), so for large
    splits."""
    from gem_train.checkpoint import load_checkpoint
    from gem_train.loop.build import build_run

    run = build_run(cfg, training=False)
    if run.device.type == "cpu":
        keep_freed_memory()  # the CPU forward's MB-sized temporaries reused, not page-faulted in afresh
    state = load_checkpoint(checkpoint, run.model, None, restore_rng=False)
    step = int(state["step"])
    model = run.model.eval()
    if compile:
        from gem_parallel import compile_layers

        compile_layers(model)  # in place: parameter names, hooks on the heads and the outputs unchanged
    capture = RepresentationCapture(model) if embeddings else None
    width, what = (capture.width, capture.what) if capture is not None else (0, "")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rank, world = run.dist.rank, run.dist.world_size
    plans = {s: split_plan(cfg, run.source, s, train_batches) for s in splits}
    plans = {s: p for s, p in plans.items() if p.num_batches > 0}
    identity = _identity(cfg, run, Path(checkpoint).resolve(), step, embeddings)
    todo, _ = _plan_shards(out, plans, shard_rows, identity, rank, world)
    chunk = max(cfg.data.eval_batch_size, cfg.data.batch_size, MIN_FORWARD_ROWS)
    total = sum(plans[s.split].shard_rows(s.lo, s.hi) for s in todo)
    bar = tqdm(total=total, disable=not (progress and rank == 0), unit="ex", unit_scale=True,
               dynamic_ncols=True, desc=f"predict {'+'.join(plans)}", file=sys.stderr)  # fmt: skip
    by_key = {(s.split, s.index): s for s in todo}
    loader = DataLoader(
        _ShardBatches(plans, [(s.split, s.index, s.lo, s.hi) for s in todo]),
        batch_size=None,
        collate_fn=_as_is,  # keep the keys NumPy (the default would make tensors of them)
        num_workers=cfg.data.num_workers,
        # As the trainer's evaluation: page-locked batches, so the forward's non-blocking copy is a DMA, not a
        # staged copy of pageable memory (base-h200's history categories alone are ~138 MB a batch of 2,048).
        pin_memory=run.device.type == "cuda",
        generator=torch.Generator().manual_seed(0),
    )
    depth = forwards_in_flight(run.device)
    in_flight: deque[_Launched] = deque()
    predicted, t0 = 0, time.perf_counter()

    def settle(keep: int) -> None:
        nonlocal predicted
        while len(in_flight) > keep:
            launched = in_flight.popleft()
            n = _finish(launched, run.tasks)
            predicted += n
            bar.update(n)  # the bar shows examples/s
            shard = launched.shard
            if shard.done:
                _write(out, shard)
                del by_key[(shard.split, shard.index)]

    try:
        for split, j, number, batch, keys in loader:
            shard = by_key[(split, j)]
            shard.pending.append((number, batch, keys))
            shard.received += 1
            buffered = sum(b.batch_size for _, b, _ in shard.pending)
            if buffered >= chunk or shard.received == shard.hi - shard.lo:
                in_flight.append(_launch(shard, model, run, capture))
                settle(depth)
        settle(0)
    finally:
        bar.close()
        if capture is not None:
            capture.remove()
    seconds = time.perf_counter() - t0
    stats = all_gather_object((predicted, seconds), world)
    if world > 1:
        dist.barrier()
    manifest = _manifest(out, cfg, run, identity, plans, shard_rows, width, what) if rank == 0 else {}
    if world > 1:
        dist.barrier()
    if rank != 0:
        from gem_train.transfer.prediction_files import read_manifest

        manifest = read_manifest(out)
    rows_now = sum(p for p, _ in stats)
    wall = max((s for _, s in stats), default=0.0)
    return PredictResult(
        out,
        {s: int(e["rows"]) for s, e in manifest["splits"].items()},
        rows_now,
        wall,
        rows_now / wall if wall > 0 else 0.0,
        manifest,
    )
