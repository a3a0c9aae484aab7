"""Which checkpoints of a run are *good*, and saving the training state.

A checkpoint is good once a finite step has been computed from its state. Until then it is *unconfirmed*,
and the good one before it is kept (never pruned) and named as "the last good checkpoint" if training
diverges; the unconfirmed one is then set aside.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gem_train.checkpoint import (
    checkpoint_pending,
    checkpoint_step,
    list_checkpoints,
    prune_checkpoints,
    save_checkpoint,
    set_aside_checkpoint,
    wait_for_checkpoints,
)
from gem_train.loop.distributed import DistInfo

__all__ = ["CheckpointKeeper", "data_position", "data_stream_state", "is_step_checkpoint", "reshard_note"]


def data_stream_state(source: Any, world_size: int, num_workers: int) -> dict[str, Any]:
    """``{"data_stream": ...}`` for a source whose position needs its layout (gem_train.data.parquet)."""
    state = getattr(source, "stream_state", None)
    return {"data_stream": state(world_size, num_workers)} if state is not None else {}


def reshard_note(state: dict[str, Any], world: int, position: int) -> str:
    """What a resume on another world size carries over and what it cannot (said at start-up)."""
    reset = (
        "; the tables' row-wise Adagrad accumulators restart at zero (TorchRec-sharded tables on one side "
        "only)"
        if state.get("sparse_state_reset")
        else ""
    )
    return (
        f"resuming a {state['world_size']}-process checkpoint on {world} process(es): model and optimizer "
        f"states resharded, the data stream continues at global batch {position}; the per-rank RNG streams "
        f"are reseeded, so the run is not bit-identical to one that kept its world size{reset}"
    )


def data_position(state: dict[str, Any]) -> int:
    """The training stream's position in a checkpoint's trainer state, in global batches consumed (older
    checkpoints stored the batches consumed by each rank)."""
    if state.get("data_position_unit") == "global_batches":
        return int(state["data_position"])
    return int(state["data_position"]) * int(state["world_size"])


def is_step_checkpoint(path: Path) -> bool:
    """A periodic/final ``step_<N>`` checkpoint (or its ``.replaced-`` copy), not a ``best_step_<N>``."""
    return re.match(r"^(\.replaced-)?step_\d+$", path.name) is not None


class CheckpointKeeper:
    """The ``step_<N>`` checkpoints of one run under ``root``: ``last`` (the newest of this state),
    ``last_good`` and the ``unconfirmed`` one."""

    def __init__(
        self, root: Path, keep_last: int, d: DistInfo, resume_from: Path | None, start_step: int
    ) -> None:
        self.root, self.keep_last, self.dist = root, keep_last, d
        self.last: Path | None = resume_from
        self.unconfirmed: Path | None = None
        self.last_good: Path | None = None
        self.saved_step: int | None = None  # the step of the newest step_<N> checkpoint of this state
        if resume_from is not None and is_step_checkpoint(resume_from):
            self.saved_step = start_step
            self.unconfirmed = resume_from
            older = [c for c in list_checkpoints(root) if (checkpoint_step(c) or 0) < start_step]
            self.last_good = older[-1] if older else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        extra: dict[str, Any],
        sparse: Any = None,
    ) -> Path:
        """Checkpoint the current state as ``step`` (all ranks call). The last good checkpoint is kept
        whatever ``keep_last`` says until a finite step confirms this one.

        Returns once the files are written: the seal (hashing, manifest, rename, pruning) runs in the
        background (:func:`gem_train.checkpoint.wait_for_checkpoints`)."""
        protect = [self.last_good] if self.last_good is not None else []
        path = save_checkpoint(
            self.root, step, model, optimizers, extra, self.keep_last, protect=protect, background=True,
            sparse=sparse,
        )  # fmt: skip
        self.last = self.unconfirmed = path
        self.saved_step = step
        return path

    def confirm(self) -> None:
        """A finite step was computed from the unconfirmed checkpoint's state: it is good; the good one it
        superseded may now be pruned by ``keep_last``."""
        if self.unconfirmed is None:
            return
        self.last_good, self.unconfirmed = self.unconfirmed, None
        # While a seal is in flight its own pruning (and the next save's) does this: it never waits here.
        if self.dist.is_main and not checkpoint_pending():
            prune_checkpoints(self.root, self.keep_last, protect=[self.last_good])

    def set_aside_unconfirmed(self) -> str:
        """Training diverged: the unconfirmed checkpoint (whose state gave the non-finite step) is renamed
        out of the way, so resuming the run takes the last good one. Returns a sentence for the error."""
        wait_for_checkpoints()  # every rank is here (the loss is averaged): the unconfirmed one is sealed
        ck, self.unconfirmed = self.unconfirmed, None
        if ck is None or not is_step_checkpoint(ck):
            return ""
        if self.dist.is_main and ck.exists():
            moved = set_aside_checkpoint(ck)
            return f"; {ck.name}, saved since the last finite step, was set aside as {moved.name}"
        return ""
