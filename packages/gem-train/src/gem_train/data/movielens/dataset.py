"""MovieLens-100K as a CTR task, fetched at run time from the ``recbole==1.2.1`` wheel on PyPI.

The data (GroupLens' terms) is never committed: :func:`fetch_movielens_100k` runs
``pip download --no-deps recbole==1.2.1`` into a cache directory and extracts
``recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}`` from the wheel (a zip). Those are tab-separated
files with a typed header (``user_id:token  item_id:token  rating:float  timestamp:float`` and so on).

The task: every rating event is a candidate impression (the movie is the "ad"), label ``ctr`` =
``rating >= like_threshold``; the user's earlier events, oldest first, are the history (item ids, ratings as
action ids 1..5, timestamps and, with ``history_genres``, the multi-hot genres of each history item),
truncated to the most recent ``max_len``. Events are ordered by
(timestamp, item id) per user; the history of an event holds only the user's events with a strictly
earlier timestamp (ML-100K users rate several movies in the same second: those are not "earlier").
Three splits, by time within each user:

- ``"test"`` (the test split): the last ``eval_fraction`` of each user's events (at least one);
- ``"valid"`` (the validation split, for model selection): the ``valid_fraction`` of the user's events just
  before those (``ceil(valid_fraction * count)``, but never the user's last training event: a user keeps at
  least one training event); ``valid_fraction = 0`` disables it;
- ``"train"``: the rest, i.e. every event before the user's validation and test events.

So for every user, training events < validation events < test events in time. The history of a validation
or test event holds all the user's earlier events (known at request time: for a test event that includes
the user's validation events), never the event itself or later ones.

Features (only from the past or from static attributes, so nothing leaks the label):
- sparse: ``user_id``, ``user_gender``, ``user_age``, ``user_occupation``, ``user_zip`` (the first digit of
  the zip code, the US postal region; 10 for a non-numeric code), ``ad_id`` (the movie),
  ``ad_genres`` (multi-hot, up to 6), ``ad_year`` (release-year bucket);
- history events (``history_genres``, the default): the genres of each history item as a multi-hot
  ``[total, num_genres]`` float32 row (``JaggedSequence.event_features``; row ``i`` is the genres of
  history event ``i``'s own movie, not the candidate's). The model's bias-free ``Linear(num_genres, E)`` of
  a multi-hot row is the sum-pooled embedding bag of those genre ids: the same multi-hot genre feature
  the candidate has, as a small dense matmul with no TorchRec table to shard;
- dense (8): age, release year, log training popularity of the movie, log history length, mean and
  like-rate of the history's ratings, log hours since the previous event, history like-rate of the movie's
  genres.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import FeatureSpec, GemBatch, JaggedSequence, SequenceFeature, SparseFeature
from gem_train.config import MovieLensConfig
from gem_train.data.loader import LoadedBatch
from gem_train.data.movielens.files import (
    FILE_SHA256,
    MAX_GENRES,
    MAX_TIMESTAMP,
    N_ZIP,
    MovieLensEvents,
    fetch_movielens_100k,
    read_movielens_100k,
)
from gem_train.data.split import HELD_OUT, Split, check_split

__all__ = ["MovieLens100K"]

_N_DENSE = 8
# data.movielens.rating_tasks: the auxiliary tasks' names and their thresholds (label = rating >= threshold).
RATING_TASK_THRESHOLDS = {"rating_ge3": 3, "rating_ge5": 5}
_N_YEAR_BUCKETS = 16
_AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # the ML-1M convention, applied to ML-100K's exact ages

# ----------------------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------------------


class MovieLens100K:
    """ML-100K CTR examples as ``GemBatch``es (a :class:`~gem_train.data.loader.BatchSource`).

    ``events`` defaults to fetching (if needed) and parsing the files from ``cfg.cache_dir``.
    """

    def __init__(self, cfg: MovieLensConfig, seed: int = 0, events: MovieLensEvents | None = None) -> None:
        self.cfg = cfg
        self.seed = int(seed)
        # The files' sha256 (checked when fetched), or None for events given directly.
        self.files_sha256: dict[str, str] | None = None
        if events is None:
            events = read_movielens_100k(fetch_movielens_100k(cfg.cache_dir or None), cfg.max_users)
            self.files_sha256 = dict(FILE_SHA256)
        self.ev = ev = events
        n = len(ev.user)
        if n == 0:
            raise ValueError("MovieLens-100K: no events (max_users too small?)")
        # Position of every event in its user's time order; the test tail of each user and, before it, the
        # validation block.
        pos = np.arange(n) - ev.user_start[ev.user]
        count = ev.user_start[ev.user + 1] - ev.user_start[ev.user]
        n_eval = np.maximum(1, np.ceil(cfg.eval_fraction * count)).astype(np.int64)
        n_valid = np.zeros_like(n_eval)
        if cfg.valid_fraction > 0:
            want = np.ceil(cfg.valid_fraction * count).astype(np.int64)
            n_valid = np.clip(want, 0, np.maximum(count - n_eval - 1, 0))
        is_eval = pos >= count - n_eval
        is_valid = ~is_eval & (pos >= count - n_eval - n_valid)
        self.pos = pos
        # Where each event's history ends (exclusive, a position in its user's order): the user's first
        # event at the same timestamp, so no event at the candidate's second (or later) is in its history.
        key = ev.user * (MAX_TIMESTAMP + 1) + ev.timestamp  # sorted: events are by (user, time, item)
        self.hist_end = np.searchsorted(key, key, side="left") - ev.user_start[ev.user]
        self.train_rows = np.flatnonzero(~is_eval & ~is_valid)
        self.valid_rows = np.flatnonzero(is_valid)
        self.eval_rows = np.flatnonzero(is_eval)
        # [n, n_tasks] float32: ctr, then (rating_tasks) rating >= 3 and rating = 5.
        thresholds = (
            (cfg.like_threshold, *RATING_TASK_THRESHOLDS.values())
            if cfg.rating_tasks
            else (cfg.like_threshold,)
        )
        self.labels = np.stack([ev.rating >= k for k in thresholds], axis=1).astype(np.float32)
        self.label = self.labels[:, 0]
        # Movie popularity from the training split only.
        self.item_pop = np.bincount(ev.item[self.train_rows], minlength=ev.num_items).astype(np.float64)
        # [n, 2] float64 (item_stats): every event's movie's like rate and mean rating, training split only.
        self.item_stats = self._item_stats() if cfg.item_stats else None
        self._perm_cache: tuple[int, np.ndarray] | None = None
        # [num_items, num_genres] float32 multi-hot genres of every movie (the history's event features).
        self.item_genre_hot = np.zeros((ev.num_items, ev.num_genres), np.float32)
        for i, gs in enumerate(ev.item_genres):
            self.item_genre_hot[i, gs] = 1.0
        self.spec = FeatureSpec(
            n_dense=_N_DENSE + (2 if cfg.item_stats else 0),
            sparse=(
                SparseFeature("user_id", ev.num_users),
                SparseFeature("user_gender", 2),
                SparseFeature("user_age", len(_AGE_BUCKETS) + 1),
                SparseFeature("user_occupation", ev.num_occupations),
                SparseFeature("user_zip", N_ZIP),
                SparseFeature("ad_id", ev.num_items),
                SparseFeature("ad_genres", ev.num_genres, max_ids=MAX_GENRES),
                SparseFeature("ad_year", _N_YEAR_BUCKETS),
            ),
            sequences=(
                SequenceFeature(
                    "history",
                    ev.num_items,
                    6,
                    cfg.max_len,
                    num_event_features=ev.num_genres if cfg.history_genres else 0,
                ),
            ),
            tasks=("ctr", *RATING_TASK_THRESHOLDS) if cfg.rating_tasks else ("ctr",),
        )

    def _item_stats(self) -> np.ndarray:
        """``[n, 2]`` float64: each event's movie's smoothed like rate and mean rating over the training
        split, as the GBDT baseline computes them (:class:`ItemStats`, smoothing 10): a validation or test
        event sees every training event; a training event the other 4 of 5 folds (by a hash of user, movie
        and time), so its own label is never in its features."""
        from gem_train.evaluation.baselines.item_stats import ItemStats
        from gem_train.evaluation.baselines.training_log import TrainingLog

        ev, tr = self.ev, self.train_rows
        user, item, time = ev.user[tr], ev.item[tr], ev.timestamp[tr]
        rating = ev.rating[tr].astype(np.int64)
        log = TrainingLog(
            item=item, user=user, time=time, labels=self.labels[tr, :1].astype(np.float64),
            mask=np.ones((len(tr), 1), bool), ev_user=user, ev_item=item, ev_time=time, ev_action=rating,
        )  # fmt: skip
        stats = ItemStats(log, ev.num_items, ("ctr",), encoding="kfold")
        cols = [0, 2]  # item.ctr_rate, item.mean_action (log_rows is the popularity feature already)
        out = stats.held_out(ev.item)[:, cols]
        out[tr] = stats.training()[:, cols]
        return out

    def data_identity(self) -> dict[str, Any]:
        """The sha256 of the three files (known: :func:`fetch_movielens_100k` refuses any other), of the
        events and attributes parsed from them (after ``max_users``), and the rows of each split
        (:mod:`gem_train.data.identity`)."""
        ev, h = self.ev, hashlib.sha256()
        for a in (ev.user, ev.item, ev.rating, ev.timestamp, ev.user_age, ev.user_gender,
                  ev.user_occupation, ev.user_zip, ev.item_year):  # fmt: skip
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        h.update(repr(ev.item_genres).encode())
        rows = {"train": len(self.train_rows), "valid": len(self.valid_rows), "test": len(self.eval_rows)}
        return {
            "source": "movielens-100k",
            "settings": asdict(self.cfg),
            "content": {"files": self.files_sha256, "events_sha256": h.hexdigest(), "rows": rows},
        }

    # BatchSource -------------------------------------------------------------------------------------------

    def num_batches(self, split: Split, batch_size: int) -> int:
        """Batches in one pass over ``split`` ("train", "valid" or "test"); "valid" has 0 when disabled."""
        if split in HELD_OUT:
            return -(-len(self._held_out(split)) // batch_size)
        check_split(split)
        return max(1, len(self.train_rows) // batch_size)

    def _held_out(self, split: Split) -> np.ndarray:
        return self.eval_rows if split == "test" else self.valid_rows

    def rows(self, split: Split, index: int, batch_size: int) -> np.ndarray:
        """Event rows of batch ``index``: valid/test in a fixed order; train reshuffled every epoch by the
        seed."""
        if split in HELD_OUT:
            n = self.num_batches(split, batch_size)
            if not 0 <= index < n:
                raise IndexError(f"{split} batch {index} out of range ({n} batches)")
            return self._held_out(split)[index * batch_size : (index + 1) * batch_size]
        check_split(split)
        per_epoch = self.num_batches("train", batch_size)
        epoch, k = divmod(int(index), per_epoch)
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, 11, epoch]).permutation(len(self.train_rows))
            self._perm_cache = (epoch, perm)
        return self.train_rows[self._perm_cache[1][k * batch_size : (k + 1) * batch_size]]

    def get(self, split: Split, index: int, batch_size: int) -> LoadedBatch:
        return LoadedBatch(self.make_batch(self.rows(split, index, batch_size)), index, None)

    # Building ----------------------------------------------------------------------------------------------

    def make_batch(self, rows: np.ndarray) -> GemBatch:
        """The ``GemBatch`` of event rows ``rows`` [B]."""
        ev, b = self.ev, len(rows)
        u, it = ev.user[rows], ev.item[rows]
        start = ev.user_start[u]
        pos = self.hist_end[rows]
        lo = np.maximum(0, pos - self.cfg.max_len)
        lengths = (pos - lo).astype(np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        owner = np.repeat(np.arange(b), lengths)
        # Event index of every history entry: user start + lo + (rank within this history).
        h = start[owner] + lo[owner] + (np.arange(offsets[-1]) - offsets[owner])
        h_items, h_rating, h_ts = ev.item[h], ev.rating[h], ev.timestamp[h]

        # History statistics (dense features); an empty history gives zeros.
        has = lengths > 0
        like = (h_rating >= self.cfg.like_threshold).astype(np.float64)
        sum_r = np.bincount(owner, weights=h_rating.astype(np.float64), minlength=b)
        sum_like = np.bincount(owner, weights=like, minlength=b)
        mean_r = np.where(has, sum_r / np.maximum(lengths, 1), 3.0)
        like_rate = np.where(has, sum_like / np.maximum(lengths, 1), 0.5)
        last_ts = np.where(has, h_ts[np.maximum(offsets[1:] - 1, 0)] if len(h) else 0, ev.timestamp[rows])
        gap_h = np.maximum(ev.timestamp[rows] - last_ts, 0) / 3600.0
        # Like rate of the user's history on the candidate's genres.
        g_like = np.full(b, 0.5)
        cand_genres = [set(ev.item_genres[i]) for i in it]
        if len(h):
            match = np.fromiter(
                (bool(cand_genres[o] & set(ev.item_genres[x])) for o, x in zip(owner, h_items)),
                dtype=bool,
                count=len(h),
            )
            m_cnt = np.bincount(owner, weights=match.astype(np.float64), minlength=b)
            m_like = np.bincount(owner, weights=match * like, minlength=b)
            g_like = np.where(m_cnt > 0, (m_like + 0.5) / (m_cnt + 1.0), 0.5)
        year = ev.item_year[it]
        dense = np.stack(
            [
                (ev.user_age[u] - 33.0) / 12.0,
                np.where(year > 0, (year - 1988.0) / 15.0, 0.0),
                np.log1p(self.item_pop[it]) / 6.0 - 0.5,
                np.log1p(lengths) / 5.0 - 0.5,
                mean_r - 3.5,
                like_rate - 0.55,
                np.log1p(gap_h) / 8.0,
                g_like - 0.55,
                *(
                    (self.item_stats[rows, 0] - 0.55, self.item_stats[rows, 1] - 3.5)
                    if self.item_stats is not None
                    else ()
                ),
            ],
            axis=1,
        ).astype(np.float32)

        genres = [ev.item_genres[i] or [0] for i in it]
        n_gen = np.array([len(g) for g in genres], np.int64)
        year_bucket = np.where(year > 0, np.clip((year - 1920) // 5, 0, _N_YEAR_BUCKETS - 1), 0)
        age_bucket = np.searchsorted(np.array(_AGE_BUCKETS), ev.user_age[u], side="right")
        ones = np.ones(b, np.int64)
        t = torch.from_numpy
        genre_ids = np.fromiter((x for g in genres for x in g), np.int64, int(n_gen.sum()))
        values = [
            u, ev.user_gender[u], age_bucket, ev.user_occupation[u], ev.user_zip[u], it, genre_ids,
            year_bucket,
        ]  # fmt: skip
        sparse = KeyedJaggedTensor(
            keys=self.spec.sparse_names,
            values=t(np.concatenate(values).astype(np.int64)),
            lengths=t(np.concatenate([ones, ones, ones, ones, ones, ones, n_gen, ones])),
            stride=b,
        )
        history = JaggedSequence(
            offsets=t(offsets.astype(np.int64)),
            max_len=max(int(lengths.max()) if b else 0, 1),
            item_ids=t(h_items.astype(np.int64)),
            action_ids=t(h_rating.astype(np.int64)),
            timestamps=t(h_ts.astype(np.int64)),
            event_features=t(self.item_genre_hot[h_items]) if self.cfg.history_genres else None,
        )
        return GemBatch(
            dense=t(dense),
            sparse=sparse,
            sequences={"history": history},
            request_time=t(ev.timestamp[rows].astype(np.int64)),
            labels=t(self.labels[rows].copy()),
            label_mask=torch.ones(b, self.labels.shape[1], dtype=torch.bool),
        )
