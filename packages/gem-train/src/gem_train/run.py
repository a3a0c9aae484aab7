"""The one run builder: ``build_run(cfg) -> Run``, used by ``train``, ``bench`` and ``eval``.

A :class:`Run` holds everything a training step needs: the process group and device, the data source, the
model (and the module the step calls: compiled, wrapped for several processes), the optimizers and the
autocast dtype. :meth:`Run.train_step` is *the* training step: the trainer runs it and ``gem-train bench``
times it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gem_model import FeatureSpec, GemBatch, GemModel, multitask_loss
from gem_train.config import ConfigError, TrainConfig
from gem_train.config.parallel import toml_message
from gem_train.data.loader import BatchSource
from gem_train.distributed import DistInfo, init_distributed
from gem_train.grad_norm import clip_grad_norm
from gem_train.mfu import device_peak_flops
from gem_train.model_factory import BuiltModel, build_model
from gem_train.optim import build_optimizers, lr_factor, set_lr
from gem_train.parallel import ParallelPlan, parallel_plan
from gem_train.selection import check_selection

__all__ = [
    "PendingStep",
    "Prepared",
    "Run",
    "StepDone",
    "StepPipeline",
    "StepResult",
    "build_model_for",
    "build_run",
    "build_source",
    "resolve_autocast",
]


def build_source(cfg: TrainConfig) -> BatchSource:
    """The dataset of ``cfg.data.source``."""
    if cfg.data.source == "synthetic":
        from gem_train.data.synthetic import SyntheticAds

        return SyntheticAds(cfg.data.synthetic, seed=cfg.run.seed)
    if cfg.data.source == "parquet":  # your own files (issue 17)
        from gem_train.data.parquet.reader import ParquetSource

        return ParquetSource(cfg.data.parquet, seed=cfg.run.seed)
    from gem_train.data.movielens import MovieLens100K

    return MovieLens100K(cfg.data.movielens, seed=cfg.run.seed)


def resolve_autocast(mode: str, device: torch.device) -> torch.dtype | None:
    """``train.autocast`` -> the autocast dtype (None: fp32). "auto" is bf16 on a GPU that supports it."""
    if mode == "none":
        return None
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if mode == "auto":
        return torch.bfloat16 if device.type == "cuda" and bf16_ok else None
    if not bf16_ok:
        raise ConfigError("train.autocast = 'bf16' but this GPU does not support bf16; use 'auto' or 'none'")
    return torch.bfloat16


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
    """A step queued on the device whose loss and gradient norm were not read yet (:meth:`Run.queue_step`).

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

    Where every optimizer skips a non-finite step on the device (:attr:`Run.can_queue_steps`) and
    ``overlap`` is on (``train.overlap_steps``), a step whose result nobody needs at once is left unread: its
    loss and gradient norm are read after the next step is queued, so the GPU never waits for the host
    between two steps. Otherwise every step is read as it ends (:meth:`Run.train_step`).
    """

    def __init__(self, run: Run, overlap: bool) -> None:
        self.run = run
        self.overlap = overlap and run.can_queue_steps
        self._pending: tuple[int, PendingStep, Any] | None = None

    def push(self, batch: GemBatch, step: int, *, read: bool = True, tag: Any = None) -> list[StepDone]:
        """Run 0-based ``step`` on ``batch`` (on the device); returns the steps read now, oldest first: the
        previous step if it was left unread, then this one unless it is left unread (``read=False`` while
        overlapping). ``tag`` comes back with the step's result."""
        if not self.overlap:
            return [StepDone(step + 1, self.run.train_step(batch, step), tag)]
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
    from gem_train.optim import RowWiseAdagrad

    if isinstance(opt, RowWiseAdagrad):
        return True
    return isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and bool(opt.defaults.get("fused"))


@dataclass
class Run:
    """What ``build_run`` made; see the module docstring."""

    cfg: TrainConfig
    dist: DistInfo
    source: BatchSource
    prepared: Prepared  # the model, and what the step calls: compiled and/or wrapped for several processes
    optimizers: list[torch.optim.Optimizer]
    dense_params: list[nn.Parameter]
    autocast_dtype: torch.dtype | None
    peak_flops: float | None

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

    def fresh_eval_model(self) -> nn.Module:
        """A new model of this run's config, prepared for evaluation as :func:`build_run` does with
        ``training=False`` (for loading a checkpoint beside the training model)."""
        return build_model_for(self.cfg, self.spec, self.dist, training=False).module

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
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

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
        loss, per_task = self._forward_backward(batch, step)
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
        loss, per_task = self._forward_backward(batch, step)
        values = self._step_values(loss.detach(), self._clip())
        found_inf = (~torch.isfinite(values).all()).to(torch.float32)
        for opt in self.optimizers:
            # Read by fused Adam/AdamW (torch's GradScaler hook) and RowWiseAdagrad.
            setattr(opt, "found_inf", found_inf)  # noqa: B010
        self._optimizer_steps()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return PendingStep(values, per_task)

    def _forward_backward(self, batch: GemBatch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        if self.dense_opt is not None:
            o = cfg.optim
            set_lr(self.dense_opt, o.lr * lr_factor(step, cfg.train.steps, o.warmup_steps, o.min_lr_ratio))
        with self.autocast():
            logits = self.train_model(batch)
        loss, per_task = multitask_loss(logits, batch)
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


def build_model_for(cfg: TrainConfig, spec: FeatureSpec, dist_info: DistInfo, *, training: bool) -> Prepared:
    """The model of ``cfg`` on ``dist_info``'s device, prepared by ``gem_parallel.parallelize``: for training
    (precision, compile, activation checkpointing, FSDP2/EP/sharded tables or DDP on several ranks) or, with
    ``training=False``, for evaluation (the precision recipe only, so its layers are the trained ones)."""
    from gem_parallel import parallelize

    autocast_dtype = resolve_autocast(cfg.train.autocast, dist_info.device)
    built = build_model(cfg.model, spec, dist_info.device, cfg.run.seed)
    plan = parallel_plan(cfg, dist_info.world_size, autocast_dtype, training=training)
    try:
        # In place (FSDP2 swaps classes; parameter names stay): built.model is the model of the checkpoints.
        module = parallelize(built.model, plan.dims, config=plan.config)
    except ValueError as e:  # raised on every rank before any collective
        raise ConfigError(toml_message(e)) from None
    return Prepared(built, module, plan)


@dataclass
class Prepared:
    """A built model and the module the step calls (``module``: compiled, wrapped for several processes)."""

    built: BuiltModel
    module: nn.Module
    plan: ParallelPlan

    @property
    def sparse(self) -> Any:
        """``gem_parallel.sparse.SparseSharding`` of TorchRec-sharded tables (their optimizer is fused into
        the backward; ``step()`` syncs 2D replicas), or None."""
        return getattr(self.module, "sparse_sharding", None)


def build_run(cfg: TrainConfig, *, training: bool = True) -> Run:
    """Process group, device, data source, model prepared by gem-parallel, and (``training``) optimizers;
    the autocast dtype. ``training=False`` builds what evaluation needs.

    Everything that can reject the config happens here, before a run directory exists: the dataset (a
    corrupt MovieLens record), the selection task, the model's overrides, the parallel layout.
    """
    d = init_distributed(cfg.run.device, cfg.run.cpu_threads, cfg.parallel.timeout_s)
    if d.device.type == "cuda":
        from gem_kernels import prewarm_triton

        prewarm_triton()  # Triton's per-process hash in the background while the data and model are built
    source = build_source(cfg)
    check_selection(cfg, source)
    autocast_dtype = resolve_autocast(cfg.train.autocast, d.device)
    prepared = build_model_for(cfg, source.spec, d, training=training)
    model = prepared.built.model
    peak = device_peak_flops(d.device, cfg.train.peak_flops)
    if not training:
        return Run(cfg, d, source, prepared, [], [], autocast_dtype, peak)
    # The optimizers are built after parallelize, on the parameters as they are then (DTensors under FSDP2).
    dense = list(model.dense_parameters())
    sparse = list(model.sparse_parameters())
    seen = {id(p) for p in dense + sparse}
    # Anything the model lists in neither group trains with the dense optimizer.
    dense += [p for p in model.parameters() if id(p) not in seen]
    if prepared.sparse is not None:
        # TorchRec-sharded tables train with the row-wise Adagrad fused into their backward.
        tables = {id(p) for p in model.embeddings.parameters()}
        dense, sparse = [p for p in dense if id(p) not in tables], []
    # The GEM model names its no-decay parameters (learned tokens); the MLP baseline has none beyond 1-D.
    no_decay = list(model.no_weight_decay_parameters()) if isinstance(model, GemModel) else []
    optimizers = build_optimizers(dense, sparse, cfg.optim, no_decay)
    return Run(cfg, d, source, prepared, optimizers, dense, autocast_dtype, peak)
