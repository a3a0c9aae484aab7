"""How long a run trains and when it validates, resolved from the config and the dataset.

- ``train.epochs > 0``: ``steps = ceil(epochs x batches per epoch / ranks)`` (finite datasets only; each step
  consumes one batch of ``data.batch_size`` per rank); else ``train.steps``.
- The validation split: every dataset has one by default (``data.synthetic.valid_examples``,
  ``data.movielens.valid_fraction``, ``data.parquet.valid`` files or else ``data.parquet.valid_fraction`` of
  the training rows by time). Set to 0 there is none: a warning says that no model selection happens.
- ``train.valid_every``: ``"auto"`` validates about :data:`VALIDATIONS_PER_RUN` times per run (every
  ``ceil(steps / 10)`` steps), and at least once per pass over a finite training set (every
  ``batches per pass / ranks`` steps when that is sooner: a small table overfits within a few passes, and
  early stopping counts validations); ``N`` every ``N`` steps, ``0`` only at the end. Every run with a
  validation split validates at its last step, so ``checkpoints/best`` always exists after it.

:func:`resolve_schedule` makes the :class:`Schedule`; :func:`scheduled_config` the config the loop runs by,
whose ``train.steps``, ``train.valid_every`` (an int: ``0`` now means no validation, ``steps`` only at the
end) and ``train.early_stop_patience`` (0 without validation) are the resolved ones. The run's own config
(config.toml, checkpoints) keeps what the user wrote.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from gem_train.config import ConfigError, TrainConfig, TrainerConfig

__all__ = [
    "VALIDATIONS_PER_RUN",
    "Schedule",
    "resolve_schedule",
    "resolved_valid_every",
    "scheduled_config",
    "train_rows",
]

VALIDATIONS_PER_RUN = 10  # train.valid_every = "auto"


@dataclass(frozen=True)
class Schedule:
    """A run's length and validation points; see the module docstring."""

    steps: int
    valid_every: int  # steps between validations (== steps: only at the end); 0: no validation split
    early_stop_patience: int  # 0: off (also without a validation split)
    batch_size: int  # per rank and step
    world_size: int
    train_rows: int | None  # examples in one pass over the training data (None: an endless stream)
    valid_note: str  # where the validation split comes from (or that there is none)

    @property
    def validates(self) -> bool:
        return self.valid_every > 0

    @property
    def examples(self) -> int:
        """Training examples the run consumes (all ranks)."""
        return self.steps * self.batch_size * self.world_size

    @property
    def passes(self) -> float | None:
        """Passes over the training data (None: an endless stream)."""
        return self.examples / self.train_rows if self.train_rows else None

    def describe(self) -> str:
        """The log line: steps, passes over the training data, batch and ranks."""
        per = f"{self.batch_size:,} per step x {self.world_size} rank{'s' if self.world_size > 1 else ''}"
        if self.passes is None:
            endless = f"{self.examples:,} examples of an endless stream, each seen once"
            return f"{self.steps:,} steps = {endless} ({per})"
        rows = f"{self.train_rows:,} training rows"
        return f"{self.steps:,} steps = {self.passes:.2f} passes over {rows} ({per})"

    def describe_validation(self) -> str:
        """When the validation split is evaluated (or that it is not)."""
        if not self.validates:
            return "no validation"
        if self.valid_every >= self.steps:
            when = "at the last step"
        else:
            when = f"every {self.valid_every:,} steps and at the last step"
        stop = (
            f"early stopping after {self.early_stop_patience} validations without a new best"
            if self.early_stop_patience and self.valid_every < self.steps
            else "no early stopping"
        )
        return f"validation {when} (best checkpoint: checkpoints/best), {stop}"

    def as_dict(self) -> dict[str, Any]:
        """For eval.json."""
        return {
            "steps": self.steps,
            "valid_every": self.valid_every,
            "early_stop_patience": self.early_stop_patience,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "train_rows": self.train_rows,
            "passes": self.passes,
            "validation": self.valid_note,
        }


def train_rows(cfg: TrainConfig, source: Any) -> int | None:
    """Examples in one pass over the training data of ``source`` (None: an endless stream)."""
    if cfg.data.source == "synthetic":
        return cfg.data.synthetic.train_examples_per_epoch or None
    if cfg.data.source == "parquet":
        return int(source.rows("train"))
    rows = getattr(source, "train_rows", None)  # MovieLens: the training events
    return len(rows) if rows is not None else None


def _valid_key(cfg: TrainConfig) -> str:
    return {
        "synthetic": "data.synthetic.valid_examples",
        "movielens-100k": "data.movielens.valid_fraction",
        "parquet": "data.parquet.valid (files) or data.parquet.valid_fraction",
    }[cfg.data.source]


def _valid_note(cfg: TrainConfig, source: Any, valid_batches: int) -> str:
    """Where the validation split comes from, with its size."""
    if cfg.data.source == "parquet":
        return str(source.valid_note)
    if not valid_batches:
        return f"no validation split ({_valid_key(cfg)} = 0)"
    if cfg.data.source == "synthetic":
        return (
            f"validation split: data.synthetic.valid_examples = {cfg.data.synthetic.valid_examples:,} "
            "impressions of their own random stream (disjoint from training and test)"
        )
    ml = cfg.data.movielens
    return (
        f"validation split: {len(source.valid_rows):,} events, the data.movielens.valid_fraction = "
        f"{ml.valid_fraction:g} of each user's events just before the user's test events; training keeps "
        f"{len(source.train_rows):,}"
    )


def resolve_schedule(cfg: TrainConfig, source: Any, world_size: int) -> Schedule:
    """The :class:`Schedule` of ``cfg`` on ``source`` with ``world_size`` ranks.

    Raises:
        ConfigError: ``train.epochs`` on an endless stream; ``train.valid_every = N > 0`` asked for without
            a validation split.
    """
    t, b = cfg.train, cfg.data.batch_size
    rows = train_rows(cfg, source)
    if t.epochs > 0:
        if rows is None:
            raise ConfigError(
                f"train.epochs = {t.epochs:g} needs a finite training set, but the synthetic stream is "
                "endless (set data.synthetic.train_examples_per_epoch > 0, or train.steps with "
                "train.epochs = 0)"
            )
        per_epoch = source.num_batches("train", b)
        steps = max(1, math.ceil(t.epochs * per_epoch / world_size))
    else:
        steps = t.steps
    valid_batches = source.num_batches("valid", cfg.data.eval_batch_size) or 0
    if not valid_batches:
        if isinstance(t.valid_every, int) and t.valid_every > 0:
            raise ConfigError(
                f"train.valid_every = {t.valid_every} needs a validation split, but the dataset has none "
                f"(set {_valid_key(cfg)} > 0, or train.valid_every = 'auto' or 0)"
            )
        every = 0
    elif t.valid_every == "auto":
        every = max(1, math.ceil(steps / VALIDATIONS_PER_RUN))
        if rows is not None:  # at least once per pass over the training data
            every = min(every, max(1, source.num_batches("train", b) // world_size))
    else:
        every = int(t.valid_every) or steps  # 0: only at the last step
    patience = t.early_stop_patience if every else 0
    return Schedule(steps, every, patience, b, world_size, rows, _valid_note(cfg, source, valid_batches))


def resolved_valid_every(train: TrainerConfig) -> int:
    """``train.valid_every`` of a config made by :func:`scheduled_config` (an int: 0 = no validation)."""
    if not isinstance(train.valid_every, int):
        raise TypeError(f"train.valid_every = {train.valid_every!r} is not resolved (scheduled_config)")
    return train.valid_every


def scheduled_config(cfg: TrainConfig, schedule: Schedule) -> TrainConfig:
    """A copy of ``cfg`` whose ``train`` section holds the resolved schedule (what the loop runs by)."""
    out = copy.deepcopy(cfg)
    out.train.steps = schedule.steps
    out.train.valid_every = schedule.valid_every
    out.train.early_stop_patience = schedule.early_stop_patience
    out.train.epochs = 0.0
    return out
