"""The candidate item's statistics from the training split only: popularity, positive rate, mean action.

Per item, from the :class:`~gem_train.evaluation.baselines.training_log.TrainingLog`: the number of training
rows it is the candidate of, the positive rate of each task on them, and the number and mean action of its
distinct history events (MovieLens: its mean rating). Rates and means are smoothed towards the training prior
(``(sum + m * prior) / (count + m)``), so a rarely seen item gets the prior, not a 0/1 rate.

A held-out (validation or test) row gets its item's statistics over the whole training split. A *training*
row must not see its own label through them: its item's rate over the training split holds that label, and
a tree finds it (an item's rate is higher on its positive rows than on its negative ones). The encodings of
the training rows:

- ``"causal"`` (the default): only training rows and events *strictly earlier* than the row (its own label,
  its own event and everything after are out); so each training row sees what a model deployed at that
  time would have seen;
- ``"kfold"``: the rows (and events) are cut into ``folds`` folds by a hash of (user, item, time) (a row
  and its own history event fall in the same fold); a row sees the other folds';
- ``"loo"`` (leave-one-out) and ``"in_sample"`` leak the label and exist to show it: leave-one-out's rate
  is ``(S - y) / (n - 1)``, which, given the item's count, tells ``y`` exactly; in-sample holds ``y``.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from gem_train.evaluation.baselines.training_log import TrainingLog

__all__ = ["ENCODINGS", "Encoding", "ItemStats"]

Encoding = Literal["causal", "kfold", "loo", "in_sample"]
ENCODINGS: tuple[Encoding, ...] = get_args(Encoding)


def _hash3(a: np.ndarray, b: np.ndarray, c: np.ndarray, seed: int = 0) -> np.ndarray:
    """``[N]`` uint64 hash of int64 triples (splitmix64's finaliser of a weighted sum)."""
    with np.errstate(over="ignore"):
        x = (
            a.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            + b.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
            + c.astype(np.uint64) * np.uint64(0x94D049BB133111EB)
            + np.uint64(seed)
        )
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _earlier_sums(
    item: np.ndarray, time: np.ndarray, values: np.ndarray, q_item: np.ndarray, q_time: np.ndarray
) -> np.ndarray:
    """For each query ``(q_item, q_time)`` ``[Q]``: the sums ``[Q, C]`` of ``values`` ``[N, C]`` over the
    entries of the same item with ``time < q_time`` (strictly earlier)."""
    out = np.zeros((len(q_item), values.shape[1]))
    if len(item) == 0 or len(q_item) == 0:
        return out
    times = np.unique(np.concatenate([time, q_time]))
    span = len(times) + 1
    if int(max(item.max(), q_item.max())) + 1 > np.iinfo(np.int64).max // span:
        raise ValueError("too many items times distinct times for one int64 sort key")
    key = item * span + np.searchsorted(times, time)
    order = np.argsort(key, kind="stable")
    key = key[order]
    cum = np.concatenate([np.zeros((1, values.shape[1])), np.cumsum(values[order], axis=0)])
    lo = np.searchsorted(key, q_item * span, side="left")
    hi = np.searchsorted(key, q_item * span + np.searchsorted(times, q_time), side="left")
    return cum[hi] - cum[lo]


class ItemStats:
    """The item statistics of a training log; :meth:`held_out` for validation/test rows, :meth:`training`
    for the log's own rows (by ``encoding``). Columns: :attr:`names`. ``priors``: (rate per task, mean
    action) instead of the log's."""

    def __init__(
        self,
        log: TrainingLog,
        num_items: int,
        tasks: tuple[str, ...],
        smoothing: float = 10.0,
        encoding: Encoding = "causal",
        folds: int = 5,
        seed: int = 0,
        priors: tuple[np.ndarray, float] | None = None,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        if smoothing <= 0:
            raise ValueError(f"smoothing must be > 0, got {smoothing!r}")
        self.log, self.num_items, self.tasks = log, num_items, tasks
        self.smoothing, self.encoding, self.folds, self.seed = smoothing, encoding, folds, seed
        lab = log.mask.astype(np.float64)
        n_lab, pos = lab.sum(axis=0), (log.labels * lab).sum(axis=0)
        # Priors: the training positive rate of each task, the mean action of the training events (one
        # number each for all rows: a row's own label moves every row's prior alike, which tells nothing).
        self.prior_rate = np.where(n_lab > 0, pos / np.maximum(n_lab, 1.0), 0.5)
        self.prior_action = float(log.ev_action.mean()) if len(log.ev_action) else 0.0
        if priors is not None:
            self.prior_rate, self.prior_action = np.asarray(priors[0], np.float64), float(priors[1])
        self._rows = self._row_values()
        self._events = self._event_values()
        self._row_tot = self._per_item(log.item, self._rows)
        self._ev_tot = self._per_item(log.ev_item, self._events)
        self.names = [f"item.{t}_rate" for t in tasks] + [
            "item.log_rows", "item.mean_action", "item.log_events",
        ]  # fmt: skip

    # Values summed per item: rows [N, 1 + 2T] (1, mask_t, label_t * mask_t); events [M, 2] (1, action).
    def _row_values(self) -> np.ndarray:
        m = self.log.mask.astype(np.float64)
        return np.concatenate([np.ones((self.log.rows, 1)), m, self.log.labels * m], axis=1)

    def _event_values(self) -> np.ndarray:
        return np.stack([np.ones(len(self.log.ev_action)), self.log.ev_action.astype(np.float64)], axis=1)

    def _per_item(self, item: np.ndarray, values: np.ndarray) -> np.ndarray:
        ok = (item >= 0) & (item < self.num_items)
        out = np.zeros((self.num_items, values.shape[1]))
        np.add.at(out, item[ok], values[ok])
        return out

    def _columns(self, rows: np.ndarray, events: np.ndarray) -> np.ndarray:
        """``[Q, F]`` features from per-query row sums ``[Q, 1 + 2T]`` and event sums ``[Q, 2]``."""
        t, m = len(self.tasks), self.smoothing
        n_lab, pos = rows[:, 1 : 1 + t], rows[:, 1 + t :]
        rate = (pos + m * self.prior_rate) / (n_lab + m)
        mean_action = (events[:, 1] + m * self.prior_action) / (events[:, 0] + m)
        return np.column_stack([rate, np.log1p(rows[:, 0]), mean_action, np.log1p(events[:, 0])])

    def held_out(self, item: np.ndarray) -> np.ndarray:
        """``[B, F]`` float64 for rows of items ``item`` ``[B]`` (-1 or unseen: the priors), from every
        training row and event."""
        ok = (item >= 0) & (item < self.num_items)
        i = np.where(ok, item, 0)
        rows = np.where(ok[:, None], self._row_tot[i], 0.0)
        events = np.where(ok[:, None], self._ev_tot[i], 0.0)
        return self._columns(rows, events)

    def training(self) -> np.ndarray:
        """``[N, F]`` float64 for the log's own rows, in its order, by :attr:`encoding`."""
        log = self.log
        ok = (log.item >= 0) & (log.item < self.num_items)
        i = np.where(ok, log.item, 0)
        if self.encoding == "causal":
            rows = _earlier_sums(log.item, log.time, self._rows, log.item, log.time)
            events = _earlier_sums(log.ev_item, log.ev_time, self._events, log.item, log.time)
        elif self.encoding == "kfold":
            row_fold = _hash3(log.user, log.item, log.time, self.seed) % np.uint64(self.folds)
            ev_fold = _hash3(log.ev_user, log.ev_item, log.ev_time, self.seed) % np.uint64(self.folds)
            rows, events = self._row_tot[i].copy(), self._ev_tot[i].copy()
            for k in range(self.folds):
                r, e = row_fold == k, ev_fold == k
                rows[r] -= self._per_item(log.item[r], self._rows[r])[i[r]]
                events[r] -= self._per_item(log.ev_item[e], self._events[e])[i[r]]
        elif self.encoding == "loo":
            rows = self._row_tot[i] - self._rows
            events = self._ev_tot[i] - self._own_event(log)
        else:  # in_sample
            rows, events = self._row_tot[i], self._ev_tot[i]
        rows = np.where(ok[:, None], rows, 0.0)
        events = np.where(ok[:, None], events, 0.0)
        return self._columns(rows, events)

    def _own_event(self, log: TrainingLog) -> np.ndarray:
        """``[N, 2]``: the event values of each row's own event (same user, item and time), zeros if its
        event is in no history (a user's last training events)."""
        ev_key = _hash3(log.ev_user, log.ev_item, log.ev_time)
        row_key = _hash3(log.user, log.item, log.time)
        order = np.argsort(ev_key)
        at = np.minimum(np.searchsorted(ev_key[order], row_key), max(len(order) - 1, 0))
        out = np.zeros((log.rows, 2))
        if len(order):
            hit = ev_key[order][at] == row_key
            out[hit] = self._events[order[at[hit]]]
        return out
