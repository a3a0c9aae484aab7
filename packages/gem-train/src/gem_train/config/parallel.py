"""The ``[parallel]`` section: how a multi-process run (``torchrun``) lays out the model and the data.

With one process nothing here applies (the run is what it always was). Under ``torchrun``, with no
``[parallel]`` section at all, the defaults are FSDP2 over all ranks (``dp_shard = -1``) and, when
gem-parallel's sparse sharding is installed, 1D sharded embedding tables (``strategy = "auto"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gem_train.config.checks import ConfigError
from gem_train.config.checks import int_in as _int_in
from gem_train.config.checks import real as _real

__all__ = ["ParallelSection"]


@dataclass
class ParallelSection:
    """Degrees (``gem_parallel.ParallelDims``) and what ``gem_parallel.parallelize`` applies."""

    dp_replicate: int = 1  # HSDP replicas of the dense parameters (outermost axis)
    dp_shard: int = -1  # FSDP shard group size; -1: world // dp_replicate
    ep: int = 1  # expert-parallel degree (a divisor of dp_shard and of the model's n_experts)
    # Embedding tables: "auto" = "1d" when gem_parallel.sparse is installed, else "none"; "none" leaves
    # them to FSDP as ordinary (row-sharded) parameters with gem-train's row-wise Adagrad.
    strategy: Literal["auto", "none", "1d", "2d", "fully_sharded_2d"] = "auto"
    group_size: int = -1  # ranks per embedding sharding group (2D); -1: the world (1D)
    sync_every: int = 1  # 2D: steps between weight syncs of the table replicas
    all_gather: Literal["bf16", "fp8", "mxfp8"] = "bf16"  # FSDP all-gather format of large linear weights
    activation_checkpointing: Literal["none", "full", "selective", "budget"] = "none"
    memory_budget: float = 0.5  # "budget": the share of activation memory kept, in (0, 1]
    saved_activations: Literal["bf16", "fp8", "mxfp8"] = "bf16"  # storage of saved activations
    # Jagged-batch load balancing: "base_batch_shuffling" (each rank's own batches, gem_train.data.balance)
    # or "global" (every step's samples repartitioned across the ranks, gem_train.data.global_balance).
    balancer: Literal["none", "base_batch_shuffling", "global"] = "none"
    # Collective timeout (s) of the process group: a rank that died or hangs makes every other rank fail
    # with an error after at most this long, never a silent hang.
    timeout_s: float = 600.0

    def validate(self, key: str = "parallel") -> None:
        _int_in(f"{key}.dp_replicate", self.dp_replicate, 1)
        if self.dp_shard != -1:
            _int_in(f"{key}.dp_shard", self.dp_shard, 1)
        _int_in(f"{key}.ep", self.ep, 1)
        if self.group_size != -1:
            _int_in(f"{key}.group_size", self.group_size, 1)
        _int_in(f"{key}.sync_every", self.sync_every, 1)
        _real(f"{key}.memory_budget", self.memory_budget, 0.0, 1.0, lo_open=True)
        _real(f"{key}.timeout_s", self.timeout_s, 0.0, 86_400.0, lo_open=True)
        if self.group_size != -1 and self.strategy in ("none", "1d"):
            raise ConfigError(
                f"{key}.group_size = {self.group_size} is for 2D sharding; set {key}.strategy = '2d' or "
                f"'fully_sharded_2d' (or group_size = -1)"
            )
