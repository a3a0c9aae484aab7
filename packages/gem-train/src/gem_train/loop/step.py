"""The training step of a built run: :class:`BuiltRun` (what :func:`gem_train.loop.build.build_run` makes)
and :class:`StepPipeline` (how the trainer and ``gem-train bench`` run its steps).

A :class:`BuiltRun` holds everything a training step needs: the process group and device, the data source,
the model (and the module the step calls: compiled, wrapped for several processes), the optimizers and the
autocast dtype. :meth:`BuiltRun.train_step` is *the* training step: the trainer runs it and
``gem-train bench`` times it, both through one :class:`StepPipeline`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gem_model import FeatureSpec, GemBatch, multitask_loss
from gem_train.config import TrainConfig
from gem_train.data.loader import BatchSource
from gem_train.loop.distributed import DistInfo
from gem_train.loop.grad_norm import clip_grad_norm
from gem_train.loop.model import BuiltModel
from gem_train.loop.optim import lr_factor, set_lr

if TYPE_CHECKING:
    from gem_train.loop.build import Prepared
    from gem_train.loop.schedule import Schedule

__all__ = ["BuiltRun", "PendingStep", "StepDone", "StepPipeline", "StepResult", "skips_on_device"]


@dataclass
class StepResult:
    """One training step: the loss (mean over ranks), the dense gradient norm, whether both are finite
    (else no optimizer stepped), and the per-task masked BCE of this rank (detached, on the device)."""

    loss: float
    grad_norm: float
    finite: bool
    per_task: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class PendingStep:
    """A step queued on the device whose loss and gradient norm were not read yet
    (:meth:`BuiltRun.queue_step`).

    ``values`` is ``[loss averaged over ranks, dense grad norm]`` (float32, on the device); the optimizers
    already skipped the update on the device if either is non-finite. :meth:`result` reads them: the one
    host sync of the step, which the caller may put after queueing the next step."""

    values: Tensor
    per_task: dict[str, Tensor]

    def result(self) -> StepResult:
        loss_value, norm = self.values.tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm)
        return StepResult(loss_value, norm, finite, self.per_task)


class StepPipeline:
    """The training steps of a run, as the trainer runs them and ``gem-train bench`` times them.

    Where every optimizer skips a non-finite step on the device (:attr:`BuiltRun.can_queue_steps`) and
    ``overlap`` is on (``train.overlap_steps``), a step whose result nobody needs at once is left unread: its
    loss and gradient norm are read after the next step is queued, so the GPU never waits for the host
    between two steps. Otherwise every step is read as it ends (:meth:`BuiltRun.train_step`).
    """

    def __init__(self, run: BuiltRun, overlap: bool) -> None:
        self.run = run
        self.overlap = overlap and run.can_queue_steps
        self._pending: tuple[int, PendingStep, Any] | None = None
        # train.cuda_graphs: every step through gem_train.loop.cuda_graph (CUDA only; the CPU ignores it).
        self.graphs: Any = None
        if run.cfg.train.cuda_graphs and run.device.type == "cuda":
            from gem_train.loop.cuda_graph import GraphedSteps

            self.graphs = GraphedSteps(run)

    def push(self, batch: GemBatch, step: int, *, read: bool = True, tag: Any = None) -> list[StepDone]:
        """Run 0-based ``step`` on ``batch`` (on the device); returns the steps read now, oldest first: the
        previous step if it was left unread, then this one unless it is left unread (``read=False`` while
        overlapping). ``tag`` comes back with the step's result."""
        if self.graphs is not None:
            queued = self.graphs.queue_step(batch, step)
            if not self.overlap:
                return [StepDone(step + 1, queued.result(), tag)]
        elif not self.overlap:
            return [StepDone(step + 1, self.run.train_step(batch, step), tag)]
        else:
            queued = self.run.queue_step(batch, step)
        done = self.flush()
        if read:
            done.append(StepDone(step + 1, queued.result(), tag))
        else:
            self._pending = (step + 1, queued, tag)
        return done

    def flush(self) -> list[StepDone]:
        """Read the step left unread, if any (a list of at most one)."""
        if self._pending is None:
            return []
        number, pending, tag = self._pending
        self._pending = None
        return [StepDone(number, pending.result(), tag)]


@dataclass
class StepDone:
    """A step whose result was read: its 1-based ``number`` (the step count after it), its result and the
    caller's ``tag``."""

    number: int
    result: StepResult
    tag: Any = None


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` skips its update on the device when its ``found_inf`` attribute (a float32 0-d
    tensor, as ``torch.amp.GradScaler`` sets it) is 1: fused Adam/AdamW and :class:`RowWiseAdagrad`."""
    from gem_train.loop.optim import RowWiseAdagrad

    if isinstance(opt, RowWiseAdagrad):
        return True
    return isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and bool(opt.defaults.get("fused"))


@dataclass
class BuiltRun:
    """What :func:`gem_train.loop.build.build_run` made; see the module docstring. ``cfg`` is the run's
    config with the schedule resolved (:func:`gem_train.loop.schedule.scheduled_config`)."""

    cfg: TrainConfig
    dist: DistInfo
    source: BatchSource
    prepared: Prepared  # the model, and what the step calls: compiled and/or wrapped for several processes
    optimizers: list[torch.optim.Optimizer]
    dense_params: list[nn.Parameter]
    autocast_dtype: torch.dtype | None
    peak_flops: float | None
    # (logits, batch) -> (loss, per-task detached losses): multitask_loss, or [distill]'s
    # (gem_train.transfer.losses).
    loss_fn: Callable[[dict[str, Tensor], GemBatch], tuple[Tensor, dict[str, Tensor]]] = multitask_loss
    # torch.autocast's cache of casted weights: off under CUDA graphs (as torch's graph docs ask).
    autocast_cache: bool = True
    # How long the run trains and when it validates; ``cfg.train`` holds the same resolved values.
    schedule: Schedule | None = None

    @property
    def built(self) -> BuiltModel:
        return self.prepared.built

    @property
    def train_model(self) -> nn.Module:
        return self.prepared.module

    @property
    def sparse(self) -> Any:
        """The TorchRec sharding of the tables (``Prepared.sparse``), or None."""
        return self.prepared.sparse

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def spec(self) -> FeatureSpec:
        return self.source.spec

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.source.spec.tasks)

    @property
    def model(self) -> nn.Module:
        """The model itself (parameter names as in checkpoints)."""
        return self.built.model

    @property
    def dense_opt(self) -> torch.optim.Optimizer | None:
        return self.optimizers[0] if self.dense_params else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(
            device_type=self.device.type, dtype=self.autocast_dtype, cache_enabled=self.autocast_cache
        )

    @property
    def can_queue_steps(self) -> bool:
        """Whether :meth:`queue_step` can run: every optimizer skips a non-finite step on the device."""
        return bool(self.optimizers) and all(skips_on_device(o) for o in self.optimizers)

    def train_step(self, batch: GemBatch, step: int) -> StepResult:
        """One training step on ``batch`` (on the device) at 0-based ``step``: learning rate, forward,
        loss, backward, clipping, and the optimizer steps, unless the loss or the gradient norm is NaN/Inf
        on some rank (then every rank drops the gradients, and the caller's NaN policy decides; the tables of
        TorchRec-sharded embeddings were already updated inside the backward, which cannot be undone).

        The loss and the dense gradient norm are read together, after the backward was queued: one host
        sync per step. Each rank's loss is the mean over its own batch; the gradients are averaged over
        the ranks (FSDP2/DDP), so the step minimises the mean of the ranks' losses. Where the optimizers
        can skip on the device (:attr:`can_queue_steps`) this is ``queue_step(...).result()``.
        """
        if self.can_queue_steps:
            return self.queue_step(batch, step).result()
        self.set_step_lr(step)
        loss, per_task = self._forward_backward(batch)
        loss_value, gnorm = self._step_values(loss.detach(), self._clip()).tolist()
        finite = math.isfinite(loss_value) and math.isfinite(gnorm)
        if finite:
            self._optimizer_steps()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return StepResult(loss_value, gnorm, finite, per_task)

    def queue_step(self, batch: GemBatch, step: int) -> PendingStep:
        """:meth:`train_step` without its host sync: the step is queued on the device and returned unread.

        The non-finite check runs on the device: the optimizers get ``found_inf`` (1 if the loss or the
        gradient norm is NaN/Inf on some rank) and skip their update there, as under ``GradScaler``. So the
        host can queue step ``k + 1`` before reading step ``k``'s loss, and the GPU never waits for it.
        Needs :attr:`can_queue_steps` (fused AdamW: ``optim.adamw_impl``, auto on CUDA)."""
        if not self.can_queue_steps:
            raise RuntimeError(
                "queue_step needs optimizers that skip on the device (fused AdamW, RowWiseAdagrad); got "
                + ", ".join(type(o).__name__ for o in self.optimizers)
            )
        self.set_step_lr(step)
        values, per_task = self.device_step(batch)
        return PendingStep(values, per_task)

    def set_step_lr(self, step: int) -> None:
        """The dense learning rate of 0-based ``step`` (warm-up, cosine), into the dense optimizer's groups
        (a float, or in place into a tensor learning rate: :mod:`gem_train.loop.cuda_graph`)."""
        cfg = self.cfg
        if self.dense_opt is not None:
            o = cfg.optim
            set_lr(self.dense_opt, o.lr * lr_factor(step, cfg.train.steps, o.warmup_steps, o.min_lr_ratio))

    def device_step(self, batch: GemBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward, loss, backward, clipping and the optimizer steps (skipped on the device when the loss or
        the gradient norm is non-finite), with no host sync: the body of :meth:`queue_step` (learning rate
        set before), and what a CUDA graph captures (:mod:`gem_train.loop.cuda_graph`). Returns ``([loss,
        grad norm], per-task losses)`` on the device."""
        loss, per_task = self._forward_backward(batch)
        values = self._step_values(loss.detach(), self._clip())
        found_inf = (~torch.isfinite(values).all()).to(torch.float32)
        for opt in self.optimizers:
            # Read by fused Adam/AdamW (torch's GradScaler hook) and RowWiseAdagrad.
            setattr(opt, "found_inf", found_inf)  # noqa: B010
        self._optimizer_steps()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return values, per_task

    def _forward_backward(self, batch: GemBatch) -> tuple[Tensor, dict[str, Tensor]]:
        with self.autocast():
            logits = self.train_model(batch)
        loss, per_task = self.loss_fn(logits, batch)
        loss.backward()
        return loss, per_task

    def _optimizer_steps(self) -> None:
        for opt in self.optimizers:
            opt.step()
        if self.sparse is not None:
            self.sparse.step()  # 2D: the replicas' sync every sync_every steps

    def _step_values(self, loss: Tensor, grad_norm: Tensor) -> Tensor:
        """``[loss, grad_norm]`` (float32, on the device); the loss averaged over ranks.

        Every rank must agree on skipping/stopping: a NaN anywhere is a NaN everywhere. The gradient norm
        is the same on every rank after the gradient all-reduce, so averaging it changes nothing."""
        x = torch.stack([loss.float(), grad_norm.to(loss.device, torch.float32)])
        if self.dist.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            x = x / self.dist.world_size
        return x

    def _clip(self) -> Tensor:
        """Clip the dense gradients (``optim.grad_clip``; 0 = no clipping) and return their total norm."""
        params = [p for p in self.dense_params if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grads = [p.grad for p in params if p.grad is not None]
        return clip_grad_norm(
            grads, max_norm, world_size=self.dist.world_size, dp_replicate=self.prepared.plan.dp_replicate
        )
