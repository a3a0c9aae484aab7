"""What the training split holds, flattened for the GBDT baseline's statistics.

One pass over the training batches (:class:`TrainingLogBuilder`) records:

- every candidate row: its item (the ``item_feature``), user (the ``user_feature``, if any), request time
  and labels, in the order of the pass (the training matrix's row order);
- every *distinct* event of the training rows' histories, ``(user, item, time, action)``: a user's event
  appears in the history of each of their later rows, and is counted once (without a user feature, two
  users' events of the same item, second and action are one event: rare, and only a statistic moves);
- the candidate item's *attributes*: the sparse features that are a function of the item on every
  training row (MovieLens: ``ad_genres``, ``ad_year``; the synthetic data: ``ad_category``,
  ``ad_advertiser``), as an item -> attribute table. A history event's attributes are looked up in it (a
  Parquet history carries item ids only). Single-id features of any vocabulary and multi-id features of at
  most :data:`MAX_MULTI_VOCAB` ids qualify; the item and user features themselves do not.

Only the training split is read: no statistic sees a validation or test row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gem_model import FeatureSpec, GemBatch

__all__ = [
    "MAX_MULTI_VOCAB",
    "ItemAttribute",
    "TrainingLog",
    "TrainingLogBuilder",
    "multi_hot",
    "single_ids",
]

MAX_MULTI_VOCAB = 64  # a multi-id attribute is matched as a multi-hot row [V]: keep V small


def single_ids(batch: GemBatch, name: str) -> np.ndarray:
    """``[B]`` int64: the id of single-id sparse feature ``name`` in each row, -1 where the row has none."""
    jt = batch.sparse[name]
    ids, lengths = jt.values().numpy(), jt.lengths().numpy()
    out = np.full(batch.batch_size, -1, np.int64)
    has = lengths > 0
    if has.any():
        out[has] = ids[np.cumsum(lengths)[has] - 1]
    return out


def multi_hot(batch: GemBatch, name: str, width: int) -> np.ndarray:
    """``[B, width]`` float64 multi-hot rows of sparse feature ``name`` (a repeated id counts once)."""
    jt = batch.sparse[name]
    ids, lengths = jt.values().numpy(), jt.lengths().numpy()
    out = np.zeros((batch.batch_size, width))
    out[np.repeat(np.arange(batch.batch_size), lengths), ids] = 1.0
    return out


def _set_signature(hot: np.ndarray) -> np.ndarray:
    """``[N]`` uint64: one number per multi-hot row, equal for equal rows (a random 64-bit code per id,
    summed): tells whether every row of an item has the same id set."""
    codes = np.random.default_rng(0).integers(0, 2**63, size=hot.shape[1], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (hot.astype(np.uint64) * codes).sum(axis=1, dtype=np.uint64)


@dataclass
class ItemAttribute:
    """An attribute of the candidate item: ``table[item]`` is its id (single-id, ``[num_items]`` int64, -1
    unknown) or multi-hot row (multi-id, ``[num_items, V]`` float32, zeros unknown)."""

    name: str
    single: bool
    table: np.ndarray


@dataclass
class TrainingLog:
    """The training split's candidate rows (``[N]``, labels ``[N, T]``) and distinct history events
    (``[M]``), all int64 but the labels (float64) and the mask (bool); -1 where a row has no item or user."""

    item: np.ndarray
    user: np.ndarray
    time: np.ndarray
    labels: np.ndarray
    mask: np.ndarray
    ev_user: np.ndarray
    ev_item: np.ndarray
    ev_time: np.ndarray
    ev_action: np.ndarray
    attributes: list[ItemAttribute] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.time)


class TrainingLogBuilder:
    """``add`` each training batch (in the order of the training matrix), then ``finish``."""

    def __init__(
        self, spec: FeatureSpec, item_feature: str | None, sequence: int, user_feature: str | None
    ) -> None:
        self.spec, self.item_feature, self.user_feature = spec, item_feature, user_feature
        self.sequence = spec.sequences[sequence].name
        self.num_items = spec.sequences[sequence].num_items
        self._candidates = [
            f
            for f in spec.sparse
            if f.name not in (item_feature, user_feature)
            and (f.max_ids == 1 or f.num_embeddings <= MAX_MULTI_VOCAB)
        ]
        self._rows: dict[str, list[np.ndarray]] = {k: [] for k in ("item", "user", "time", "labels", "mask")}
        self._events: list[np.ndarray] = []
        self._pending = 0  # history events added since the last merge
        self._distinct = 0
        self._attr: dict[str, list[np.ndarray]] = {f.name: [] for f in self._candidates}

    def add(self, batch: GemBatch) -> None:
        b = batch.batch_size
        item = single_ids(batch, self.item_feature) if self.item_feature else np.full(b, -1, np.int64)
        user = single_ids(batch, self.user_feature) if self.user_feature else np.full(b, -1, np.int64)
        r = self._rows
        r["item"].append(item)
        r["user"].append(user)
        r["time"].append(batch.request_time.numpy().astype(np.int64))
        r["labels"].append(batch.labels.numpy().astype(np.float64))
        r["mask"].append(batch.label_mask.numpy().astype(bool))
        seq = batch.sequences[self.sequence]
        lengths = (seq.offsets[1:] - seq.offsets[:-1]).numpy()
        ev = np.stack(
            [
                np.repeat(user, lengths),
                seq.item_ids.numpy().astype(np.int64),
                seq.timestamps.numpy().astype(np.int64),
                seq.action_ids.numpy().astype(np.int64),
            ]
        )
        self._events.append(ev)
        self._pending += ev.shape[1]
        if self._pending > 4 * self._distinct + 1_000_000:  # keep memory near the distinct events'
            self._events = [_distinct_columns(np.concatenate(self._events, axis=1))]
            self._distinct, self._pending = self._events[0].shape[1], 0
        for f in self._candidates:
            if f.max_ids == 1:
                self._attr[f.name].append(single_ids(batch, f.name))
            else:
                self._attr[f.name].append(multi_hot(batch, f.name, f.num_embeddings).astype(np.uint8))

    def finish(self) -> TrainingLog:
        if not self._rows["time"]:
            raise ValueError("the training split gave no batch")
        r = {k: np.concatenate(v) for k, v in self._rows.items()}
        ev = _distinct_columns(np.concatenate(self._events, axis=1))
        log = TrainingLog(
            item=r["item"], user=r["user"], time=r["time"], labels=r["labels"], mask=r["mask"],
            ev_user=ev[0], ev_item=ev[1], ev_time=ev[2], ev_action=ev[3],
        )  # fmt: skip
        for f in self._candidates:
            attr = self._item_attribute(f.name, f.max_ids == 1, np.concatenate(self._attr[f.name]), r["item"])
            if attr is not None:
                log.attributes.append(attr)
        return log

    def _item_attribute(
        self, name: str, single: bool, values: np.ndarray, item: np.ndarray
    ) -> ItemAttribute | None:
        """The item -> value table of feature ``name`` if it is a function of the item on every training
        row (and not constant, and some item has two rows to show it), else None."""
        keep = (item >= 0) & (item < self.num_items)
        item, values = item[keep], values[keep]
        sig = values if single else _set_signature(values)
        if len(item) < 2 or np.all(sig == sig[0]):
            return None
        order = np.argsort(item, kind="stable")
        it, sg = item[order], sig[order]
        same_item = it[1:] == it[:-1]
        if not same_item.any() or np.any(sg[1:][same_item] != sg[:-1][same_item]):
            return None
        first = order[np.concatenate(([True], ~same_item))]  # one row of each item
        if single:
            table = np.full(self.num_items, -1, np.int64)
            table[item[first]] = values[first]
        else:
            table = np.zeros((self.num_items, values.shape[1]), np.float32)
            table[item[first]] = values[first]
        return ItemAttribute(name, single, table)


def _distinct_columns(a: np.ndarray) -> np.ndarray:
    """The distinct columns of ``a`` ``[K, M]`` int64, sorted (last row most significant)."""
    if a.shape[1] == 0:
        return a
    order = np.lexsort(a)
    s = a[:, order]
    new = np.concatenate(([True], np.any(s[:, 1:] != s[:, :-1], axis=0)))
    return s[:, new]
