"""gem_train: the ``gem-train`` command — configs, data, training loop, evaluation, checkpoints, MFU.

The public face is small: a config (:class:`TrainConfig`, :func:`load_config`), the run builder
(:func:`build_run` -> :class:`BuiltRun`), the loop (:class:`Trainer` -> :class:`TrainResult`) and the command
(:func:`main`). The rest lives in subpackages, one job each:

- :mod:`gem_train.config`: the TOML schema, loading, overrides (at the bottom: imports no other part);
- :mod:`gem_train.data`: the datasets (synthetic, MovieLens-100K, your own Parquet files), loaders, balancing;
- :mod:`gem_train.loop`: the run builder, the step and its pipeline, the trainer, optimizers, signals,
  non-finite handling, prefetch, the translation of the config for gem-parallel;
- :mod:`gem_train.checkpoint`: atomic, verified DCP checkpoints (layout, files, state, RNG, save, load);
- :mod:`gem_train.evaluation.evaluate`: evaluation, model selection, metrics, reports, plots, the baselines;
- :mod:`gem_train.cli`: the ``gem-train`` command and ``gem-train launch``.

Names are imported on first use (PEP 562), so ``import gem_train`` and ``gem-train --help`` load no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gem_train.cli import main
    from gem_train.config import ConfigError, TrainConfig, load_config
    from gem_train.loop.build import build_run
    from gem_train.loop.step import BuiltRun
    from gem_train.loop.trainer import Trainer, TrainResult

__version__ = "0.1.0"

_HOMES = {
    "BuiltRun": "gem_train.loop.step",
    "ConfigError": "gem_train.config",
    "TrainConfig": "gem_train.config",
    "TrainResult": "gem_train.loop.trainer",
    "Trainer": "gem_train.loop.trainer",
    "build_run": "gem_train.loop.build",
    "load_config": "gem_train.config",
    "main": "gem_train.cli",
}

__all__ = [
    "BuiltRun",
    "ConfigError",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "build_run",
    "load_config",
    "main",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'gem_train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
