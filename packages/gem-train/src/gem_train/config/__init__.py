"""Typed run configuration: dataclasses, TOML loading, ``key=value`` overrides, shipped configs.

A run is a config, not a script (torchtitan style). ``load_config`` reads a TOML file (or a shipped config by
name), applies dotted ``key=value`` overrides, and checks every key and type: an unknown key or a value of the
wrong type raises :class:`ConfigError` naming the dotted key; each section's ``validate()`` then checks the
ranges.

Modules: :mod:`~gem_train.config.schema` (the sections and their checks; ``[data]`` in
:mod:`~gem_train.config.data`), :mod:`~gem_train.config.checks` (the range checks and ``ConfigError``),
:mod:`~gem_train.config.typed` (dict <-> dataclass), :mod:`~gem_train.config.overrides`,
:mod:`~gem_train.config.toml_io` (reading and writing TOML).
"""

from gem_train.config.checks import ConfigError
from gem_train.config.data import DataConfig, MovieLensConfig, ParquetConfig, SyntheticConfig
from gem_train.config.distill import DistillConfig
from gem_train.config.overrides import apply_overrides, parse_override
from gem_train.config.parallel import ParallelSection
from gem_train.config.schema import (
    BaselineConfig,
    CheckpointConfig,
    ModelSection,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
    TrainerConfig,
)
from gem_train.config.toml_io import SHIPPED_CONFIGS, dumps_toml, load_config
from gem_train.config.typed import check_value, config_from_dict, config_to_dict

__all__ = [
    "SHIPPED_CONFIGS",
    "BaselineConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "ModelSection",
    "MovieLensConfig",
    "OptimConfig",
    "ParallelSection",
    "ParquetConfig",
    "PrecisionConfig",
    "RunConfig",
    "SyntheticConfig",
    "TrainConfig",
    "TrainerConfig",
    "apply_overrides",
    "check_value",
    "config_from_dict",
    "config_to_dict",
    "dumps_toml",
    "load_config",
    "parse_override",
]
