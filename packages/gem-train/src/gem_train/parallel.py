"""The ``[parallel]`` section applied: ``gem_parallel.ParallelDims`` + ``parallelize`` for a torchrun run.

With one process nothing is applied. With several, a GEM model goes through ``gem_parallel.parallelize``
(activation checkpointing, per-layer compile, expert parallelism, FSDP2/HSDP, embedding sharding); the
MLP baseline, which has no ``layers`` to shard, is replicated with DDP.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gem_train.config import ConfigError, TrainConfig
from gem_train.distributed import DistInfo

__all__ = ["Layout", "apply_parallel", "sparse_strategy"]


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def sparse_strategy(cfg: TrainConfig) -> str | None:
    """``parallel.strategy`` resolved: None (FSDP owns the tables) or a ``gem_parallel`` strategy name."""
    s = cfg.parallel.strategy
    if s == "auto":
        return "1d" if _available("gem_parallel.sparse") else None
    if s == "none":
        return None
    if not _available("gem_parallel.sparse"):
        raise ConfigError(
            f"parallel.strategy = {s!r} needs gem_parallel.sparse, which this gem-parallel does not have; "
            "use 'none' or 'auto'"
        )
    return s


@dataclass
class Layout:
    """What was applied: the degrees (None: DDP or one process) and the resolved table strategy."""

    dims: object | None  # gem_parallel.ParallelDims
    strategy: str | None
    wrapper: str  # "none" (one process), "ddp" or "parallelize"
    # gem_parallel.sparse.SparseSharding of TorchRec-sharded tables (their optimizer is fused into the
    # backward; ``step()`` syncs 2D replicas), or None.
    sparse: Any = None

    @property
    def dp_replicate(self) -> int:
        return int(getattr(self.dims, "dp_replicate", 1))


def _check_balancer(cfg: TrainConfig) -> None:
    if cfg.parallel.balancer != "none" and not _available("gem_parallel.balance"):
        raise ConfigError(
            f"parallel.balancer = {cfg.parallel.balancer!r} needs gem_parallel.balance, which this "
            "gem-parallel does not have; use 'none'"
        )


def apply_parallel(
    model: nn.Module, cfg: TrainConfig, d: DistInfo, autocast_dtype: torch.dtype | None
) -> tuple[nn.Module, Layout]:
    """The module the training step calls, and the layout. One process: ``model`` (compiled if
    ``train.compile``), unchanged otherwise."""
    _check_balancer(cfg)
    if d.world_size == 1:
        if cfg.train.compile:
            from gem_train.compile import apply_compile

            model = apply_compile(model)
        return model, Layout(None, None, "none")
    if not isinstance(getattr(model, "layers", None), nn.ModuleDict | nn.ModuleList):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # The baseline: every parameter replicated.
        ddp = DDP(
            model,
            device_ids=[d.device.index] if d.device.type == "cuda" else None,
            find_unused_parameters=True,  # some tables may see no ids in a batch
        )
        return ddp, Layout(None, None, "ddp")
    from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims, parallelize

    p = cfg.parallel
    strategy = sparse_strategy(cfg)
    try:
        dims = ParallelDims(
            dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, ep=p.ep, sparse_group=p.group_size,
            world_size=d.world_size,
        )  # fmt: skip
        pcfg = ParallelConfig(
            fsdp=FSDPConfig(param_dtype=autocast_dtype, reduce_dtype=torch.float32),
            expert_parallel=p.ep > 1,
            all_gather=p.all_gather,
            activation_checkpointing=p.activation_checkpointing,
            memory_budget=p.memory_budget,
            saved_activations=p.saved_activations,
            compile=cfg.train.compile,
            embeddings=strategy,  # type: ignore[arg-type]
            embedding_sync_every=p.sync_every,
            # The fused row-wise Adagrad of TorchRec-sharded tables: gem-train's sparse optimizer settings.
            embedding_lr=cfg.optim.sparse_lr,
            embedding_eps=cfg.optim.sparse_eps,
        )
    except ValueError as e:
        raise ConfigError(f"parallel: {e} (world size {d.world_size})") from None
    mesh = dims.build_mesh(d.device.type)
    sparse_mesh = dims.build_sparse_mesh(d.device.type) if strategy is not None else None
    try:
        model = parallelize(model, dims, mesh, pcfg, sparse_mesh=sparse_mesh)
    except ValueError as e:  # raised on every rank before any collective
        raise ConfigError(f"parallel: {e}") from None
    return model, Layout(dims, strategy, "parallelize", getattr(model, "sparse_sharding", None))
