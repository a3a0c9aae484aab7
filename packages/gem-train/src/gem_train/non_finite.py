"""What a non-finite training step does: skip its batch (``train.nan_policy = "skip"``) or stop the run."""

from __future__ import annotations

import sys

from gem_train.checkpoint_keeper import CheckpointKeeper
from gem_train.config import TrainerConfig

__all__ = ["NonFiniteLossError", "handle_non_finite"]


class NonFiniteLossError(RuntimeError):
    """The loss (or the dense gradient norm) became NaN/Inf; the message names the step."""


def handle_non_finite(
    step: int, what: str, skipped: int, train: TrainerConfig, checkpoints: CheckpointKeeper, is_main: bool
) -> int:
    """Skip the non-finite step ``step`` (``what``: the loss or grad norm, for the message) and return the
    batches skipped so far (``skipped``: before this one), or raise :class:`NonFiniteLossError` naming the
    last good checkpoint (the unconfirmed ones are set aside) when the policy or the budget says stop."""
    if train.nan_policy == "skip":
        skipped += 1
        if is_main:
            print(f"gem-train: non-finite {what} at step {step}: batch skipped", file=sys.stderr)
        if skipped <= train.max_skipped_batches:
            return skipped
        why = f"more than train.max_skipped_batches = {train.max_skipped_batches} batches skipped"
    else:
        why = "training stopped (train.nan_policy = 'stop')"
    aside = checkpoints.set_aside_unconfirmed()
    ck = checkpoints.last_good
    keep = (
        f"the last good checkpoint is {ck} (resume with: gem-train train --resume {ck})"
        if ck
        else "no good checkpoint was written yet"
    )
    raise NonFiniteLossError(f"non-finite {what} at step {step}: {why}; {keep}{aside}")
