"""What a non-finite training step does: skip its batch (``train.nan_policy = "skip"``) or stop the run."""

from __future__ import annotations

import math
import sys

from gem_train.checkpoint.keeper import CheckpointKeeper
from gem_train.config import TrainerConfig
from gem_train.loop.schedule import resolved_valid_every

__all__ = ["NonFiniteLossError", "handle_non_finite", "step_is_boundary"]


class NonFiniteLossError(RuntimeError):
    """The loss (or the dense gradient norm) became NaN/Inf; the message names the step."""


def step_is_boundary(train: TrainerConfig, checkpoint_every: int, step: int, stop_after: int | None) -> bool:
    """Whether a log, evaluation, validation, checkpoint or the end follows (1-based) ``step``: the loop
    reads such a step's loss at once (a non-finite one must not be followed by them); another step's is read
    after the next step is queued."""
    valid_every = resolved_valid_every(train)
    return (
        step % train.log_every == 0
        or step == train.steps
        or bool(train.eval_every and step % train.eval_every == 0)
        or bool(valid_every and step % valid_every == 0)
        or bool(checkpoint_every and step % checkpoint_every == 0)
        or (stop_after is not None and step >= stop_after)
    )


def handle_non_finite(
    step: int,
    loss: float,
    grad_norm: float,
    skipped: int,
    train: TrainerConfig,
    checkpoints: CheckpointKeeper,
    is_main: bool,
) -> int:
    """Skip the non-finite step ``step`` (its ``loss`` or ``grad_norm`` is NaN/Inf) and return the
    batches skipped so far (``skipped``: before this one), or raise :class:`NonFiniteLossError` naming the
    last good checkpoint (the unconfirmed ones are set aside) when the policy or the budget says stop."""
    what = f"loss {loss}" if not math.isfinite(loss) else f"dense grad norm {grad_norm}"
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
