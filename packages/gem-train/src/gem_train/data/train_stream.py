"""This rank's training batches: the plain loader, its ``"global"`` rebalancing, or the balanced stream."""

from __future__ import annotations

from typing import Any

from gem_train.config import TrainConfig
from gem_train.data.balance_state import BalancerPosition
from gem_train.data.global_balance import GlobalBalancedStream
from gem_train.data.loader import BatchSource, make_train_loader
from gem_train.loop.distributed import DistInfo

__all__ = ["train_stream"]


def train_stream(
    cfg: TrainConfig,
    source: BatchSource,
    d: DistInfo,
    pin: bool,
    balancer: BalancerPosition,
    position: int,
) -> Any:
    """This rank's training batches from global batch ``position`` on, per ``parallel.balancer``: the
    loader (pinned if ``pin``), the loader rebalanced across ranks ("global"), or ``balancer``'s stream."""
    if cfg.parallel.balancer != "base_batch_shuffling":
        global_ = cfg.parallel.balancer == "global" and d.world_size > 1
        loader = make_train_loader(
            source, cfg.data.batch_size, position=position, rank=d.rank,
            world_size=d.world_size, num_workers=cfg.data.num_workers, pin_memory=pin and not global_,
        )  # fmt: skip
        # "global": the same stream, each step's samples rebalanced across the ranks (no state).
        return GlobalBalancedStream(loader, pin=pin) if global_ else loader
    return balancer.stream(
        source, rank=d.rank, world=d.world_size, batch_size=cfg.data.batch_size,
        seed=cfg.run.seed, base=position, num_workers=cfg.data.num_workers, pin=pin,
    )  # fmt: skip
