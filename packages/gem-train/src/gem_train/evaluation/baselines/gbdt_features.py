"""The GBDT baseline's features: strictly causal, from what the data source declares.

An example's features come from its own ``GemBatch`` row (whose history the data source builds from the
user's strictly earlier events) and from statistics of the *training* split (:mod:`.item_stats`,
:mod:`.training_log`); no feature reads another example of the batch, a held-out label, or a later event.

Per sequence ``s`` (MovieLens: ``history``), from the row's history; a history event is a *like* when its
action is >= ``like_action`` (MovieLens: a rating >= 4, the label's own rule):

- ``s.log_len``; ``s.like_rate`` (smoothed: ``(likes + m / 2) / (n + m)``; the prior is a constant, not
  the training split's like share, so that no later event moves an earlier row's feature);
  ``s.mean_action`` (MovieLens: the mean rating);
- ``s.like_rate_last{k}``, ``s.mean_action_last{k}`` of the ``k`` most recent events (k = 3, 10);
- ``s.log_hours_since_last``: log1p of the hours from the newest event to the request;
- for each attribute ``A`` of the candidate item (MovieLens: ``ad_genres``, ``ad_year``; see
  :mod:`.training_log`), on the sequence that shares the item's ids: ``s.A.like_rate``, the user's like
  rate on their events whose item shares one of the candidate's ``A`` ids (smoothed towards the user's own
  like rate; a multi-id match counts once per shared id) and ``s.A.log_count``, how many there were.

The candidate item (``model.gbdt.item_feature``): ``item.<task>_rate``, ``item.log_rows``,
``item.mean_action``, ``item.log_events`` (:class:`~.item_stats.ItemStats`; a training row's by 5-fold
target encoding, which keeps its own label out).

Static: the dense features as they are; each single-id sparse feature of at most 255 ids as a categorical
feature (MovieLens: gender, age, occupation, zip region, year bucket); each multi-id sparse feature of at
most 32 ids as one indicator per id (genres).

Empty history: the rates are the priors, the means and times NaN (the trees' missing value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gem_model import FeatureSpec, GemBatch
from gem_train.evaluation.baselines.item_stats import Encoding, ItemStats
from gem_train.evaluation.baselines.training_log import ItemAttribute, TrainingLog, multi_hot, single_ids

USER_PRIOR = 0.5  # the history like rate's prior

__all__ = ["USER_PRIOR", "FeatureOptions", "HistoryFeatures", "item_stats", "static_features", "static_names"]

MAX_CATEGORIES = 255  # the categorical limit of HistGradientBoosting (LightGBM and XGBoost take it too)
MAX_INDICATORS = 32


@dataclass(frozen=True)
class FeatureOptions:
    """The feature builder's knobs (chosen on the validation split: see the gem-train README)."""

    recent: tuple[int, ...] = (3, 10)
    user_smoothing: float = 5.0  # m of the history like rate, towards USER_PRIOR
    attribute_smoothing: float = 2.0  # m of the per-attribute like rate, towards the user's like rate
    item_smoothing: float = 10.0  # m of the item's rates and mean action, towards the training priors
    item_encoding: Encoding = "kfold"  # how a training row's item statistics leave its label out


def static_names(spec: FeatureSpec) -> tuple[list[str], list[bool]]:
    """Names of :func:`static_features`' columns and which are categorical."""
    names = [f"dense_{i}" for i in range(spec.n_dense)]
    cat = [False] * spec.n_dense
    for f in spec.sparse:
        if f.max_ids == 1 and f.num_embeddings <= MAX_CATEGORIES:
            names.append(f.name)
            cat.append(True)
        elif f.max_ids > 1 and f.num_embeddings <= MAX_INDICATORS:
            names += [f"{f.name}={i}" for i in range(f.num_embeddings)]
            cat += [False] * f.num_embeddings
    return names, cat


def static_features(batch: GemBatch, spec: FeatureSpec) -> np.ndarray:
    """``[B, F]`` float64: dense features, small categorical ids (NaN: none), small multi-hot indicators."""
    cols = [batch.dense.numpy().astype(np.float64).reshape(batch.batch_size, spec.n_dense)]
    for f in spec.sparse:
        if f.max_ids == 1 and f.num_embeddings <= MAX_CATEGORIES:
            ids = single_ids(batch, f.name)
            cols.append(np.where(ids >= 0, ids, np.nan)[:, None])
        elif f.max_ids > 1 and f.num_embeddings <= MAX_INDICATORS:
            cols.append(multi_hot(batch, f.name, f.num_embeddings))
    return np.concatenate(cols, axis=1)


def _segment_sums(values: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """``[B, C]`` sums of ``values`` ``[total, C]`` over rows ``start[b]:end[b]`` (empty ranges: 0)."""
    cum = np.concatenate([np.zeros((1, values.shape[1])), np.cumsum(values, axis=0)])
    return cum[end] - cum[start]


class HistoryFeatures:
    """The per-sequence features of a batch (see the module doc).

    Args:
        spec: the data's features.
        like_action: the smallest action id that counts as a like.
        like_prior: the prior of the history like rate (a constant: see the module doc).
        linked: the index of the sequence whose items are the candidate item's ids (attribute matches
            are computed on it), or None.
        attributes: the candidate item's attributes (from the training log).
    """

    def __init__(
        self,
        spec: FeatureSpec,
        like_action: int,
        like_prior: float,
        options: FeatureOptions,
        linked: int | None = None,
        attributes: list[ItemAttribute] | None = None,
    ) -> None:
        self.spec, self.like_action, self.like_prior, self.opt = spec, like_action, like_prior, options
        self.linked, self.attributes = linked, attributes or []
        self.names: list[str] = []
        for j, s in enumerate(spec.sequences):
            cols = ["log_len", "like_rate", "mean_action"]
            for k in options.recent:
                cols += [f"like_rate_last{k}", f"mean_action_last{k}"]
            cols.append("log_hours_since_last")
            if j == linked:
                for a in self.attributes:
                    cols += [f"{a.name}.like_rate", f"{a.name}.log_count"]
            self.names += [f"{s.name}.{c}" for c in cols]

    def __call__(self, batch: GemBatch) -> np.ndarray:
        """``[B, len(names)]`` float64."""
        out = [self._sequence(batch, j) for j in range(len(self.spec.sequences))]
        return np.concatenate(out, axis=1)

    def _sequence(self, batch: GemBatch, j: int) -> np.ndarray:
        s = self.spec.sequences[j]
        seq = batch.sequences[s.name]
        off = seq.offsets.numpy().astype(np.int64)
        start, end = off[:-1], off[1:]
        n = (end - start).astype(np.float64)
        act = seq.action_ids.numpy().astype(np.float64)
        like = (act >= self.like_action).astype(np.float64)
        ev = np.stack([like, act], axis=1)
        nan = np.full(len(n), np.nan)
        tot = _segment_sums(ev, start, end)
        m = self.opt.user_smoothing
        rate = (tot[:, 0] + m * self.like_prior) / (n + m)
        cols = [np.log1p(n), rate, np.where(n > 0, tot[:, 1] / np.maximum(n, 1), nan)]
        for k in self.opt.recent:
            lo = np.maximum(end - k, start)
            last = _segment_sums(ev, lo, end)
            cnt = np.maximum(end - lo, 1)
            cols += [np.where(n > 0, last[:, 0] / cnt, nan), np.where(n > 0, last[:, 1] / cnt, nan)]
        ts = seq.timestamps.numpy().astype(np.float64)
        t_last = ts[np.clip(end - 1, 0, max(len(ts) - 1, 0))] if len(ts) else np.zeros(len(n))
        hours = np.maximum(batch.request_time.numpy().astype(np.float64) - t_last, 0.0) / 3600.0
        cols.append(np.where(n > 0, np.log1p(hours), nan))
        if j == self.linked:
            items = seq.item_ids.numpy().astype(np.int64)
            for a in self.attributes:
                count, likes = self._matches(batch, a, items, like, start, end)
                ma = self.opt.attribute_smoothing
                cols += [(likes + ma * rate) / (count + ma), np.log1p(count)]
        return np.stack(cols, axis=1)

    @staticmethod
    def _matches(
        batch: GemBatch, a: ItemAttribute, items: np.ndarray, like: np.ndarray, start: np.ndarray,
        end: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """Per row: how many history events share the candidate's attribute ids, and how many of those
        are likes (a multi-id attribute counts each shared id)."""
        known = (items >= 0) & (items < len(a.table))
        safe = np.where(known, items, 0)
        owner = np.repeat(np.arange(batch.batch_size), end - start)
        if a.single:
            cand = single_ids(batch, a.name)
            ev_attr = np.where(known, a.table[safe], -1)
            match = ((ev_attr >= 0) & (ev_attr == cand[owner])).astype(np.float64)
            sums = _segment_sums(np.stack([match, match * like], axis=1), start, end)
            return sums[:, 0], sums[:, 1]
        hot = np.where(known[:, None], a.table[safe], 0.0).astype(np.float64)
        cand_hot = multi_hot(batch, a.name, a.table.shape[1])
        per_id = _segment_sums(np.concatenate([hot, hot * like[:, None]], axis=1), start, end)
        v = a.table.shape[1]
        return (cand_hot * per_id[:, :v]).sum(axis=1), (cand_hot * per_id[:, v:]).sum(axis=1)


def item_stats(
    log: TrainingLog, num_items: int, spec: FeatureSpec, options: FeatureOptions, seed: int = 0
) -> ItemStats:
    """The candidate item's statistics (``seed``: of the k-fold assignment)."""
    return ItemStats(
        log,
        num_items,
        spec.tasks,
        smoothing=options.item_smoothing,
        encoding=options.item_encoding,
        seed=seed,
    )
