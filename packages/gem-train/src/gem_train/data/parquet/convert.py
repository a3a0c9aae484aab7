"""Arrow rows -> validated NumPy columns (a :class:`Block`) -> ``GemBatch``: vectorized, no per-row Python.

A window of rows is converted at once: every list column becomes flat values plus ``[n+1]`` offsets
(``pyarrow.compute.list_flatten`` / ``list_value_length``), ids are mapped, every check of the format runs as
an array operation and marks bad rows, and sequences are truncated to their last ``max_len`` events. A batch
is then a slice of the block (offset arithmetic only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import FeatureSpec, GemBatch, JaggedSequence
from gem_train.data.parquet.errors import ParquetDataError
from gem_train.data.parquet.ids import IdMapper
from gem_train.data.parquet.schema import ParquetLayout

__all__ = ["Block", "Converter", "Provenance"]


@dataclass
class Provenance:
    """Where each row of a block came from: ``[n]`` file index, row group, row within the row group."""

    file: np.ndarray
    row_group: np.ndarray
    row: np.ndarray

    def take(self, idx: np.ndarray) -> Provenance:
        return Provenance(self.file[idx], self.row_group[idx], self.row[idx])


@dataclass
class Jagged:
    """Flat ``values`` ``[total]`` and ``offsets`` ``[n+1]`` int64."""

    offsets: np.ndarray
    values: list[np.ndarray]  # one or more value arrays sharing the offsets (items, actions, timestamps)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def slice(self, lo: int, hi: int) -> Jagged:
        """Rows ``[lo, hi)`` (views)."""
        a, z = int(self.offsets[lo]), int(self.offsets[hi])
        return Jagged(self.offsets[lo : hi + 1] - a, [v[a:z] for v in self.values])

    def take(self, idx: np.ndarray) -> Jagged:
        """Rows ``idx`` in that order (a gather: new, writable arrays)."""
        lengths = self.lengths()[idx]
        off = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(lengths, out=off[1:])
        # int32 positions while they fit: half the memory traffic of building and reading the index.
        itype = np.int32 if int(self.offsets[-1]) < 2**31 else np.int64
        flat = np.repeat((self.offsets[:-1][idx] - off[:-1]).astype(itype), lengths)
        flat += np.arange(int(off[-1]), dtype=itype)
        return Jagged(off, [np.take(v, flat) for v in self.values])

    @staticmethod
    def concat(a: Jagged, b: Jagged) -> Jagged:
        off = np.concatenate([a.offsets, b.offsets[1:] + a.offsets[-1]])
        return Jagged(off, [np.concatenate([x, y]) for x, y in zip(a.values, b.values)])


@dataclass
class Block:
    """Converted rows. ``bad[i]``: row ``i`` failed a check (kept only with ``on_bad_row = "skip"``)."""

    n: int
    dense: np.ndarray  # [n, n_dense] float32
    sparse: list[Jagged]  # per sparse feature, values [ids]
    sequences: list[Jagged]  # per sequence, values [items, actions, timestamps]
    request_time: np.ndarray  # [n] int64
    labels: np.ndarray  # [n, T] float32
    label_mask: np.ndarray  # [n, T] bool
    bad: np.ndarray  # [n] bool
    prov: Provenance
    reasons: dict[int, str] = field(default_factory=dict)  # row -> what was wrong (bad rows)
    keys: dict[str, np.ndarray] = field(default_factory=dict)  # data.parquet.keys: column -> [n] values

    def key_rows(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """The key columns of rows ``[lo, hi)`` without the bad ones (the rows of :meth:`Converter.batch`)."""
        good = ~self.bad[lo:hi]
        return {k: v[lo:hi] if good.all() else v[lo:hi][good] for k, v in self.keys.items()}

    def slice(self, lo: int, hi: int) -> Block:
        """Rows ``[lo, hi)`` (views where possible)."""
        return Block(
            hi - lo,
            self.dense[lo:hi],
            [j.slice(lo, hi) for j in self.sparse],
            [j.slice(lo, hi) for j in self.sequences],
            self.request_time[lo:hi],
            self.labels[lo:hi],
            self.label_mask[lo:hi],
            self.bad[lo:hi],
            Provenance(self.prov.file[lo:hi], self.prov.row_group[lo:hi], self.prov.row[lo:hi]),
            {k - lo: v for k, v in self.reasons.items() if lo <= k < hi},
            {k: v[lo:hi] for k, v in self.keys.items()},
        )

    def take(self, idx: np.ndarray) -> Block:
        """Rows ``idx`` in that order (the shuffle: one gather of every column)."""
        new_pos = {}
        if self.reasons:
            inv = np.empty(self.n, np.int64)
            inv[idx] = np.arange(len(idx))
            new_pos = {k: int(inv[k]) for k in self.reasons}
        return Block(
            len(idx),
            self.dense[idx],
            [j.take(idx) for j in self.sparse],
            [j.take(idx) for j in self.sequences],
            self.request_time[idx],
            self.labels[idx],
            self.label_mask[idx],
            self.bad[idx],
            self.prov.take(idx),
            {new_pos[k]: v for k, v in self.reasons.items()},
            {k: v[idx] for k, v in self.keys.items()},
        )

    @staticmethod
    def concat(a: Block, b: Block) -> Block:
        cat = np.concatenate
        return Block(
            a.n + b.n,
            cat([a.dense, b.dense]),
            [Jagged.concat(x, y) for x, y in zip(a.sparse, b.sparse)],
            [Jagged.concat(x, y) for x, y in zip(a.sequences, b.sequences)],
            cat([a.request_time, b.request_time]),
            cat([a.labels, b.labels]),
            cat([a.label_mask, b.label_mask]),
            cat([a.bad, b.bad]),
            Provenance(
                cat([a.prov.file, b.prov.file]),
                cat([a.prov.row_group, b.prov.row_group]),
                cat([a.prov.row, b.prov.row]),
            ),
            {**a.reasons, **{k + a.n: v for k, v in b.reasons.items()}},
            {k: cat([v, b.keys[k]]) for k, v in a.keys.items()},
        )


def _flat(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, bool]:
    """A list array's ``(offsets [n+1], flat values, any null element)``; a null list is empty."""
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(arr)
    has_null = flat.null_count > 0
    values = (flat.fill_null(0) if has_null else flat).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets, values.astype(np.int64, copy=False), has_null  # may be Arrow's read-only memory


def _owner(offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The row of each flat position."""
    return np.searchsorted(offsets, positions, side="right") - 1


def _keep_last(offsets: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray | None]:
    """New offsets keeping each row's last ``max_len`` entries, and the flat indices kept (None: all)."""
    lengths = np.diff(offsets)
    if not len(lengths) or int(lengths.max()) <= max_len:
        return offsets, None
    keep = np.minimum(lengths, max_len)
    new = np.zeros_like(offsets)
    np.cumsum(keep, out=new[1:])
    idx = np.repeat(offsets[1:] - keep - new[:-1], keep) + np.arange(int(new[-1]), dtype=np.int64)
    return new, idx


class Converter:
    """Converts Arrow tables of one split to :class:`Block` s and blocks to ``GemBatch`` es."""

    def __init__(self, layout: ParquetLayout, spec: FeatureSpec, root: Path) -> None:
        self.layout, self.spec, self.cfg = layout, spec, layout.cfg
        vocab = lambda f: str(root / f) if f and not Path(f).is_absolute() else f
        self.sparse_maps = [
            IdMapper(sp.ids, sp.num_embeddings, vocab(sp.vocab_file)) for _, sp in layout.sparse
        ]
        self.item_maps = [IdMapper(sq.ids, sq.num_items, vocab(sq.vocab_file)) for _, sq in layout.sequences]

    # -- Arrow -> Block --------------------------------------------------------------------------------------

    def block(self, table: pa.Table, prov: Provenance, files: list[str]) -> Block:
        """Convert and check ``table`` (rows of the split's files; ``prov`` says where each came from).

        Raises:
            ParquetDataError: with ``on_bad_row = "error"``, naming the file, row group and row of the first
                bad row (the first failed check of it).
        """
        n = table.num_rows
        bad = np.zeros(n, bool)
        reasons: dict[int, str] = {}

        def mark(rows_mask: np.ndarray, why: str) -> None:
            new = rows_mask & ~bad
            if not new.any():
                return
            if self.cfg.on_bad_row == "error":
                i = int(np.flatnonzero(new)[0])
                raise ParquetDataError(why, files[prov.file[i]], int(prov.row_group[i]), int(prov.row[i]))
            for i in np.flatnonzero(new)[:1000].tolist():  # the first reasons, for the report
                reasons[i] = why
            bad[new] = True

        def rows_of(offsets: np.ndarray, positions_mask: np.ndarray) -> np.ndarray:
            m = np.zeros(n, bool)
            m[_owner(offsets, np.flatnonzero(positions_mask))] = True
            return m

        col = lambda name: table.column(name).combine_chunks()

        # Dense features.
        d = self.layout.dense
        if d.column:
            arr = col(d.column)
            dense = np.full((n, d.n_dense), np.nan, np.float32)
            flat = arr.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, d.n_dense)
            if arr.null_count:
                dense[arr.is_valid().to_numpy(zero_copy_only=False)] = flat
            else:
                dense = flat
        elif d.columns:
            dense = np.empty((n, len(d.columns)), np.float32)
            for j, name in enumerate(d.columns):
                dense[:, j] = col(name).to_numpy(zero_copy_only=False)
        else:
            dense = np.zeros((n, 0), np.float32)
        finite = np.isfinite(dense)
        if not finite.all():
            if self.cfg.dense_nan == "fill":
                dense = np.where(finite, dense, np.float32(self.cfg.dense_fill))
            else:
                mark(
                    np.asarray(~finite.all(axis=1)),
                    "a dense feature is NaN, inf or null (data.parquet.dense_nan)",
                )

        # Sparse features.
        sparse: list[Jagged] = []
        for (name, sp), mapper in zip(self.layout.sparse, self.sparse_maps):
            arr = col(self.layout.sparse_column[name])
            if pa.types.is_integer(arr.type):
                valid = arr.is_valid().to_numpy(zero_copy_only=False)
                offsets = np.zeros(n + 1, np.int64)
                np.cumsum(valid, out=offsets[1:])
                raw = arr.drop_null().to_numpy(zero_copy_only=False).astype(np.int64)
            else:
                offsets, raw, has_null = _flat(arr)
                if has_null:
                    mark(rows_of(offsets, pc.is_null(pc.list_flatten(arr)).to_numpy(zero_copy_only=False)),
                         f"sparse feature {name!r}: a null id inside the list")  # fmt: skip
                mark(
                    np.diff(offsets) > sp.max_ids, f"sparse feature {name!r}: more than max_ids {sp.max_ids}"
                )
            ids, bad_ids = mapper(raw)
            if bad_ids.any():
                what = f"out of range [0, {sp.num_embeddings})" if sp.ids == "raw" else "not in vocab"
                first = int(raw[np.flatnonzero(bad_ids)[0]])
                mark(rows_of(offsets, bad_ids), f"sparse feature {name!r}: id {first} {what}")
            sparse.append(Jagged(offsets, [ids]))

        # Sequences.
        sequences: list[Jagged] = []
        last_ts = np.full(n, np.iinfo(np.int64).min, np.int64)
        for (name, sq), mapper in zip(self.layout.sequences, self.item_maps):
            offsets, items, has_null = _flat(col(sq.items))
            lengths = np.diff(offsets)
            parts = {}
            for field_name, column in (("actions", sq.actions), ("timestamps", sq.timestamps)):
                if not column:
                    parts[field_name] = np.zeros(len(items), np.int64)
                    continue
                off_f, vals, null_f = _flat(col(column))
                has_null |= null_f
                unequal = np.diff(off_f) != lengths
                if unequal.any():
                    mark(unequal, f"sequence {name!r}: {column!r} and {sq.items!r} differ in length")
                    # Keep the arrays aligned with the items for the rows that stay: take min lengths.
                    vals = _align(off_f, vals, offsets)
                parts[field_name] = vals
            if has_null:
                mark(_null_rows(table, sq, n), f"sequence {name!r}: a null inside an event list")
            acts, ts = parts["actions"], parts["timestamps"]
            items, bad_items = mapper(items)
            if bad_items.any():
                what = f"out of range [0, {sq.num_items})" if sq.ids == "raw" else "not in the vocabulary"
                mark(rows_of(offsets, bad_items), f"sequence {name!r}: an item id {what}")
            bad_act = (acts < 0) | (acts >= sq.num_actions)
            if bad_act.any():
                mark(
                    rows_of(offsets, bad_act), f"sequence {name!r}: an action id out of [0, {sq.num_actions})"
                )
            if sq.timestamps and len(ts):
                neg = ts < 0
                if neg.any():
                    mark(rows_of(offsets, neg), f"sequence {name!r}: a negative timestamp")
                down = np.zeros(len(ts), bool)
                down[1:] = ts[1:] < ts[:-1]
                down[offsets[:-1][lengths > 0]] = False  # a row's first event may be earlier than the last's
                if down.any():
                    mark(rows_of(offsets, down), f"sequence {name!r}: timestamps decrease (oldest first)")
                has = lengths > 0
                last_ts[has] = np.maximum(last_ts[has], ts[offsets[1:][has] - 1])
            new_off, idx = _keep_last(offsets, sq.max_len)
            if idx is not None:
                items, acts, ts = items[idx], acts[idx], ts[idx]
            sequences.append(Jagged(new_off, [items, acts, ts]))

        # Request time.
        if self.cfg.request_time:
            arr = col(self.cfg.request_time)
            if arr.null_count:
                mark(arr.is_null().to_numpy(zero_copy_only=False), "request_time is null")
            request_time = arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            late = request_time < last_ts
            if late.any():
                mark(late, "an event is later than the request_time")
        else:
            request_time = np.maximum(last_ts, 0)

        # Labels: nullable; a null masks that task for the row.
        t = len(self.layout.labels)
        labels = np.zeros((n, t), np.float32)
        mask = np.ones((n, t), bool)
        for j, (task, column) in enumerate(self.layout.labels):
            arr = col(column)
            if pa.types.is_boolean(arr.type):
                arr = arr.cast(pa.int8())
            mask[:, j] = arr.is_valid().to_numpy(zero_copy_only=False)
            y = arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float32)
            not01 = (y != 0) & (y != 1)
            if not01.any():
                value = float(y[np.flatnonzero(not01)[0]])
                mark(not01, f"label {column!r} (task {task!r}) is {value!r}, not 0 or 1")
            labels[:, j] = y
        keys: dict[str, np.ndarray] = {}
        for column in self.cfg.keys:  # identify rows (predict, distillation joins); never a feature
            arr = col(column)
            if arr.null_count:
                mark(arr.is_null().to_numpy(zero_copy_only=False), f"key column {column!r} is null")
            keys[column] = arr.to_numpy(zero_copy_only=False)
        return Block(n, dense, sparse, sequences, request_time, labels, mask, bad, prov, reasons, keys)

    # -- Block -> GemBatch -----------------------------------------------------------------------------------

    def batch(self, block: Block, lo: int, hi: int) -> tuple[GemBatch, int]:
        """The ``GemBatch`` of rows ``[lo, hi)`` of ``block`` without its bad rows, and how many were bad."""
        keep = None
        n_bad = int(block.bad[lo:hi].sum())
        if n_bad:
            keep = lo + np.flatnonzero(~block.bad[lo:hi])
        b = hi - lo - n_bad

        def t(a: np.ndarray) -> torch.Tensor:
            # Views of the block's own (writable, never modified) arrays are shared with the batch; Arrow's
            # buffers are read-only, and those are copied.
            return torch.from_numpy(a if a.flags.writeable else np.array(a, copy=True))

        def rows(j: Jagged) -> tuple[np.ndarray, list[np.ndarray]]:
            part = j.slice(lo, hi) if keep is None else j.take(keep)
            return part.offsets, part.values

        sel = slice(lo, hi) if keep is None else keep
        values, lengths = [], []
        for j in block.sparse:
            off, (ids,) = rows(j)
            values.append(ids)
            lengths.append(np.diff(off))
        sparse = KeyedJaggedTensor(
            keys=self.spec.sparse_names,
            values=t(np.concatenate(values)) if values else torch.zeros(0, dtype=torch.int64),
            lengths=t(np.concatenate(lengths)) if lengths else torch.zeros(0, dtype=torch.int64),
            stride=b,
        )
        sequences = {}
        for s, j in zip(self.spec.sequences, block.sequences):
            off, (items, acts, ts) = rows(j)
            longest = int(np.diff(off).max()) if b else 0
            sequences[s.name] = JaggedSequence(
                offsets=t(off), max_len=max(longest, 1),
                item_ids=t(items), action_ids=t(acts),
                timestamps=t(ts),
            )  # fmt: skip
        batch = GemBatch(
            dense=t(block.dense[sel]),
            sparse=sparse,
            sequences=sequences,
            request_time=t(block.request_time[sel]),
            labels=t(block.labels[sel]),
            label_mask=t(block.label_mask[sel]),
        )
        return batch, n_bad


def _align(off_f: np.ndarray, vals: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Values of one event list re-laid on the items' offsets (rows of unequal length are bad anyway: their
    entries are filled with 0 or cut, only so the arrays stay aligned)."""
    lengths = np.diff(offsets)
    out = np.zeros(int(offsets[-1]), np.int64)
    take = np.minimum(np.diff(off_f), lengths)
    src = np.repeat(off_f[:-1], take) + (np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take))
    dst = np.repeat(offsets[:-1], take) + (
        np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
    )
    out[dst] = vals[src]
    return out


def _null_rows(table: pa.Table, sq: object, n: int) -> np.ndarray:
    """Rows with a null element in any event list of a sequence (rare: computed only when one exists)."""
    m = np.zeros(n, bool)
    for column in (getattr(sq, "items", ""), getattr(sq, "actions", ""), getattr(sq, "timestamps", "")):
        if not column:
            continue
        arr = table.column(column).combine_chunks()
        offsets, _, has_null = _flat(arr)
        if has_null:
            nulls = pc.is_null(pc.list_flatten(arr)).to_numpy(zero_copy_only=False)
            m[_owner(offsets, np.flatnonzero(nulls))] = True
    return m
