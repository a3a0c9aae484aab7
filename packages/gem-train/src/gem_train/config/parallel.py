"""The ``[parallel]`` section: how a multi-process run (``torchrun``) lays out the model and the data.

With one process the degrees and the table strategy do not apply. Under ``torchrun``, with no
``[parallel]`` section at all, the defaults are FSDP2 over all ranks (``dp_shard = -1``) and, when
gem-parallel's sparse sharding is installed, 1D sharded embedding tables (``strategy = "auto"``).

The options and their choices are gem-parallel's (``gem_parallel.config``: the same ``Literal`` types,
checked by ``gem_parallel.ParallelConfig`` itself); :mod:`gem_train.loop.parallel` turns the section into
gem-parallel's typed config. The degrees are checked by ``gem_parallel.ParallelDims``: here for the smallest
world they fit, and against the real world size when a multi-process run starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gem_parallel import ParallelDims
from gem_parallel.config import (
    ActivationCheckpointing,
    AllGatherFormat,
    EmbeddingStrategy,
    ParallelConfig,
    SavedActivationFormat,
)
from gem_train.config.checks import ConfigError
from gem_train.config.checks import real as _real

__all__ = ["ParallelSection", "toml_message"]


def toml_message(e: ValueError) -> str:
    """gem-parallel's error text with its field names (``ParallelConfig.memory_budget``, ``ParallelDims:``)
    turned into this section's TOML keys."""
    text = str(e).replace("ParallelConfig.", "parallel.").replace("FSDPConfig.", "parallel.fsdp.")
    text = text.replace("ParallelDims: ", "parallel: ").replace("sparse_group", "group_size")
    text = text.replace("set compile=True", "set train.compile = true")
    return text if text.startswith("parallel") else f"parallel: {text}"


@dataclass
class ParallelSection:
    """Degrees (``gem_parallel.ParallelDims``) and what ``gem_parallel.parallelize`` applies."""

    dp_replicate: int = 1  # HSDP replicas of the dense parameters (outermost axis)
    dp_shard: int = -1  # FSDP shard group size; -1: world // dp_replicate
    ep: int = 1  # expert-parallel degree (a divisor of dp_shard and of the model's n_experts)
    # Embedding tables: "auto" = "1d" when gem_parallel.sparse is installed, else "none"; "none" leaves
    # them to FSDP as ordinary (row-sharded) parameters with gem-train's row-wise Adagrad.
    strategy: Literal["auto", "none"] | EmbeddingStrategy = "auto"
    group_size: int = -1  # ranks per embedding sharding group (2D); -1: the world (1D)
    sync_every: int = 1  # 2D: steps between weight syncs of the table replicas
    all_gather: AllGatherFormat = "bf16"  # FSDP all-gather format of large linear weights
    activation_checkpointing: ActivationCheckpointing = "none"
    memory_budget: float = 0.5  # "budget": the share of activation memory kept, in (0, 1]
    saved_activations: SavedActivationFormat = "bf16"  # storage of saved activations
    # Jagged-batch load balancing: "base_batch_shuffling" (each rank's own batches, gem_train.data.balance)
    # or "global" (every step's samples repartitioned across the ranks, gem_train.data.global_balance).
    balancer: Literal["none", "base_batch_shuffling", "global"] = "none"
    # "base_batch_shuffling": rows of the training split whose mean cost is the level every rank aims at
    # (gem_train.data.balance.common_level: read identically on every rank, no communication). Read once by a
    # fresh balanced stream; a resume keeps its checkpoint's level.
    balancer_calibration: int = 1_048_576
    # Collective timeout (s) of the process group: a rank that died or hangs makes every other rank fail
    # with an error after at most this long, never a silent hang.
    timeout_s: float = 600.0

    def validate(self, key: str = "parallel") -> None:
        try:  # gem-parallel's own checks of the options (compile is train.compile's, checked at start)
            ParallelConfig(
                all_gather=self.all_gather, activation_checkpointing=self.activation_checkpointing,
                memory_budget=self.memory_budget, saved_activations=self.saved_activations,
                embedding_sync_every=self.sync_every, compile=True,
            )  # fmt: skip
        except ValueError as e:
            raise ConfigError(toml_message(e)) from None
        self._check_degrees()
        _real(f"{key}.timeout_s", self.timeout_s, 0.0, 86_400.0, lo_open=True)
        n = self.balancer_calibration
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"{key}.balancer_calibration must be an int >= 1 (rows), got {n!r}")
        if self.group_size != -1 and self.strategy in ("none", "1d"):
            raise ConfigError(
                f"{key}.group_size = {self.group_size} is for 2D sharding; set {key}.strategy = '2d' or "
                f"'fully_sharded_2d' (or group_size = -1)"
            )

    def _check_degrees(self) -> None:
        """gem-parallel's checks of the degrees (positive ints, ep dividing dp_shard) on the smallest world
        they fit; a value that is not a positive int goes through as it is, for ParallelDims to name it."""

        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        r, s, e, g = self.dp_replicate, self.dp_shard, self.ep, self.group_size
        fits = count(r) and count(e) and (s == -1 or count(s))
        world = r * (e if s == -1 else s) if fits else 1
        try:
            ParallelDims(
                dp_replicate=r, dp_shard=s, ep=e, sparse_group=-1 if g == -1 or count(g) else g,
                world_size=world, ranks_per_host=world,
            )  # fmt: skip
        except ValueError as err:
            raise ConfigError(toml_message(err)) from None
