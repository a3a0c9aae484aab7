"""Which rows a dataset split has, what identifies each, and how ``gem-train predict`` reads them.

Every row that ``predict`` writes carries *key columns* that identify it, and a student joins teacher
predictions on the same keys (:mod:`gem_train.transfer.teacher`):

- **synthetic**: ``split`` and ``row``, the row's position in the split's stream (batch ``j`` of size ``B``
  holds rows ``[j B, (j + 1) B)``). A synthetic batch is a pure function of ``(seed, split, index, B)``, so
  a row's identity needs the data's definition too: the :func:`fingerprint` (the ``[data.synthetic]``
  section, the data seed and the batch sizes) is in the manifest and checked at the join.
- **MovieLens-100K**: ``event``, the rating's index in the events ordered by (user, time, item): stable
  for the same files, whatever the split fractions, batch sizes or seed.
- **Parquet**: the columns of ``data.parquet.keys`` (your own ids, so the output joins back to your table).

Beside the keys, ``predict`` writes ``user_id`` and ``ad_id`` where the data has them (informational).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gem_model import GemBatch
from gem_train.config import ConfigError, TrainConfig, config_to_dict
from gem_train.data.loader import BatchSource, LoadedBatch

__all__ = [
    "SPLIT_COLUMN",
    "SplitPlan",
    "batch_keys",
    "dataset_kind",
    "fingerprint",
    "history_events",
    "join_columns",
    "split_plan",
]

SPLIT_COLUMN = "split"
_INFO_FEATURES = ("user_id", "ad_id")  # written beside the keys where the batch has them (one id per row)


def _inner(source: BatchSource) -> Any:
    """The dataset behind ``source`` (a :class:`gem_train.transfer.source.DistillSource` is seen through)."""
    return getattr(source, "inner", source)


def dataset_kind(source: BatchSource) -> str:
    """ "synthetic", "movielens-100k" or "parquet": the dataset behind ``source``."""
    name = type(_inner(source)).__name__
    kinds = {"SyntheticAds": "synthetic", "MovieLens100K": "movielens-100k", "ParquetSource": "parquet"}
    if name not in kinds:
        raise ConfigError(f"gem-train predict and [distill] do not know the rows of a {name} dataset")
    return kinds[name]


def join_columns(source: BatchSource) -> list[str]:
    """The key columns that identify a row of ``source`` (see the module docstring)."""
    kind = dataset_kind(source)
    if kind == "synthetic":
        return [SPLIT_COLUMN, "row"]
    if kind == "movielens-100k":
        return ["event"]
    keys = list(_inner(source).cfg.keys)
    if not keys:
        raise ConfigError(
            'data.parquet.keys: name the columns that identify a row (e.g. keys = ["impression_id"]): '
            "gem-train predict writes them beside the predictions and [distill] joins on them"
        )
    return keys


def fingerprint(cfg: TrainConfig, source: BatchSource) -> dict[str, Any]:
    """What must be equal for two runs' rows with equal keys to be the same rows (see the module
    docstring); compared key by key when a student joins a teacher's predictions."""
    kind = dataset_kind(source)
    inner = _inner(source)
    if kind == "synthetic":
        section = config_to_dict(cfg.data.synthetic)
        section.pop("seed")
        return {
            "source": kind,
            "data.synthetic": section,
            "data seed": int(inner.seed),
            "data.batch_size (train rows)": cfg.data.batch_size,
            "data.eval_batch_size (valid/test rows)": cfg.data.eval_batch_size,
        }
    if kind == "movielens-100k":
        return {"source": kind, "data.movielens.max_users": cfg.data.movielens.max_users}
    return {"source": kind, "data.parquet.keys": list(inner.cfg.keys)}


def _info(batch: GemBatch) -> dict[str, np.ndarray]:
    out = {}
    for name in _INFO_FEATURES:
        if name in batch.sparse.keys():  # noqa: SIM118 (a KeyedJaggedTensor)
            jt = batch.sparse[name]
            if bool((jt.lengths() == 1).all()):
                out[name] = jt.values().numpy().astype(np.int64)
    return out


def batch_keys(source: BatchSource, split: str, lb: LoadedBatch, batch_size: int) -> dict[str, np.ndarray]:
    """The join columns of the rows of ``lb`` (batch ``lb.index`` of ``split``, made with ``batch_size``,
    as the loader reads it), each ``[B]``; ``split`` is a str array where it is a key."""
    kind = dataset_kind(source)
    inner = _inner(source)
    n = lb.batch.batch_size
    if kind == "synthetic":
        # lb.index is the batch's index in its epoch (the source wraps a finite training epoch).
        rows = lb.index * batch_size + np.arange(n, dtype=np.int64)
        return {SPLIT_COLUMN: np.full(n, split, dtype=object), "row": rows}
    if kind == "movielens-100k":
        return {"event": inner.rows(split, lb.index, batch_size).astype(np.int64)}
    keys = getattr(lb, "keys", None)
    if not keys:
        raise ConfigError("data.parquet.keys must name the key columns (the batch carries none)")
    return {k: keys[k] for k in join_columns(source)}


def history_events(source: BatchSource, events: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets [B+1], history [total])``: the MovieLens event index of every history event of the
    example events ``events`` ``[B]``, in history order (the computation of ``MovieLens100K.make_batch``)."""
    if dataset_kind(source) != "movielens-100k":
        raise ConfigError(
            "distill.embedding_history needs history events that are examples with stored representations "
            "(data.source = 'movielens-100k')"
        )
    ml = _inner(source)
    start = ml.ev.user_start[ml.ev.user[events]]
    pos = ml.hist_end[events]
    lo = np.maximum(0, pos - ml.cfg.max_len)
    lengths = (pos - lo).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    owner = np.repeat(np.arange(len(events)), lengths)
    history = start[owner] + lo[owner] + (np.arange(offsets[-1]) - offsets[owner])
    return offsets, history.astype(np.int64)


# ----------------------------------------------------------------------------------------------------------
# Reading a whole split, once, in a fixed order (gem-train predict)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class SplitPlan:
    """The rows of one split as ``num_batches`` batches read in a fixed order (``batch_size`` rows each, the
    last may be short); :meth:`batches` yields ``(batch, keys)`` with keys = join columns + ``user_id`` /
    ``ad_id`` where the data has them."""

    source: BatchSource
    split: str
    batch_size: int
    num_batches: int
    rows: int  # rows in all (every batch full but maybe the last)
    kind: str

    def shard_rows(self, lo: int, hi: int) -> int:
        """Rows of batches ``[lo, hi)``."""
        return min(hi * self.batch_size, self.rows) - lo * self.batch_size

    def batches(self, lo: int, hi: int) -> Iterator[tuple[GemBatch, dict[str, np.ndarray]]]:
        """Batches ``[lo, hi)`` of the plan, in order (with a student's stored features joined in: a
        source with ``join_features``, :class:`gem_train.transfer.source.DistillSource`)."""
        join = getattr(self.source, "join_features", None)
        for j, (batch, keys) in enumerate(self._raw(lo, hi)):
            if join is not None:
                batch = join(self.split, batch, keys, f"{self.split} batch {lo + j}")
            yield batch, keys

    def _raw(self, lo: int, hi: int) -> Iterator[tuple[GemBatch, dict[str, np.ndarray]]]:
        inner = _inner(self.source)
        if self.kind == "movielens-100k":
            rows_all = _movielens_rows(inner, self.split)
            for j in range(lo, hi):
                rows = rows_all[j * self.batch_size : (j + 1) * self.batch_size]
                batch = inner.make_batch(rows)
                yield batch, {"event": rows.astype(np.int64), **_info(batch)}
            return
        if self.kind == "parquet":
            for lb in inner.file_order_batches(self.split, self.batch_size, lo, hi):
                yield lb.batch, {**dict(lb.keys), **_info(lb.batch)}
            return
        for j in range(lo, hi):
            lb = inner.get(self.split, j, self.batch_size)
            yield lb.batch, {**batch_keys(inner, self.split, lb, self.batch_size), **_info(lb.batch)}


def _movielens_rows(ml: Any, split: str) -> np.ndarray:
    return {"train": ml.train_rows, "valid": ml.valid_rows, "test": ml.eval_rows}[split]


def split_plan(cfg: TrainConfig, source: BatchSource, split: str, train_batches: int = 0) -> SplitPlan:
    """How ``predict`` reads every row of ``split`` of ``source`` exactly once.

    Synthetic rows are defined by their batch size (the training split's ``data.batch_size``, the
    held-out splits' ``data.eval_batch_size``); its endless training stream needs ``train_batches`` (the
    batches a student will train on) unless ``data.synthetic.train_examples_per_epoch`` makes it finite.
    MovieLens and Parquet splits are read whole, in ``data.eval_batch_size`` batches.
    """
    kind = dataset_kind(source)
    inner = _inner(source)
    if kind == "movielens-100k":
        n = len(_movielens_rows(inner, split))
        bs = cfg.data.eval_batch_size
        return SplitPlan(source, split, bs, -(-n // bs), n, kind)
    if kind == "parquet":
        bs, n = cfg.data.eval_batch_size, inner.rows(split)
        return SplitPlan(source, split, bs, -(-n // bs), n, kind)
    if split != "train":
        bs = cfg.data.eval_batch_size
        n = inner.cfg.eval_examples if split == "test" else inner.cfg.valid_examples
        return SplitPlan(source, split, bs, inner.num_batches(split, bs), n, kind)
    bs = cfg.data.batch_size
    per_epoch = inner.num_batches("train", bs)
    if train_batches and per_epoch is not None and train_batches > per_epoch:
        raise ConfigError(
            f"--train-batches {train_batches}: the training split has {per_epoch} batches of {bs} per epoch "
            "(data.synthetic.train_examples_per_epoch); later batches repeat them"
        )
    n = train_batches or per_epoch
    if n is None:
        raise ConfigError(
            "the synthetic training stream is endless: say how many of its batches to predict with "
            "--train-batches N (a student training S steps on one process reads batches 0..S-1), or set "
            "data.synthetic.train_examples_per_epoch"
        )
    return SplitPlan(source, split, bs, n, n * bs, kind)
