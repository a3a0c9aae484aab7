"""The GBDT baseline's feature matrices of the three splits, from any batch source.

:class:`GbdtFeatureBuilder` reads the training split twice: once to record the training log (candidate rows,
distinct history events, the item's attributes: :mod:`.training_log`), once to build each training row's
features with it. The held-out splits are read once each. Training batches are read in index order with the
run's batch size (the same rows the MLP and GEM see, epoch 0 of the run's seed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gem_model import GemBatch
from gem_train.config.gbdt import GbdtConfig, resolve_item_feature, resolve_user_feature
from gem_train.data.loader import BatchSource
from gem_train.data.split import HeldOutSplit
from gem_train.evaluation.baselines.gbdt_features import (
    USER_PRIOR,
    FeatureOptions,
    HistoryFeatures,
    item_stats,
    static_features,
    static_names,
)
from gem_train.evaluation.baselines.item_stats import ItemStats
from gem_train.evaluation.baselines.training_log import TrainingLog, TrainingLogBuilder, single_ids

__all__ = ["GbdtFeatureBuilder", "SplitMatrix"]


@dataclass
class SplitMatrix:
    """Features ``x`` ``[N, F]`` float64 (NaN: missing), labels ``y`` ``[N, T]`` and mask ``[N, T]``."""

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray


class GbdtFeatureBuilder:
    """Features of a source's splits (see :mod:`.gbdt_features`); call :meth:`fit` first.

    Args:
        source: the data.
        cfg: the ``[model.gbdt]`` section.
        like_action: the smallest history action id that counts as a like.
        batch_size, eval_batch_size: the run's batch sizes (training, held-out).
        train_batches: training batches to read (one pass over a finite split; a cap for an endless one).
        options: the feature knobs (default :class:`FeatureOptions`).
        seed: of the k-fold assignment of the item statistics.
    """

    def __init__(
        self,
        source: BatchSource,
        cfg: GbdtConfig,
        like_action: int,
        batch_size: int,
        eval_batch_size: int,
        train_batches: int,
        options: FeatureOptions | None = None,
        seed: int = 0,
    ) -> None:
        self.source, self.spec, self.seed = source, source.spec, seed
        self.like_action = like_action
        self.options = options or FeatureOptions()
        self.batch_size, self.eval_batch_size, self.train_batches = batch_size, eval_batch_size, train_batches
        linked = resolve_item_feature(cfg, self.spec)
        self.item_feature: str | None = linked[0] if linked else None
        self.linked: int | None = linked[1] if linked else None
        self.user_feature = resolve_user_feature(cfg, self.spec)
        self.log: TrainingLog | None = None
        self.items: ItemStats | None = None
        self.history: HistoryFeatures | None = None

    def _train_batch(self, i: int) -> GemBatch:
        return self.source.get("train", i, self.batch_size).batch

    def fit(self) -> None:
        """Read the training split once: the log, the item statistics and the history features' tables."""
        builder = TrainingLogBuilder(self.spec, self.item_feature, self.linked or 0, self.user_feature)
        for i in range(self.train_batches):
            builder.add(self._train_batch(i))
        self.log = log = builder.finish()
        if self.item_feature is not None:
            num_items = self.spec.sequences[self.linked or 0].num_items
            self.items = item_stats(log, num_items, self.spec, self.options, self.seed)
        self.history = HistoryFeatures(
            self.spec, self.like_action, USER_PRIOR, self.options, self.linked,
            log.attributes,
        )  # fmt: skip

    @property
    def names(self) -> list[str]:
        assert self.history is not None, "call fit() first"
        return static_names(self.spec)[0] + self.history.names + (self.items.names if self.items else [])

    @property
    def categorical(self) -> list[bool]:
        return static_names(self.spec)[1] + [False] * (len(self.names) - len(static_names(self.spec)[1]))

    def _row_features(self, batch: GemBatch) -> np.ndarray:
        assert self.history is not None
        return np.concatenate([static_features(batch, self.spec), self.history(batch)], axis=1)

    def features(self, batch: GemBatch) -> np.ndarray:
        """``[B, F]`` features of a *held-out* batch (item statistics over the whole training split)."""
        x = self._row_features(batch)
        if self.items is not None:
            assert self.item_feature is not None
            x = np.concatenate([x, self.items.held_out(single_ids(batch, self.item_feature))], axis=1)
        return x

    def train_matrix(self) -> SplitMatrix:
        """The training rows, in the log's order; item statistics by the training encoding."""
        assert self.log is not None, "call fit() first"
        xs = [self._row_features(self._train_batch(i)) for i in range(self.train_batches)]
        x = np.concatenate(xs)
        if self.items is not None:
            x = np.concatenate([x, self.items.training()], axis=1)
        return SplitMatrix(x, self.log.labels, self.log.mask)

    def held_out_matrix(self, split: HeldOutSplit) -> SplitMatrix:
        n = self.source.num_batches(split, self.eval_batch_size) or 0
        xs, ys, ms = [], [], []
        for i in range(n):
            b = self.source.get(split, i, self.eval_batch_size).batch
            xs.append(self.features(b))
            ys.append(b.labels.numpy().astype(np.float64))
            ms.append(b.label_mask.numpy().astype(bool))
        if not xs:
            t = len(self.spec.tasks)
            return SplitMatrix(np.zeros((0, len(self.names))), np.zeros((0, t)), np.zeros((0, t), bool))
        return SplitMatrix(np.concatenate(xs), np.concatenate(ys), np.concatenate(ms))
