"""Building the model of a run: a gem-model named config with the dataset's features and the overrides.

``[model.overrides]`` keys are checked here against ``gem_model.GemConfig``'s fields (the field set belongs to
gem-model): an unknown field or a value of the wrong type is a :class:`~gem_train.config.ConfigError` naming
``model.overrides.<field>``. TOML has no null: ``""`` sets a field that may be None to None (e.g.
``model.overrides.cross_item_feature=""`` turns the crosses of the ``tiny-cpu`` config off).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any

import torch

import gem_model
from gem_model import FeatureSpec, GemBatch, GemConfig
from gem_train.config import ConfigError, ModelSection, check_value
from gem_train.evaluation.baselines.mlp import BaselineMLP

__all__ = ["BuiltModel", "build_gem_config", "build_model"]


def build_gem_config(section: ModelSection, spec: FeatureSpec) -> GemConfig:
    """``get_config(section.name)`` with ``features=spec`` and ``section.overrides`` applied."""
    try:
        base = gem_model.get_config(section.name)
    except KeyError as e:
        raise ConfigError(f"model.name: {e.args[0]}") from None
    hints = typing.get_type_hints(GemConfig)
    fields = [f.name for f in dataclasses.fields(GemConfig) if f.name != "features"]
    kwargs: dict[str, Any] = {"features": spec}
    for key, value in section.overrides.items():
        dotted = f"model.overrides.{key}"
        if key not in fields:
            raise ConfigError(f"unknown config key '{dotted}' (GemConfig fields: {', '.join(fields)})")
        if value == "" and type(None) in typing.get_args(hints[key]):
            value = None  # TOML has no null: "" turns an optional field off (cross_item_feature = "")
        kwargs[key] = check_value(value, hints[key], dotted)
    try:
        return dataclasses.replace(base, **kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model.overrides: {e}") from None


@dataclasses.dataclass
class BuiltModel:
    """The model plus what the trainer needs to know about it."""

    model: gem_model.GemModel | BaselineMLP
    gem_config: GemConfig | None  # None for the baseline
    flops: Callable[[GemBatch], int] | None  # model FLOPs of forward+backward of one batch


def build_model(
    section: ModelSection,
    spec: FeatureSpec,
    device: torch.device,
    seed: int,
) -> BuiltModel:
    """Build and initialise the model on ``device`` (the same weights on every rank for the same seed).

    GEM models are built on the meta device, materialised with ``to_empty`` and initialised by
    ``init_weights()`` (no host copy of big tables). Precision, compile and parallelism are applied after,
    by ``gem_parallel.parallelize`` (:func:`gem_train.loop.build.build_model_for`).
    """
    torch.manual_seed(seed)
    if section.arch == "mlp":
        return BuiltModel(BaselineMLP(spec, section.baseline, device=device), None, None)
    cfg = build_gem_config(section, spec)
    model = gem_model.GemModel(cfg, device="meta")
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()
    return BuiltModel(model, cfg, lambda batch: int(gem_model.flops(cfg, batch)))
