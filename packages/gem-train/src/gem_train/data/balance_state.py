"""Where a run's balanced training stream is (``parallel.balancer = "base_batch_shuffling"``), what its
checkpoints store (``trainer_state["balancer"]``) and how a resume continues it, on any world size.

Saved: ``base`` (first global batch of the plain stream), ``world_size``, ``batch_size``, ``carry`` (per
rank: the ``(global batch, row)`` samples read before the plain stream), ``ranks`` (every rank's shuffler
state after the last trained step) and ``level`` (the common level every rank aims at,
:func:`gem_train.data.balance.common_level`, computed once before the first batch; absent in checkpoints of
an older gem-train, whose streams resume with each rank's running mean as they were written). Same world
size: each rank reloads its state, bit-identical. Another world size:
:func:`gem_train.data.balance.reshard_balancer` lays the unread samples out for the new ranks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from gem_train.config import ConfigError, TrainConfig
from gem_train.data.balance import (
    CALIBRATION_SAMPLES,
    POLICY,
    BalancedTrainStream,
    Sample,
    balanced_stream,
    common_level,
    reshard_balancer,
)
from gem_train.loop.distributed import DistInfo, all_gather_object

__all__ = ["BalancerPosition", "balancer_extra", "resume_balancer"]


@dataclass
class BalancerPosition:
    """This rank's view of the balanced stream: ``base`` (None: not begun), every rank's ``carry``, this
    rank's shuffler ``state`` after the last trained batch (None: nothing trained yet) and the common
    ``level`` (None: not computed yet, or a checkpoint without one: each rank's running mean).
    ``calibration_samples``: the size of the calibration sample of a fresh stream's level."""

    base: int | None = None
    carry: list[list[Sample]] | None = None
    state: dict[str, Any] | None = None
    level: float | None = None
    calibrate: bool = True  # compute the level at the first stream (False once resumed from a checkpoint)
    calibration_samples: int = CALIBRATION_SAMPLES

    def resume(self, saved: dict[str, Any], rank: int, world: int, batch_size: int) -> str | None:
        """Continue a checkpoint's stream; returns what to tell the user when the world size changed."""
        old = int(saved["world_size"])
        level = saved.get("level")
        self.level = None if level is None else float(level)
        # No level saved: a stream of an older gem-train keeps its running means; one that had not trained
        # anything yet (a checkpoint written before its first batch) computes the level as a fresh one does.
        self.calibrate = level is None and not any(s is not None for s in saved["ranks"])
        if old == world:
            self.base = int(saved["base"])
            self.carry = [[(int(b), int(r)) for b, r in c] for c in saved.get("carry") or [[]] * world]
            self.state = saved["ranks"][rank]
            return None
        if int(saved.get("batch_size", -1)) != batch_size:
            raise ConfigError(
                f"parallel.balancer: the checkpoint's balanced stream of {old} ranks has data.batch_size = "
                f"{saved.get('batch_size', 'unknown (an older gem-train)')}, this run {batch_size}; resume "
                f"with its batch size on another world size, or on {old} ranks"
            )
        self.base, self.carry = reshard_balancer(saved, world)
        self.state = None
        n = sum(len(c) for c in self.carry)
        restart = "per-rank seeds; the common level is kept" if self.level is not None else (
            "running mean cost, per-rank seeds")  # fmt: skip
        return (
            f"the balanced stream of {old} ranks continues on {world}: the {n} samples read but not trained "
            f"are read first, then the stream from global batch {self.base}; every sample is trained once, "
            f"but the shufflers restart ({restart}), so batches are composed "
            "differently from a run that kept its world size"
        )

    def saved(self, ranks: list[dict[str, Any] | None], world: int, batch_size: int, base: int) -> dict:
        """The checkpoint entry; ``ranks``: every rank's state; ``base``: the position if not begun."""
        carry = self.carry or [[] for _ in range(world)]
        return {
            "base": self.base if self.base is not None else base, "world_size": world,
            "batch_size": batch_size, "carry": [[list(x) for x in c] for c in carry], "ranks": ranks,
            "level": self.level,
        }  # fmt: skip

    def stream(
        self, source: Any, *, rank: int, world: int, batch_size: int, seed: int, base: int,
        num_workers: int, pin: bool,
    ) -> BalancedTrainStream:  # fmt: skip
        """This rank's balanced stream from where it is (``base``: the position if not begun). A resumed
        stream keeps the policy its checkpoint names (``"sliding"`` in checkpoints written before the switch
        to ``"capped"``), so that it continues exactly, and the level its checkpoint saved; a fresh stream
        first computes the common level (:func:`~gem_train.data.balance.common_level`: every rank alike)."""
        if self.base is None:
            self.base = base
        if self.calibrate:
            self.level, self.calibrate = common_level(source, self.calibration_samples), False
        policy = str(self.state.get("policy", POLICY)) if self.state is not None else POLICY
        stream = balanced_stream(
            source, rank=rank, world_size=world, batch_size=batch_size, seed=seed, base=self.base,
            carry=self.carry[rank] if self.carry else (), num_workers=num_workers, pin=pin, policy=policy,
            mean_cost=self.level,
        )  # fmt: skip
        if self.state is not None:
            stream.load_state_dict(self.state)
        return stream


def resume_balancer(position: BalancerPosition, state: dict[str, Any], cfg: TrainConfig, d: DistInfo) -> None:
    """Continue ``position`` from a checkpoint's ``state`` (with ``parallel.balancer =
    "base_batch_shuffling"``); rank 0 says how the stream continues when the world size changed."""
    saved = state.get("balancer")
    if cfg.parallel.balancer != "base_batch_shuffling" or not saved:
        return  # a checkpoint without a balancer state starts a fresh balanced stream at its position
    note = position.resume(saved, d.rank, d.world_size, cfg.data.batch_size)
    if note and d.is_main:
        print(f"gem-train: {note}", file=sys.stderr)


def balancer_extra(position: BalancerPosition, cfg: TrainConfig, d: DistInfo, base: int) -> dict[str, Any]:
    """The checkpoint's ``{"balancer": ...}`` entry (empty unless ``parallel.balancer`` is
    "base_batch_shuffling"); ``base``: the stream's position if not begun. Every rank calls it."""
    if cfg.parallel.balancer != "base_batch_shuffling":
        return {}
    ranks = all_gather_object(position.state, d.world_size)  # every rank saves (Trainer._extra)
    return {"balancer": position.saved(ranks, d.world_size, cfg.data.batch_size, base)}
