"""The ``[data]`` sections of the run configuration, each with its range checks (``validate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from gem_train.config.checks import ConfigError
from gem_train.config.checks import int_in as _int_in
from gem_train.config.checks import real as _real
from gem_train.config.parquet import ParquetConfig  # [data.parquet] (issue 17)

__all__ = ["DataConfig", "MovieLensConfig", "ParquetConfig", "SyntheticConfig"]


@dataclass
class SyntheticConfig:
    """The built-in synthetic ads dataset (see :mod:`gem_train.data.synthetic`)."""

    num_users: int = 20_000
    num_items: int = 5_000  # ads; history items and candidate ads share this id space
    num_categories: int = 50
    num_advertisers: int = 400
    num_actions: int = 4  # action types in histories (view, click, add-to-cart, buy)
    n_dense: int = 8
    max_len: int = 128  # longest history kept (the most recent events)
    history_dist: Literal["lognormal", "zipf"] = "lognormal"
    history_lognormal_mu: float = 3.0  # median length e^mu ~ 20
    history_lognormal_sigma: float = 1.0
    history_zipf_a: float = 1.6
    item_zipf_s: float = 1.1  # item popularity ~ 1 / rank^s
    base_ctr_logit: float = -1.6
    base_cvr_logit: float = -1.0
    train_examples_per_epoch: int = 0  # 0: an endless stream; else the stream repeats after this many
    eval_examples: int = 8192  # the held-out (test) split
    # The validation split (model selection, early stopping: train.valid_every); its impressions come from
    # their own random stream (split code "valid"), disjoint from the training and the test streams. 0: no
    # validation split (then no checkpoints/best; a warning says so).
    valid_examples: int = 4096
    # Time and drift (knowledge-transfer studies: a teacher trained on an earlier window, a student on a
    # later one). Window w's request times lie in [T0 + w * 60 days, T0 + (w + 1) * 60 days) and its
    # impressions come from their own random streams; `stream` draws another independent sample of the same
    # window's traffic. With drift > 0 the ground truth moves with time: at u = (request_time - T0) / 60 days
    # both tasks' base logits shift by -drift * u and each CTR term's weight is scaled by (1 + drift * u * d)
    # with a fixed direction d per term (gem_train.data.synthetic.DRIFT_DIRECTIONS); the Bayes floor
    # (true_probs) uses each example's own weights. window = stream = 0 and drift = 0: the data as before.
    window: int = 0
    stream: int = 0
    drift: float = 0.0
    # The seed of the hidden world and of every stream; -1: run.seed. Fix it to train several model seeds
    # (run.seed) on the same data, e.g. students of one teacher.
    seed: int = -1
    # Each history event carries its item's category as a one-hot row (JaggedSequence.event_features, width
    # num_categories), as a log with item attributes would; false: item, action and time only (as before).
    history_categories: bool = False

    def validate(self, key: str = "data.synthetic") -> None:
        for name in (
            "num_users",
            "num_items",
            "num_categories",
            "num_advertisers",
            "max_len",
            "eval_examples",
        ):
            _int_in(f"{key}.{name}", getattr(self, name), 1)
        if self.num_actions < 2:
            raise ConfigError(
                f"{key}.num_actions must be >= 2 (views and clicks at least), got {self.num_actions!r}"
            )
        for name in ("n_dense", "train_examples_per_epoch", "valid_examples", "window", "stream"):
            _int_in(f"{key}.{name}", getattr(self, name), 0)
        _real(f"{key}.history_lognormal_mu", self.history_lognormal_mu, -50.0, 50.0)
        _real(f"{key}.history_lognormal_sigma", self.history_lognormal_sigma, 0.0, 50.0)
        _real(f"{key}.history_zipf_a", self.history_zipf_a, 1.0, None, lo_open=True)  # NumPy's zipf: a > 1
        _real(f"{key}.item_zipf_s", self.item_zipf_s, 0.0, 50.0)
        _real(f"{key}.base_ctr_logit", self.base_ctr_logit, -50.0, 50.0)
        _real(f"{key}.base_cvr_logit", self.base_cvr_logit, -50.0, 50.0)
        _real(f"{key}.drift", self.drift, 0.0, 10.0)
        _int_in(f"{key}.seed", self.seed, -1, 2**32 - 1)
        if not isinstance(self.history_categories, bool):
            raise ConfigError(f"{key}.history_categories must be a bool, got {self.history_categories!r}")


@dataclass
class MovieLensConfig:
    """MovieLens-100K as a CTR task (see :mod:`gem_train.data.movielens`)."""

    cache_dir: str = ""  # "" -> $GEM_CACHE_DIR or ~/.cache/gem
    max_len: int = 128
    eval_fraction: float = 0.1  # the last fraction of each user's events (by time): the test split
    # The fraction of each user's events just before the test events: the validation split (model
    # selection); 0 disables it. Training keeps the rest (at least one event per user when it can).
    valid_fraction: float = 0.1
    like_threshold: int = 4  # label = rating >= like_threshold
    max_users: int = 0  # 0: all users; >0 keeps the first users (tests use a small slice)
    # Each history event carries its movie's multi-hot genres (JaggedSequence.event_features); false: the
    # history has item, rating and time only (the behaviour before the feature existed).
    history_genres: bool = True
    # Two more binary tasks from the same rating, trained beside ``ctr`` and never selected on:
    # ``rating_ge3`` (rating >= 3) and ``rating_ge5`` (rating = 5): with ``ctr`` (>= 4 by default) they
    # tell the rating itself apart, an auxiliary signal on every example. false: the one ``ctr`` task.
    rating_tasks: bool = False
    # Two more dense features: the candidate movie's smoothed like rate and mean rating over the training
    # split (the GBDT baseline's item statistics; a training row's own label kept out by 5-fold target
    # encoding, held-out rows see the whole training split). false: the 8 dense features.
    item_stats: bool = False

    def validate(self, key: str = "data.movielens") -> None:
        _int_in(f"{key}.max_len", self.max_len, 1)
        _real(f"{key}.eval_fraction", self.eval_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if not (math.isfinite(self.valid_fraction) and 0.0 <= self.valid_fraction < 1.0) or (
            self.eval_fraction + self.valid_fraction >= 1.0
        ):
            raise ConfigError(
                f"{key}.valid_fraction must be in [0, 1) with eval_fraction + valid_fraction < 1, "
                f"got {self.valid_fraction!r} (eval_fraction {self.eval_fraction!r})"
            )
        # Ratings are 1..5: a threshold of 1 makes every label positive, above 5 every label negative.
        _int_in(f"{key}.like_threshold", self.like_threshold, 2, 5)
        _int_in(f"{key}.max_users", self.max_users, 0)
        for name in ("history_genres", "rating_tasks", "item_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{key}.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class DataConfig:
    """Which dataset, batch sizes, loader workers."""

    source: Literal["synthetic", "movielens-100k", "parquet"] = "synthetic"
    batch_size: int = 256
    eval_batch_size: int = 1024
    num_workers: int = 0  # DataLoader worker processes per rank (0: load in the main process)
    # Standardise the dense features with the mean and standard deviation of the first training batches
    # (measured before training, stored in the checkpoint as buffers of the model's ``dense_norm`` module,
    # so evaluation and resume use the same statistics). false: the features go in as they are (a warning
    # says when one is far from unit scale).
    normalize_dense: bool = False
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    movielens: MovieLensConfig = field(default_factory=MovieLensConfig)
    parquet: ParquetConfig = field(default_factory=ParquetConfig)  # your own Parquet files

    def validate(self, key: str = "data") -> None:
        _int_in(f"{key}.batch_size", self.batch_size, 1)
        _int_in(f"{key}.eval_batch_size", self.eval_batch_size, 1)
        _int_in(f"{key}.num_workers", self.num_workers, 0, 256)
        self.synthetic.validate(f"{key}.synthetic")
        self.movielens.validate(f"{key}.movielens")
        self.parquet.validate(f"{key}.parquet", required=self.source == "parquet")
