"""The files of a split and their columns: globs resolved, footers read, every declared column type-checked.

Only the footers are read here (row counts per row group and the schema), never the data.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_model import FeatureSpec, SequenceFeature, SparseFeature
from gem_train.config.parquet import DenseColumns, ParquetConfig, SequenceColumns, SparseColumn
from gem_train.data.parquet.errors import ParquetDataError

__all__ = ["ParquetLayout", "SplitFiles", "resolve_root", "split_files"]

SPLITS = {"train": "train", "valid": "valid", "test": "test"}  # loader split -> config key


def resolve_root(root: str) -> Path:
    """``root`` with ``~``, ``$VARS`` and a leading ``{cache}`` (gem's cache directory) expanded."""
    if root.startswith("{cache}"):
        from gem_train.data.movielens import default_cache_dir

        root = str(default_cache_dir()) + root[len("{cache}") :]
    return Path(os.path.expandvars(os.path.expanduser(root))) if root else Path(".")


@dataclass
class ParquetLayout:
    """A ``[data.parquet]`` section parsed: the columns of every feature, in the model's order."""

    cfg: ParquetConfig
    dense: DenseColumns
    sparse: list[tuple[str, SparseColumn]]
    sparse_column: dict[str, str]
    sequences: list[tuple[str, SequenceColumns]]
    labels: list[tuple[str, str]]

    @classmethod
    def from_config(cls, cfg: ParquetConfig) -> ParquetLayout:
        sparse = cfg.sparse_features()
        return cls(
            cfg=cfg,
            dense=cfg.dense,
            sparse=sparse,
            sparse_column={name: sp.column or name for name, sp in sparse},
            sequences=cfg.sequence_features(),
            labels=[(task, str(col)) for task, col in cfg.labels.items()],
        )

    def spec(self) -> FeatureSpec:
        """The model's feature spec, from the declaration alone."""
        return FeatureSpec(
            n_dense=self.dense.size,
            sparse=tuple(SparseFeature(n, sp.num_embeddings, sp.max_ids) for n, sp in self.sparse),
            sequences=tuple(
                SequenceFeature(n, sq.num_items, sq.num_actions, sq.max_len) for n, sq in self.sequences
            ),
            tasks=tuple(task for task, _ in self.labels),
        )

    def columns(self) -> list[str]:
        """Every column read, once each."""
        out = list(self.dense.columns) + ([self.dense.column] if self.dense.column else [])
        out += [self.sparse_column[n] for n, _ in self.sparse]
        for _, sq in self.sequences:
            out += [c for c in (sq.items, sq.actions, sq.timestamps) if c]
        out += [c for _, c in self.labels]
        if self.cfg.request_time:
            out.append(self.cfg.request_time)
        out += list(self.cfg.keys)
        return list(dict.fromkeys(out))

    def check_schema(self, schema: pa.Schema, path: str) -> None:
        """Every declared column exists with a usable type; else :class:`ParquetDataError` naming it."""

        def get(name: str, what: str) -> pa.DataType:
            idx = schema.get_field_index(name)
            if idx < 0:
                raise ParquetDataError(f"no column {name!r} ({what}); the file has {schema.names}", path)
            return schema.field(idx).type

        def is_int_list(tp: pa.DataType) -> bool:
            return (pa.types.is_list(tp) or pa.types.is_large_list(tp)) and pa.types.is_integer(tp.value_type)

        for name in self.dense.columns:
            tp = get(name, "a dense feature")
            if not pa.types.is_floating(tp):
                raise ParquetDataError(f"dense column {name!r} is {tp}, expected float32 or float64", path)
        if self.dense.column:
            tp = get(self.dense.column, "the dense features")
            if not (pa.types.is_fixed_size_list(tp) and pa.types.is_floating(tp.value_type)):
                raise ParquetDataError(
                    f"dense column {self.dense.column!r} is {tp}, expected a fixed-size list of floats", path
                )
            if tp.list_size != self.dense.n_dense:
                raise ParquetDataError(
                    f"dense column {self.dense.column!r} holds {tp.list_size} floats, but n_dense is "
                    f"{self.dense.n_dense}",
                    path,
                )
        for name, _ in self.sparse:
            column = self.sparse_column[name]
            tp = get(column, f"sparse feature {name!r}")
            if not (pa.types.is_integer(tp) or is_int_list(tp)):
                raise ParquetDataError(
                    f"sparse column {column!r} is {tp}, expected int64 or list<int64> (multi-hot)", path
                )
        for name, sq in self.sequences:
            for column in (sq.items, sq.actions, sq.timestamps):
                if column:
                    tp = get(column, f"sequence {name!r}")
                    if not is_int_list(tp):
                        raise ParquetDataError(
                            f"sequence column {column!r} is {tp}, expected list<int64>", path
                        )
        for task, column in self.labels:
            tp = get(column, f"the label of task {task!r}")
            if not (pa.types.is_integer(tp) or pa.types.is_boolean(tp) or pa.types.is_floating(tp)):
                raise ParquetDataError(
                    f"label column {column!r} is {tp}, expected bool, an integer or a float (0/1)", path
                )
        if self.cfg.request_time:
            tp = get(self.cfg.request_time, "request_time")
            if not pa.types.is_integer(tp):
                raise ParquetDataError(f"request_time column is {tp}, expected int64 seconds", path)
        for column in self.cfg.keys:
            tp = get(column, "a key column (data.parquet.keys)")
            if not (pa.types.is_integer(tp) or pa.types.is_string(tp) or pa.types.is_large_string(tp)):
                raise ParquetDataError(
                    f"key column {column!r} is {tp}, expected an integer or a string", path
                )


@dataclass
class SplitFiles:
    """The files of one split: ``paths`` in order, ``row_groups[(file, group)]`` rows, in file order.

    ``keep`` (optional) selects rows: ``keep[g]`` holds the sorted indices, within row group ``g``, of the
    rows that belong to this split (two splits may share files with complementary selections: the
    validation split cut from the training files by time). ``group_rows`` then counts the kept rows, and
    ``footer_rows`` the row group's rows as its footer says (checked when it is read).
    """

    paths: list[str]
    group_file: np.ndarray  # [G] file index of every row group, in (file, group) order
    group_index: np.ndarray  # [G] the row group's index within its file
    group_rows: np.ndarray  # [G] rows (the kept rows, with ``keep``)
    keep: list[np.ndarray] | None = None  # [G] of int64 kept row indices within each row group
    footer_rows: np.ndarray | None = None  # [G] rows per the footer (default: group_rows)

    @property
    def num_rows(self) -> int:
        return int(self.group_rows.sum())

    def physical_rows(self, g: int) -> int:
        """Rows of row group ``g`` as its footer says (before any selection)."""
        rows = self.footer_rows if self.footer_rows is not None else self.group_rows
        return int(rows[g])

    def select(self, masks: list[np.ndarray]) -> SplitFiles:
        """The rows of this split (no selection yet) where ``masks[g]`` (bool, one per row of group ``g``)
        is True; row groups with no row selected are dropped."""
        if self.keep is not None:
            raise ValueError("select() applies to a split without a selection")
        if len(masks) != len(self.group_rows):
            raise ValueError(f"{len(masks)} masks for {len(self.group_rows)} row groups")
        keep = [np.flatnonzero(m).astype(np.int64) for m in masks]
        used = np.array([len(k) > 0 for k in keep], bool)
        return SplitFiles(
            self.paths,
            self.group_file[used],
            self.group_index[used],
            np.array([len(k) for k in keep], np.int64)[used],
            [k for k, u in zip(keep, used, strict=True) if u],
            self.group_rows[used],
        )


def split_files(layout: ParquetLayout, patterns: list[str], root: Path, split: str) -> SplitFiles:
    """Resolve ``patterns`` (paths or globs, relative to ``root``), read the footers, check the schemas.

    Raises:
        ParquetDataError: a pattern matching nothing, an unreadable file, a missing or mistyped column, an
            empty file.
    """
    paths: list[str] = []
    for pat in patterns:
        full = pat if Path(pat).is_absolute() else str(root / pat)
        found = sorted(glob.glob(full)) if glob.has_magic(full) else ([full] if Path(full).is_file() else [])
        if not found:
            raise ParquetDataError(
                f"no file matches the {split} pattern {pat!r} (data.parquet.root {root})", full
            )
        paths += [p for p in found if p not in paths]
    gf, gi, gr = [], [], []
    for k, path in enumerate(paths):
        try:
            meta = pq.ParquetFile(path).metadata
        except (OSError, pa.ArrowException) as e:
            raise ParquetDataError(f"not a readable Parquet file ({e})", path) from e
        layout.check_schema(meta.schema.to_arrow_schema(), path)
        if meta.num_rows == 0:
            raise ParquetDataError("the file is empty (0 rows)", path)
        for g in range(meta.num_row_groups):
            gf.append(k)
            gi.append(g)
            gr.append(meta.row_group(g).num_rows)
    return SplitFiles(paths, np.array(gf, np.int64), np.array(gi, np.int64), np.array(gr, np.int64))
