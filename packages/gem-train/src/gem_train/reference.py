"""What ``W`` ranks train, computed in one process: the reference of the multi-process loss curve.

Rank ``r`` of ``W`` trains step ``k`` on global batch ``k * W + r`` and the gradients are averaged over the
ranks, so step ``k`` of a ``W``-rank run minimises the mean of the ``W`` batches' losses. One process does
the same with gradient accumulation: each of the ``W`` batches' loss, divided by ``W``, is backpropagated,
then the gradients are clipped and the optimizers step once. Used by the tests and by
``benchmarks/parallel_curve.py``.
"""

from __future__ import annotations

from gem_model import multitask_loss
from gem_train.config import TrainConfig
from gem_train.optim import lr_factor, set_lr
from gem_train.run import build_run

__all__ = ["same_batches_losses"]


def same_batches_losses(cfg: TrainConfig, world: int, steps: int | None = None) -> list[float]:
    """The per-step losses (mean over the ``world`` batches of a step) of ``cfg`` trained in this one
    process on the global batches a ``world``-rank run reads, for ``steps`` (default ``train.steps``)."""
    run = build_run(cfg)
    if run.dist.world_size != 1:
        raise RuntimeError("same_batches_losses runs in one process")
    o = cfg.optim
    losses = []
    for k in range(cfg.train.steps if steps is None else steps):
        if run.dense_opt is not None:
            set_lr(run.dense_opt, o.lr * lr_factor(k, cfg.train.steps, o.warmup_steps, o.min_lr_ratio))
        total = 0.0
        for r in range(world):
            batch = run.source.get("train", k * world + r, cfg.data.batch_size).batch.to(run.device)
            with run.autocast():
                logits = run.train_model(batch)
            loss, _ = multitask_loss(logits, batch)
            (loss / world).backward()
            total += float(loss.detach()) / world
        run._clip()
        for opt in run.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses
