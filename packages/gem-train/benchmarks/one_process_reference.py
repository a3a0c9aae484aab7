"""What ``W`` ranks train, computed in one process: the reference of the multi-process loss curve.

Rank ``r`` of ``W`` trains step ``k`` on global batch ``k * W + r`` (with ``parallel.balancer =
"base_batch_shuffling"``: on the ``k``-th batch of rank ``r``'s balanced stream, built here exactly as that
rank builds it; with ``"global"``: on set ``r`` of the partition of the ``W`` batches' samples that
``GlobalBalancer`` computes) and the gradients are averaged over the ranks, so step ``k`` of a ``W``-rank
run minimises the mean of the ``W`` batches' losses. One process does the same with gradient accumulation:
each of the ``W`` batches' loss, divided by ``W``, is backpropagated, then the gradients are clipped and the
optimizers step once.

2D sharded tables (``parallel.strategy = "2d"`` or ``"fully_sharded_2d"`` with ``group_size = G``) are
not the same algorithm: each of the ``R = W / G`` sharding groups (ranks ``c, c + R, ...``) updates its
replica of the tables with the row-wise Adagrad of *its* ranks' mean gradient, then the replicas' weights and
accumulators are averaged. Adagrad is not linear in the gradient, so that differs from one update with the
mean over all ``W`` ranks. The reference models it: the tables' gradient of each sharding group is kept
apart, each replica's update is computed from the same starting point, and the results are averaged
(``sync_every = 1``; a larger one lets replicas drift apart for several steps, not modelled).
Used by the tests and by ``benchmarks/parallel_curve.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from gem_model import GemBatch, multitask_loss
from gem_train.config import TrainConfig
from gem_train.data.balance import balanced_stream, common_level, concat_batches
from gem_train.data.global_balance import partition_batches
from gem_train.loop.build import build_run
from gem_train.loop.optim import RowWiseAdagrad, lr_factor, set_lr
from gem_train.loop.step import BuiltRun

__all__ = ["same_batches_losses", "sparse_replicas"]


def sparse_replicas(cfg: TrainConfig, world: int) -> int:
    """``R``: replicas of the tables a ``world``-rank run of ``cfg`` keeps (1 unless 2D sharded)."""
    p = cfg.parallel
    if p.strategy not in ("2d", "fully_sharded_2d") or p.group_size in (-1, world):
        return 1
    if world % p.group_size:
        raise ValueError(f"parallel.group_size = {p.group_size} does not divide the world ({world})")
    if p.strategy == "2d" and p.sync_every != 1:
        raise ValueError("the one-process reference models 2D tables with parallel.sync_every = 1 only")
    return world // p.group_size


def _batches(cfg: TrainConfig, run: BuiltRun, world: int) -> Callable[[int, int], GemBatch]:
    """``get(step, rank)``: the batch rank ``rank`` of ``world`` trains at ``step`` (in step order)."""
    bs = cfg.data.batch_size
    if cfg.parallel.balancer == "global" and world > 1:
        step: dict[int, list[GemBatch]] = {}

        def rebalanced(k: int, r: int) -> GemBatch:
            if k not in step:  # the W ranks' batches joined, split as the GlobalBalancer splits them
                step.clear()
                plain = [run.source.get("train", k * world + q, bs).batch for q in range(world)]
                joined = concat_batches(plain)
                step[k] = [joined.select(rows) for rows in partition_batches(plain)]
            return step[k][r]

        return rebalanced
    if cfg.parallel.balancer != "base_batch_shuffling":
        return lambda k, r: run.source.get("train", k * world + r, bs).batch
    level = common_level(run.source, cfg.parallel.balancer_calibration)  # the trainer's, every rank's
    streams: list[Iterator] = [
        iter(balanced_stream(run.source, rank=r, world_size=world, batch_size=bs, seed=cfg.run.seed,
                             mean_cost=level))
        for r in range(world)
    ]  # fmt: skip
    return lambda k, r: next(streams[r]).batch


def same_batches_losses(cfg: TrainConfig, world: int, steps: int | None = None) -> list[float]:
    """The per-step losses (mean over the ``world`` batches of a step) of ``cfg`` trained in this one
    process on the batches a ``world``-rank run reads, for ``steps`` (default ``train.steps``)."""
    run = build_run(cfg)
    if run.dist.world_size != 1:
        raise RuntimeError("same_batches_losses runs in one process")
    replicas = sparse_replicas(cfg, world)
    get = _batches(cfg, run, world)
    tables = (
        next((x for x in run.optimizers if isinstance(x, RowWiseAdagrad)), None) if replicas > 1 else None
    )
    o = cfg.optim
    losses = []
    for k in range(cfg.train.steps if steps is None else steps):
        if run.dense_opt is not None:
            set_lr(run.dense_opt, o.lr * lr_factor(k, cfg.train.steps, o.warmup_steps, o.min_lr_ratio))
        batches = [get(k, r) for r in range(world)]
        total = 0.0
        grads: list[list[Tensor | None]] = []  # per sharding group: the tables' gradients
        for c in range(replicas):
            for r in range(c, world, replicas):  # sharding group c: ranks c, c + R, ...
                batch = batches[r].to(run.device)
                with run.autocast():
                    logits = run.train_model(batch)
                loss, _ = multitask_loss(logits, batch)
                (loss / world).backward()
                total += float(loss.detach()) / world
            if tables is not None:
                grads.append([_take_grad(p, replicas) for g in tables.param_groups for p in g["params"]])
        run._clip()
        opts = run.optimizers if tables is None else [x for x in run.optimizers if x is not tables]
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if tables is not None:
            _replica_average_step(tables, grads)
        losses.append(total)
    return losses


def _take_grad(p: Tensor, replicas: int) -> Tensor | None:
    """``p``'s gradient as the mean over its sharding group's ranks (the sum of ``loss / W`` times ``R``);
    clears it for the next group."""
    g = p.grad
    p.grad = None
    return None if g is None else g * replicas


@torch.no_grad()
def _replica_average_step(opt: torch.optim.Optimizer, grads: list[list[Tensor | None]]) -> None:
    """Each replica's row-wise Adagrad step from the same weights and state, then their mean (what 2D's
    ``ReplicaSync`` does after every step)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    start_w = [p.detach().clone() for p in params]
    start_s = [{k: v.clone() for k, v in opt.state[p].items()} if p in opt.state else None for p in params]
    new_w: list[list[Tensor]] = [[] for _ in params]
    new_s: list[list[dict[str, Tensor] | None]] = [[] for _ in params]
    for replica in grads:
        for i, p in enumerate(params):
            p.copy_(start_w[i])
            saved = start_s[i]
            if saved is None:
                opt.state.pop(p, None)
            else:
                opt.state[p] = {k: v.clone() for k, v in saved.items()}
            p.grad = replica[i]
        opt.step()
        for i, p in enumerate(params):
            new_w[i].append(p.detach().clone())
            new_s[i].append(dict(opt.state[p]) if p in opt.state else None)
            p.grad = None
    for i, p in enumerate(params):
        p.copy_(torch.stack(new_w[i]).mean(0))
        some = next((s for s in new_s[i] if s is not None), None)
        if some is not None:  # a replica that never updated this table holds a zero state
            full = [
                s if s is not None else {k: torch.zeros_like(v) for k, v in some.items()} for s in new_s[i]
            ]
            opt.state[p] = {k: torch.stack([s[k] for s in full]).mean(0) for k in some}
