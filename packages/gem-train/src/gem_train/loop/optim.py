"""Optimizers of a GEM run: dense AdamW with warm-up + cosine decay, row-wise Adagrad for embedding tables.

Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``) keeps one accumulator per table row, the mean of the
squared gradient over the row, instead of one per element: the optimizer state of a table with ``D``-wide rows
is ``1/D`` of plain Adagrad's, which is what makes it the default for huge sparse tables.

TorchRec fuses this optimizer into the backward of *sharded* tables (``DistributedModelParallel`` with
``fused_params``). An unsharded ``EmbeddingBagCollection`` (one process, or DDP as here) has ordinary
``nn.Parameter`` weights with ordinary gradients, so :class:`RowWiseAdagrad` applies the same update as a
regular ``torch.optim.Optimizer`` step after the backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from gem_train.config import OptimConfig

__all__ = ["RowWiseAdagrad", "build_optimizers", "lr_factor", "set_lr"]


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row of each (2-D) parameter.

    For a table ``W`` ``[rows, dim]`` with gradient ``G``: ``s_r += mean_j G_rj^2`` and
    ``W_r -= lr * G_r / (sqrt(s_r) + eps)``. Rows with a zero gradient (not looked up) are unchanged.
    Accepts dense or sparse (``nn.EmbeddingBag(sparse=True)``) gradients. 1-D parameters are treated as
    tables of width 1. The accumulator is float32 whatever the table's dtype.

    Like fused Adam under ``torch.amp.GradScaler``, a ``found_inf`` attribute (a float32 0-d tensor on the
    parameters' device) of 1 makes :meth:`step` leave every table and accumulator as it is, decided on the
    device (no host sync): what :meth:`gem_train.loop.step.BuiltRun.queue_step` relies on.
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.05, eps: float = 1e-8) -> None:
        if lr <= 0:
            raise ValueError(f"RowWiseAdagrad: lr must be > 0, got {lr}")
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf.bool()
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = _row_state(p)
                # An FSDP2 DTensor is sharded by rows (dim 0), and so is its accumulator: the update of a
                # row only needs that row, so each rank updates its own shard.
                acc: Tensor = _local(state["sum"])
                local, grad = _local(p), _local(p.grad)
                w = local if local.dim() == 2 else local.view(-1, 1)
                if grad.is_sparse:
                    g = grad.coalesce()
                    rows = g.indices()[0]
                    vals = g.values().float().reshape(rows.numel(), -1)
                    acc.index_add_(0, rows, _unless(skip, vals.square().mean(dim=1)))
                    scale = lr / (acc[rows].sqrt() + eps)
                    w.index_add_(0, rows, _unless(skip, -scale[:, None] * vals).to(w.dtype))
                else:
                    g = grad.float().reshape(w.shape)
                    acc.add_(_unless(skip, g.square().mean(dim=1)))
                    w.sub_(_unless(skip, lr * g / (acc.sqrt() + eps)[:, None]).to(w.dtype))
        return loss


def _unless(skip: Tensor | None, update: Tensor) -> Tensor:
    """``update``, or zeros where ``skip`` (0-d bool) is set: ``where``, not a product, since a skipped
    step's update is NaN/Inf."""
    return update if skip is None else torch.where(skip.to(update.device), 0.0, update)


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _row_state(p: Tensor) -> Tensor:
    """A float32 zero per row of ``p``; for a row-sharded DTensor a DTensor sharded the same way (so that
    a checkpoint stores one accumulator per row, reshardable to any world size)."""

    def rows(t: Tensor) -> int:  # a 2-D table's rows; any other shape: one row per element
        return t.shape[0] if t.dim() == 2 else t.numel()

    if not isinstance(p, DTensor):
        return torch.zeros(rows(p), dtype=torch.float32, device=p.device)
    if p.dim() not in (1, 2) or any(isinstance(pl, Shard) and pl.dim != 0 for pl in p.placements):
        raise ValueError(f"RowWiseAdagrad: a {p.dim()}-D DTensor placed {p.placements} is not row-sharded")
    local = torch.zeros(rows(p._local_tensor), dtype=torch.float32, device=p._local_tensor.device)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size([rows(p)]), stride=(1,)
    )


def _decay_split(params: list[Tensor], no_decay_ids: set[int]) -> list[dict[str, Any]]:
    # No weight decay on biases and norm gains (1-D) nor on what the model names (learned tokens that act
    # as embedding rows): decaying them towards 0 only hurts. Embedding tables are not here at all (their
    # optimizer is the row-wise Adagrad, without decay).
    decay = [p for p in params if p.dim() >= 2 and id(p) not in no_decay_ids]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in no_decay_ids]
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizers(
    dense: Iterable[Tensor],
    sparse: Iterable[Tensor],
    cfg: OptimConfig,
    no_decay: Iterable[Tensor] = (),
) -> list[torch.optim.Optimizer]:
    """``[AdamW over dense params, RowWiseAdagrad over embedding tables]`` (an empty group is left out).

    AdamW's first group (``weight_decay = cfg.weight_decay``) holds the dense matrices; the second
    (``weight_decay = 0``) the 1-D parameters (biases, norm gains) and ``no_decay``.
    """
    no_decay_ids = {id(p) for p in no_decay}
    dense = [p for p in dense if p.requires_grad]
    sparse = [p for p in sparse if p.requires_grad]
    opts: list[torch.optim.Optimizer] = []
    if dense:
        fused = adamw_fused(dense, cfg.adamw_impl)
        opts.append(
            torch.optim.AdamW(
                _decay_split(dense, no_decay_ids),
                lr=cfg.lr,
                betas=(cfg.beta1, cfg.beta2),
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                fused=fused,
                foreach=None if fused else True,
            )
        )
    if sparse:
        opts.append(RowWiseAdagrad(sparse, lr=cfg.sparse_lr, eps=cfg.sparse_eps))
    if not opts:
        raise ValueError("the model has no trainable parameters")
    return opts


def adamw_fused(params: list[Tensor], impl: str) -> bool:
    """Whether AdamW runs fused: ``impl`` "fused", or "auto" with every parameter on CUDA.

    On base-h200 the foreach AdamW took 7.6-11.8 ms of a ~140 ms step (many multi-tensor launches per
    group); the fused kernel reads each parameter, gradient and moment once. CPU runs keep foreach (the
    numbers every CPU test and checkpoint were made with)."""
    if impl == "fused":
        return True
    if impl == "foreach":
        return False
    return bool(params) and all(p.device.type == "cuda" for p in params)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the dense learning rate at (0-based) ``step``.

    Linear warm-up from ``1/warmup`` to 1 over ``warmup_steps``, then cosine decay from 1 to ``min_ratio`` at
    the last step.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate to ``lr``; a tensor learning rate (a captured CUDA graph reads it) is
    filled in place."""
    for g in opt.param_groups:
        if isinstance(g["lr"], Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr
