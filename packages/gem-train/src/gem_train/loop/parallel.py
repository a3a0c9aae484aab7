"""``[parallel]``, ``[precision]`` and ``train.compile`` translated into gem-parallel's typed config.

gem-parallel owns preparing a model for training (``gem_parallel.parallelize``: precision, per-layer compile,
activation checkpointing, expert parallelism, FSDP2/HSDP, sharded tables, the one-rank path); this module
only says what a gem-train config asks of it. The option names and their choices are gem-parallel's
(:mod:`gem_parallel.config`); a value it rejects is a :class:`~gem_train.config.ConfigError` naming the
TOML key.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from gem_train.config import ConfigError, TrainConfig

__all__ = ["ParallelPlan", "parallel_plan", "sparse_strategy"]


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def sparse_strategy(cfg: TrainConfig, world_size: int) -> str | None:
    """``parallel.strategy`` resolved: None (FSDP or DDP owns the tables) or a gem-parallel strategy name.

    "auto" is "1d" on several ranks when gem-parallel's sparse sharding is installed, else None; one process
    and the MLP baseline (no blocks) never shard tables."""
    s = cfg.parallel.strategy
    if s == "none" or world_size == 1 or cfg.model.arch == "mlp":
        return None
    if s == "auto":
        return "1d" if _available("gem_parallel.sparse") else None
    if not _available("gem_parallel.sparse"):
        raise ConfigError(
            f"parallel.strategy = {s!r} needs gem_parallel.sparse, which this gem-parallel does not have; "
            "use 'none' or 'auto'"
        )
    return s


@dataclass(frozen=True)
class ParallelPlan:
    """What ``gem_parallel.parallelize`` gets: the degrees (``gem_parallel.ParallelDims``) and the config
    (``gem_parallel.ParallelConfig``)."""

    dims: Any
    config: Any

    @property
    def dp_replicate(self) -> int:
        return int(self.dims.dp_replicate)


def _recipe(cfg: TrainConfig) -> Any:
    if cfg.precision.recipe == "none":
        return None
    import gem_precision

    if cfg.precision.recipe == "fp8_rowwise":
        return gem_precision.Recipe.fp8_rowwise(auto_fallback=cfg.precision.fp8_auto_fallback)
    return getattr(gem_precision.Recipe, cfg.precision.recipe)()


def _config_error(e: ValueError, world_size: int) -> ConfigError:
    from gem_train.config.parallel import toml_message

    return ConfigError(f"{toml_message(e)} (world size {world_size})")


def parallel_plan(
    cfg: TrainConfig, world_size: int, autocast_dtype: torch.dtype | None, *, training: bool = True
) -> ParallelPlan:
    """The plan of a ``world_size``-rank run of ``cfg``; ``training=False``: what evaluation needs (the
    precision recipe only: the same layers as in training, nothing compiled, wrapped or sharded)."""
    from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims

    p = cfg.parallel
    recipe = _recipe(cfg)
    precision = dict(
        precision=recipe,
        precision_min_features=cfg.precision.min_features,
        precision_keep_last_blocks=cfg.precision.keep_last_blocks,
    )
    if not training:
        return ParallelPlan(ParallelDims(world_size=1, ranks_per_host=1), ParallelConfig(**precision))
    strategy = sparse_strategy(cfg, world_size)
    try:
        if world_size == 1:
            # One process: the degrees of [parallel] (meant for torchrun) do not apply.
            dims = ParallelDims(world_size=1, ranks_per_host=1)
        else:
            dims = ParallelDims(
                dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, ep=p.ep, sparse_group=p.group_size,
                world_size=world_size,
            )  # fmt: skip
        config = ParallelConfig(
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
            **precision,
        )
    except ValueError as e:
        raise _config_error(e, world_size) from None
    return ParallelPlan(dims, config)
