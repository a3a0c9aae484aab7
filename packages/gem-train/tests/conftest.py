"""Fixtures shared by the gem-train tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gem_train.config import TrainConfig, load_config

# A small, fast tiny-cpu run: 16 examples per batch, one layer, short histories, a small test split.
SMALL_RUN = (
    "data.batch_size=16",
    "data.eval_batch_size=128",
    "data.synthetic.eval_examples=128",
    "data.synthetic.valid_examples=128",
    "model.overrides.n_layers=1",
    'model.overrides.attention="full"',
    "data.synthetic.max_len=16",
    "data.synthetic.num_users=500",
    "data.synthetic.num_items=300",
    "train.log_every=2",
    "train.progress_bar=false",
    "optim.warmup_steps=2",
)


@pytest.fixture
def small_overrides() -> list[str]:
    """The ``key=value`` overrides of a small tiny-cpu run (for the command line)."""
    return list(SMALL_RUN)


@pytest.fixture
def small_config() -> Callable[..., TrainConfig]:
    """``make(out_dir, *extra)``: the small tiny-cpu run writing under ``out_dir``, plus ``extra``
    overrides (later overrides win)."""

    def make(out_dir: Path, *extra: str) -> TrainConfig:
        return load_config("tiny-cpu", [*SMALL_RUN, f"run.out_dir={out_dir}", *extra])

    return make
