"""The validation split of a Parquet dataset declared without validation files: the latest training rows.

With ``data.parquet.valid = []`` and ``valid_fraction = f > 0``, the ``round(f N)`` latest of the ``N``
training rows (at least 1, at most ``N - 1``) become the validation split and training keeps the rest, as a
time-based split of logged impressions should be (the model is chosen on the period after the one it
learned from). "Latest" is by the request time: the ``request_time`` column when declared, else each row's
latest history timestamp over its sequences (the request time the model sees; 0 for a row with no event);
with no time at all (no ``request_time``, no sequence with ``timestamps``) the last rows in file order.
Ties at the cut keep file order (a stable sort): the validation rows are the last ones of it.

Only the time columns are read here, row group by row group (8 bytes per row are held); the two splits then
share the training files with complementary row selections (:meth:`SplitFiles.select`), for every shuffle
mode.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gem_train.data.parquet.errors import ParquetDataError
from gem_train.data.parquet.schema import ParquetLayout, SplitFiles

__all__ = ["TimeSplit", "row_times", "split_by_time"]


@dataclass(frozen=True)
class TimeSplit:
    """The training and validation rows of the training files, and the sentence the log prints."""

    train: SplitFiles
    valid: SplitFiles
    note: str
    cut: int | None  # the request time of the earliest validation row (None: file order)


def _time_columns(layout: ParquetLayout) -> tuple[str, list[str]]:
    """(the request-time column or "", the timestamp list columns of the sequences)."""
    return layout.cfg.request_time, [sq.timestamps for _, sq in layout.sequences if sq.timestamps]


def _last_event(arr: pa.Array) -> np.ndarray:
    """``[n]`` int64: the last element of each list (timestamps are oldest first), 0 for an empty or null
    list (a null element counts as 0: the converter marks such a row bad later)."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(lengths)
    out = np.zeros(len(lengths), np.int64)
    has = lengths > 0
    out[has] = flat[ends[has] - 1]
    return out


def row_times(files: SplitFiles, layout: ParquetLayout) -> np.ndarray | None:
    """``[N]`` int64 request time of every row of ``files`` in file order (see the module docstring), or
    None when the dataset declares no time."""
    request_time, stamps = _time_columns(layout)
    columns = [request_time] if request_time else stamps
    if not columns:
        return None
    out = np.zeros(files.num_rows, np.int64)
    at, opened = 0, (-1, None)
    for g in range(len(files.group_rows)):
        f, idx = int(files.group_file[g]), int(files.group_index[g])
        path = files.paths[f]
        try:
            if opened[0] != f:
                opened = (f, pq.ParquetFile(path))
            assert opened[1] is not None
            table = opened[1].read_row_group(idx, columns=columns, use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise ParquetDataError(f"cannot read the time columns ({e})", path, idx) from e
        if request_time:
            t = table.column(request_time).fill_null(0).to_numpy().astype(np.int64)
        else:
            t = np.maximum.reduce([_last_event(table.column(c)) for c in stamps] + [np.zeros(table.num_rows)])
            t = t.astype(np.int64)
        if files.keep is not None:
            t = t[files.keep[g]]
        out[at : at + len(t)] = t
        at += len(t)
    return out


def _when(t: int) -> str:
    """A request time for the log: the number, and its UTC date when it reads as Unix seconds."""
    if 1e8 <= t <= 4e9:  # 1973 .. 2096: surely seconds since the epoch
        return f"{t} ({_dt.datetime.fromtimestamp(t, _dt.UTC):%Y-%m-%d %H:%M:%S} UTC)"
    return str(t)


def split_by_time(files: SplitFiles, layout: ParquetLayout, fraction: float) -> TimeSplit | None:
    """Cut the latest ``fraction`` of the training rows ``files`` off as the validation split; None when
    the training split has fewer than 2 rows (nothing can be cut)."""
    n = files.num_rows
    if n < 2 or fraction <= 0:
        return None
    n_valid = max(1, min(n - 1, round(fraction * n)))
    times = row_times(files, layout)
    is_valid = np.zeros(n, bool)
    if times is None:
        is_valid[n - n_valid :] = True
        cut = None
    else:
        order = np.argsort(times, kind="stable")
        is_valid[order[n - n_valid :]] = True
        cut = int(times[order[n - n_valid]])
    bounds = np.concatenate(([0], np.cumsum(files.group_rows)))
    valid_masks = [is_valid[bounds[g] : bounds[g + 1]] for g in range(len(files.group_rows))]
    train = files.select([~m for m in valid_masks])
    valid = files.select(valid_masks)
    request_time, stamps = _time_columns(layout)
    if times is None:
        how = (
            "the last rows in file order (the dataset declares no time: no data.parquet.request_time and no "
            "sequence timestamps)"
        )
    else:
        by = (
            f"the request_time column {request_time!r}"
            if request_time
            else ("each row's latest history timestamp (" + ", ".join(repr(c) for c in stamps) + ")")
        )
        how = f"the latest rows by {by}: request time >= {_when(cut or 0)}"
    note = (
        f"validation split: {n_valid:,} of the {n:,} training rows (data.parquet.valid_fraction = "
        f"{fraction:g}, no data.parquet.valid files), {how}; training keeps {n - n_valid:,} rows"
    )
    return TimeSplit(train, valid, note, cut)
