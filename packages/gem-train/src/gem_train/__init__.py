"""gem_train: the ``gem-train`` command — configs, data, training loop, evaluation, checkpoints, MFU.

The public API below is what the command is built from; ``gem-train --help`` is the user interface.
"""

from gem_train.baseline import BaselineMLP
from gem_train.checkpoint import (
    CheckpointError,
    best_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_trainer_state,
    save_best_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    wait_for_checkpoints,
)
from gem_train.config import SHIPPED_CONFIGS, ConfigError, TrainConfig, load_config
from gem_train.data.loader import BatchSource, LoadedBatch, make_eval_loader, make_train_loader
from gem_train.data.movielens import MovieLens100K, MovieLensFormatError, fetch_movielens_100k
from gem_train.data.parquet.config import ParquetConfig
from gem_train.data.parquet.errors import ParquetDataError
from gem_train.data.parquet.inspect import inspect_dataset
from gem_train.data.parquet.reader import ParquetSource
from gem_train.data.synthetic import SyntheticAds
from gem_train.evaluation import EvalResult, evaluate_model, selection_value
from gem_train.metrics import (
    BinaryMetrics,
    auc,
    binary_metrics,
    calibration,
    log_loss,
    normalized_entropy,
    reliability_bins,
)
from gem_train.mfu import PEAK_FLOPS, device_peak_flops
from gem_train.model_factory import build_gem_config, build_model
from gem_train.optim import RowWiseAdagrad, build_optimizers, lr_factor
from gem_train.run import Run, build_run
from gem_train.run_dir import RunDir
from gem_train.trainer import NonFiniteLossError, Trainer, TrainResult

__version__ = "0.1.0"

__all__ = [
    "PEAK_FLOPS",
    "SHIPPED_CONFIGS",
    "BaselineMLP",
    "BatchSource",
    "BinaryMetrics",
    "CheckpointError",
    "ConfigError",
    "EvalResult",
    "LoadedBatch",
    "MovieLens100K",
    "MovieLensFormatError",
    "NonFiniteLossError",
    "ParquetConfig",
    "ParquetDataError",
    "ParquetSource",
    "RowWiseAdagrad",
    "Run",
    "RunDir",
    "SyntheticAds",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "auc",
    "best_checkpoint",
    "binary_metrics",
    "build_gem_config",
    "build_model",
    "build_optimizers",
    "build_run",
    "calibration",
    "device_peak_flops",
    "evaluate_model",
    "fetch_movielens_100k",
    "inspect_dataset",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_config",
    "log_loss",
    "lr_factor",
    "make_eval_loader",
    "make_train_loader",
    "normalized_entropy",
    "read_trainer_state",
    "reliability_bins",
    "save_best_checkpoint",
    "save_checkpoint",
    "selection_value",
    "verify_checkpoint",
    "wait_for_checkpoints",
]
