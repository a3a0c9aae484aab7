"""How big a model a table can train, and for how long: the suggestion of ``gem-train data inspect``.

The rule is the one the ``small_table`` health check applies (:data:`gem_train.evaluation.health.
PARAMS_PER_EXAMPLE` dense parameters per training row at most, measured in BENCHMARKS.md): the largest
gem-model named config within it, else the MLP baseline, else logistic regression. The run length is
:data:`SMALL_TABLE_EPOCHS` passes below :data:`LARGE_TABLE_ROWS` training rows and 1 pass above (ads models
overfit once they see an example again, the "one-epoch phenomenon"; on MovieLens-100K the shipped run's
best validation step is at about 2 passes), with validation and early stopping on to pick the best step.
Parameters are counted on the meta device: nothing is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gem_model import CONFIG_NAMES, FeatureSpec, GemModel
from gem_train.config import BaselineConfig, ModelSection
from gem_train.evaluation.baselines.mlp import BaselineMLP
from gem_train.evaluation.health import PARAMS_PER_EXAMPLE
from gem_train.loop.model import build_gem_config

__all__ = ["LARGE_TABLE_ROWS", "SMALL_TABLE_EPOCHS", "Suggestion", "model_sizes_for", "suggest"]

SMALL_TABLE_EPOCHS = 3
LARGE_TABLE_ROWS = 10_000_000


@dataclass(frozen=True)
class Suggestion:
    """A model and a run length for a table of ``train_rows`` training rows."""

    train_rows: int
    model: str  # the config keys to set, e.g. "model.name = 'tiny'"
    dense_params: int
    epochs: float
    steps: int
    batch_size: int
    sizes: dict[str, int]  # dense parameters of every candidate

    def text(self) -> str:
        per = self.dense_params / max(self.train_rows, 1)
        return (
            f"suggested for {self.train_rows:,} training rows: {self.model} ({self.dense_params:,} dense "
            f"parameters, {per:.1f} per row; at most {PARAMS_PER_EXAMPLE:g}), train.epochs = {self.epochs:g} "
            f"(= {self.steps:,} steps of {self.batch_size:,}) with validation and early stopping on (the "
            "defaults); candidates' dense parameters: "
            + ", ".join(f"{k} {v:,}" for k, v in self.sizes.items())
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "train_rows": self.train_rows,
            "model": self.model,
            "dense_params": self.dense_params,
            "epochs": self.epochs,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "sizes": dict(self.sizes),
            "text": self.text(),
        }


def _dense(model: Any) -> int:
    return sum(p.numel() for p in model.dense_parameters())


def model_sizes_for(spec: FeatureSpec) -> dict[str, int]:
    """Dense (non-embedding) parameters of each candidate for ``spec``, smallest first: logistic
    regression, the MLP baseline (default widths), then every gem-model named config."""
    sizes: dict[str, int] = {}
    with torch.device("meta"):
        sizes["model.arch = 'mlp', model.baseline.hidden = []"] = _dense(
            BaselineMLP(spec, BaselineConfig(hidden=[]))
        )
        sizes["model.arch = 'mlp'"] = _dense(BaselineMLP(spec, BaselineConfig()))
        for name in CONFIG_NAMES:
            cfg = build_gem_config(ModelSection(name=name), spec)
            sizes[f"model.name = '{name}'"] = _dense(GemModel(cfg, device="meta"))
    return sizes


def suggest(spec: FeatureSpec, train_rows: int, batch_size: int) -> Suggestion:
    """The largest candidate of :func:`model_sizes_for` within :data:`PARAMS_PER_EXAMPLE` dense parameters
    per training row (the smallest if none is), and the run length (see the module docstring)."""
    sizes = model_sizes_for(spec)
    fits = [k for k, v in sizes.items() if v <= PARAMS_PER_EXAMPLE * train_rows]
    model = fits[-1] if fits else next(iter(sizes))
    epochs = float(SMALL_TABLE_EPOCHS if train_rows < LARGE_TABLE_ROWS else 1)
    steps = max(1, math.ceil(epochs * max(1, train_rows // batch_size)))
    return Suggestion(train_rows, model, sizes[model], epochs, steps, batch_size, sizes)
