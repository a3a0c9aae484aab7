"""The ``[data.parquet]`` config section: which Parquet columns are which features, and how to read them.

Tables of features are keyed by feature name, in the order they appear (that order is the model's)::

    [data.parquet]
    root = "/data/ads"                       # relative paths below start here ("{cache}": gem's cache dir)
    train = ["train/*.parquet"]              # paths or globs (sorted)
    valid = ["valid/*.parquet"]              # [] -> the latest valid_fraction of the training rows by time
    test = ["test/*.parquet"]

    [data.parquet.dense]
    columns = ["age", "price"]               # float columns, or one fixed-size list column:
    # column = "dense"  n_dense = 32

    [data.parquet.sparse.user_id]            # int64 (one id) or list<int64> (multi-hot) column
    num_embeddings = 1000000
    ids = "hash"                             # "raw" (already in [0, num_embeddings)), "hash", "vocab"

    [data.parquet.sequences.history]         # list columns of equal length per row, oldest event first
    items = "hist_items"
    actions = "hist_actions"
    timestamps = "hist_ts"
    num_items = 500000
    num_actions = 4
    max_len = 256

    [data.parquet.labels]                    # task = column (nullable: null masks the task for the row)
    ctr = "click"
    cvr = "conversion"

    keys = ["impression_id"]                 # (under [data.parquet]) columns that identify a row: written by
                                             # `gem-train predict`, joined on by [distill] (optional)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DenseColumns", "ParquetConfig", "SequenceColumns", "SparseColumn"]

IdMode = Literal["raw", "hash", "vocab"]
_ID_MODES = ("raw", "hash", "vocab")


def _config_error(msg: str) -> Exception:
    # Imported late: gem_train.config imports this module to declare the [data.parquet] section.
    from gem_train.config import ConfigError

    return ConfigError(msg)


def _check_ids(key: str, ids: str, vocab_file: str) -> None:
    if ids not in _ID_MODES:
        raise _config_error(f"{key}.ids must be one of {', '.join(map(repr, _ID_MODES))}, got {ids!r}")
    if (ids == "vocab") != bool(vocab_file):
        raise _config_error(
            f"{key}.vocab_file must name a vocabulary file exactly when {key}.ids = 'vocab' "
            f"(ids {ids!r}, vocab_file {vocab_file!r})"
        )


@dataclass
class DenseColumns:
    """Dense features: float columns (``columns``, in order) or one fixed-size list column (``column`` of
    ``n_dense`` floats). Both empty: no dense features."""

    columns: list[str] = field(default_factory=list)
    column: str = ""
    n_dense: int = 0  # with ``column``: the list size (checked against each file's schema)

    @property
    def size(self) -> int:
        return self.n_dense if self.column else len(self.columns)

    def validate(self, key: str) -> None:
        if self.column and self.columns:
            raise _config_error(f"{key}: set either columns (float columns) or column (one list), not both")
        if self.column and self.n_dense < 1:
            raise _config_error(f"{key}.n_dense must be >= 1 with {key}.column, got {self.n_dense!r}")
        if not self.column and self.n_dense not in (0, len(self.columns)):
            raise _config_error(f"{key}.n_dense is only for a list column (it is len(columns) otherwise)")
        if len(set(self.columns)) != len(self.columns):
            raise _config_error(f"{key}.columns has duplicates: {self.columns}")


@dataclass
class SparseColumn:
    """One pooled categorical feature."""

    column: str = ""  # "" -> the feature's name
    num_embeddings: int = 0
    max_ids: int = 1  # most ids per row (a list column longer than this is a bad row)
    ids: IdMode = "raw"
    vocab_file: str = ""  # ids = "vocab": a text file of raw int64 ids, one per line; line k -> id k

    def validate(self, key: str) -> None:
        if self.num_embeddings < 1:
            raise _config_error(f"{key}.num_embeddings must be >= 1, got {self.num_embeddings!r}")
        if self.max_ids < 1:
            raise _config_error(f"{key}.max_ids must be >= 1, got {self.max_ids!r}")
        _check_ids(key, self.ids, self.vocab_file)


@dataclass
class SequenceColumns:
    """One behaviour sequence: list columns, equal length within a row, oldest event first."""

    items: str = ""  # list<int64> item ids (required)
    actions: str = ""  # list<int64> action-type ids; "" -> every event has action 0
    timestamps: str = ""  # list<int64> seconds, >= 0, non-decreasing; "" -> every event at time 0
    num_items: int = 0
    num_actions: int = 1
    max_len: int = 0  # longer histories keep their most recent max_len events
    ids: IdMode = "raw"  # how the item ids map into [0, num_items)
    vocab_file: str = ""

    def validate(self, key: str) -> None:
        if not self.items:
            raise _config_error(f"{key}.items must name the list column of item ids")
        for name in ("num_items", "num_actions", "max_len"):
            if getattr(self, name) < 1:
                raise _config_error(f"{key}.{name} must be >= 1, got {getattr(self, name)!r}")
        _check_ids(key, self.ids, self.vocab_file)


@dataclass
class ParquetConfig:
    """Parquet files of one row per example (see :mod:`gem_train.data.parquet.format` for the format)."""

    root: str = ""  # the directory relative paths start from ("" = the working directory)
    train: list[str] = field(default_factory=list)
    valid: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)
    # "buffer": row groups in a new seeded order each epoch, rows shuffled within windows of shuffle_buffer
    # rows (bounded memory); "global": one seeded permutation of all rows per epoch, batch i a pure
    # function of i (the built-in loaders' order; reads the split into memory, for tables that fit);
    # "none": file order.
    shuffle: Literal["buffer", "global", "none"] = "buffer"
    shuffle_buffer: int = 65_536  # rows held (and shuffled) at once per loader worker
    on_bad_row: Literal["error", "skip"] = "error"
    dense_nan: Literal["error", "fill"] = "error"  # a NaN (or null) dense value: a bad row, or dense_fill
    dense_fill: float = 0.0
    request_time: str = ""  # int64 column; "" -> the row's latest event timestamp (0 without events)
    # With no valid files: the validation split is the latest valid_fraction of the training rows by
    # request time (the request_time column, else each row's latest history timestamp; with no time at all
    # the last rows in file order), and training keeps the rest. 0: no validation split.
    valid_fraction: float = 0.1
    dense: DenseColumns = field(default_factory=DenseColumns)
    sparse: dict[str, Any] = field(default_factory=dict)  # name -> SparseColumn table
    sequences: dict[str, Any] = field(default_factory=dict)  # name -> SequenceColumns table
    labels: dict[str, Any] = field(default_factory=dict)  # task -> column
    # Columns (int or string, non-null) that identify a row: `gem-train predict` writes them beside the
    # predictions so the output joins back to the table, and [distill] joins teacher predictions on them.
    keys: list[str] = field(default_factory=list)

    def sparse_features(self) -> list[tuple[str, SparseColumn]]:
        """(name, column spec) of every sparse feature, in order (the tables parsed and type-checked)."""
        return [(k, _parse(SparseColumn, v, f"data.parquet.sparse.{k}")) for k, v in self.sparse.items()]

    def sequence_features(self) -> list[tuple[str, SequenceColumns]]:
        """(name, column spec) of every sequence, in order."""
        return [
            (k, _parse(SequenceColumns, v, f"data.parquet.sequences.{k}")) for k, v in self.sequences.items()
        ]

    def validate(self, key: str = "data.parquet", required: bool = False) -> None:
        """Range checks; ``required`` (the dataset is in use): train/test files and features must be set."""
        if self.shuffle_buffer < 1:
            raise _config_error(f"{key}.shuffle_buffer must be >= 1, got {self.shuffle_buffer!r}")
        if not (math.isfinite(self.valid_fraction) and 0.0 <= self.valid_fraction < 1.0):
            raise _config_error(f"{key}.valid_fraction must be in [0, 1), got {self.valid_fraction!r}")
        if not math.isfinite(self.dense_fill):
            raise _config_error(f"{key}.dense_fill must be a finite number, got {self.dense_fill!r}")
        self.dense.validate(f"{key}.dense")
        for name, sp in self.sparse_features():
            sp.validate(f"{key}.sparse.{name}")
        for name, sq in self.sequence_features():
            sq.validate(f"{key}.sequences.{name}")
        if len(set(self.keys)) != len(self.keys) or not all(self.keys):
            raise _config_error(f"{key}.keys must name distinct columns, got {self.keys}")
        for task, col in self.labels.items():
            if not isinstance(col, str) or not col:
                raise _config_error(f"{key}.labels.{task} must name a column (a string), got {col!r}")
        if required:
            for split in ("train", "test"):
                if not getattr(self, split):
                    raise _config_error(f"{key}.{split} must list the {split} files (paths or globs)")
            if not self.sequences:
                raise _config_error(f"{key}.sequences must declare at least one sequence (the history)")
            if not self.labels:
                raise _config_error(f"{key}.labels must declare at least one task = label column")


def _parse(cls: type, value: Any, key: str) -> Any:
    from gem_train.config import ConfigError, config_from_dict

    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
    return config_from_dict(cls, value, prefix=key)
