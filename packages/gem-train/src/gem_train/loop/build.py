"""The one run builder: ``build_run(cfg) -> BuiltRun``, used by ``train``, ``eval``, ``bench`` and the
evaluation of the best checkpoint.

It makes the process group and device, the data source, the model (built by :mod:`gem_train.loop.model`,
prepared for training or evaluation by ``gem_parallel.parallelize`` from the plan of
:mod:`gem_train.loop.parallel`) and the optimizers. Everything that can reject the config happens here, before
a run directory exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gem_model import FeatureSpec, GemModel
from gem_train.config import ConfigError, TrainConfig
from gem_train.config.parallel import toml_message
from gem_train.data.loader import BatchSource
from gem_train.loop.dense_norm import attach_dense_norm
from gem_train.loop.distributed import DistInfo, init_distributed
from gem_train.loop.mfu import device_peak_flops
from gem_train.loop.model import BuiltModel, build_model
from gem_train.loop.optim import build_optimizers
from gem_train.loop.parallel import ParallelPlan, parallel_plan
from gem_train.loop.schedule import resolve_schedule, scheduled_config
from gem_train.loop.step import BuiltRun

__all__ = [
    "Prepared",
    "build_model_for",
    "build_run",
    "build_source",
    "check_selection",
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


def check_selection(cfg: TrainConfig, source: BatchSource) -> None:
    """``train.select_task`` names a task of the dataset (checked even when no selection runs: every config
    value is checked). Whether there is a validation split:
    :func:`gem_train.loop.schedule.resolve_schedule`."""
    t = cfg.train
    tasks = tuple(source.spec.tasks)
    if t.select_task != "mean" and t.select_task not in tasks:
        raise ConfigError(
            f"train.select_task = {t.select_task!r} is not a task of this dataset ({', '.join(tasks)}) "
            "nor 'mean'"
        )


def build_model_for(cfg: TrainConfig, spec: FeatureSpec, dist_info: DistInfo, *, training: bool) -> Prepared:
    """The model of ``cfg`` on ``dist_info``'s device, prepared by ``gem_parallel.parallelize``: for training
    (precision, compile, activation checkpointing, FSDP2/EP/sharded tables or DDP on several ranks) or, with
    ``training=False``, for evaluation (the precision recipe only, so its layers are the trained ones)."""
    from gem_parallel import parallelize
    from gem_train.transfer.student import attach_student

    autocast_dtype = resolve_autocast(cfg.train.autocast, dist_info.device)
    built = build_model(cfg.model, spec, dist_info.device, cfg.run.seed)
    if cfg.data.normalize_dense and spec.n_dense:  # its buffers travel with the weights in checkpoints
        attach_dense_norm(built.model, spec.n_dense, dist_info.device)
    attach_student(built.model, cfg.distill, tuple(spec.tasks))  # [distill]'s heads; nothing without
    plan = parallel_plan(cfg, dist_info.world_size, autocast_dtype, training=training)
    try:
        # In place (FSDP2 swaps classes; parameter names stay): built.model is the model of the checkpoints.
        module = parallelize(built.model, plan.dims, config=plan.config)
    except ValueError as e:  # raised on every rank before any collective
        raise ConfigError(toml_message(e)) from None
    if cfg.precision.recipe != "none" and cfg.precision.cache_weight_casts and autocast_dtype is not None:
        from gem_precision import cache_fp8_weights

        cache_fp8_weights(built.model, autocast_dtype)  # refreshed by a pre-hook of the model's forward
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


def build_run(cfg: TrainConfig, *, training: bool = True) -> BuiltRun:
    """Process group, device, data source, model prepared by gem-parallel, and (``training``) optimizers;
    the autocast dtype. ``training=False`` builds what evaluation needs.

    Everything that can reject the config happens here, before a run directory exists: the dataset (a
    corrupt MovieLens record), the selection task, the schedule (:mod:`gem_train.loop.schedule`), the model's
    overrides, the parallel layout. ``BuiltRun.cfg`` is ``cfg`` with the schedule resolved.
    """
    d = init_distributed(cfg.run.device, cfg.run.cpu_threads, cfg.parallel.timeout_s)
    if d.device.type == "cuda":
        from gem_kernels import prewarm_triton

        prewarm_triton()  # Triton's per-process hash in the background while the data and model are built
    from gem_train.transfer.losses import loss_for
    from gem_train.transfer.source import transfer_source

    source = build_source(cfg)
    check_selection(cfg, source)
    # The loop runs by the resolved schedule (train.epochs -> steps, valid_every "auto" -> a number); the
    # user's config stays as written in the run directory and the checkpoints.
    schedule = resolve_schedule(cfg, source, d.world_size)
    cfg = scheduled_config(cfg, schedule)
    source = transfer_source(cfg, source, d.device, training=training)  # [distill]'s data; as is without
    autocast_dtype = resolve_autocast(cfg.train.autocast, d.device)
    prepared = build_model_for(cfg, source.spec, d, training=training)
    model = prepared.built.model
    peak = device_peak_flops(d.device, cfg.train.peak_flops)
    if not training:
        return BuiltRun(cfg, d, source, prepared, [], [], autocast_dtype, peak, schedule=schedule)
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
    loss_fn = loss_for(cfg.distill, tuple(source.spec.tasks))
    return BuiltRun(
        cfg, d, source, prepared, optimizers, dense, autocast_dtype, peak, loss_fn=loss_fn, schedule=schedule
    )
