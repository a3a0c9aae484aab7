"""The built-in datasets written in the Parquet format (`gem-train data export`, `data synthetic`).

Columns written for a :class:`gem_model.FeatureSpec` (see :mod:`.format`): ``dense`` (fixed-size list of
``n_dense`` float32), one column per sparse feature (int64, null for no id; list<int64> when ``max_ids > 1``),
``<seq>_items``, ``<seq>_actions``, ``<seq>_timestamps`` (list<int64>) per sequence, ``request_time``
(int64) and one int8 column per task (null where the label is masked). Next to the split folders,
``data.toml`` holds the ``[data.parquet]`` section that reads them back.

Files are written to a temporary name and renamed: a file that exists is complete.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_model import FeatureSpec, GemBatch

if TYPE_CHECKING:
    from gem_train.config import TrainConfig

__all__ = ["batch_to_table", "export_movielens", "export_synthetic", "parquet_section", "write_split"]


def _list(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, pa.int64()))


def batch_to_table(batch: GemBatch, spec: FeatureSpec) -> pa.Table:
    """One Arrow row per example of ``batch``."""
    b = batch.batch_size
    cols: dict[str, pa.Array] = {}
    if spec.n_dense:
        flat = pa.array(batch.dense.numpy().reshape(-1), pa.float32())
        cols["dense"] = pa.FixedSizeListArray.from_arrays(flat, spec.n_dense)
    for f in spec.sparse:
        jt = batch.sparse[f.name]
        offsets, values = jt.offsets().numpy(), jt.values().numpy()
        if f.max_ids == 1:
            lengths = np.diff(offsets)
            if (lengths > 1).any():
                raise ValueError(f"sparse feature {f.name!r} has max_ids 1 but a sample with several ids")
            full = np.zeros(b, np.int64)
            full[lengths == 1] = values
            cols[f.name] = pa.array(full, pa.int64(), mask=lengths == 0)
        else:
            cols[f.name] = _list(offsets, values)
    for s in spec.sequences:
        if s.num_event_features:
            raise ValueError(f"sequence {s.name!r}: event_features have no Parquet columns yet")
        seq = batch.sequences[s.name]
        off = seq.offsets.numpy()
        cols[f"{s.name}_items"] = _list(off, seq.item_ids.numpy())
        cols[f"{s.name}_actions"] = _list(off, seq.action_ids.numpy())
        cols[f"{s.name}_timestamps"] = _list(off, seq.timestamps.numpy())
    cols["request_time"] = pa.array(batch.request_time.numpy(), pa.int64())
    labels, mask = batch.labels.numpy(), batch.label_mask.numpy()
    for j, task in enumerate(spec.tasks):
        cols[task] = pa.array(labels[:, j].astype(np.int8), pa.int8(), mask=~mask[:, j])
    return pa.table(cols)


def write_split(
    batches: Iterable[GemBatch], spec: FeatureSpec, path: str | Path, row_group_rows: int = 65_536
) -> int:
    """Write ``batches`` to one Parquet file (row groups of ``row_group_rows``); returns the rows written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    rows = 0
    writer: pq.ParquetWriter | None = None
    pending: list[pa.Table] = []
    pending_rows = 0
    try:
        for batch in batches:
            table = batch_to_table(batch, spec)
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema)
            pending.append(table)
            pending_rows += table.num_rows
            if pending_rows >= row_group_rows:
                writer.write_table(pa.concat_tables(pending), row_group_size=row_group_rows)
                rows += pending_rows
                pending, pending_rows = [], 0
        if writer is None:
            raise ValueError(f"{path}: nothing to write (no batches)")
        if pending:
            writer.write_table(pa.concat_tables(pending), row_group_size=row_group_rows)
            rows += pending_rows
        writer.close()
        writer = None
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    return rows


def parquet_section(spec: FeatureSpec, root: str, splits: dict[str, str], **extra: object) -> str:
    """The ``[data.parquet]`` TOML section that reads what :func:`write_split` wrote under ``root``."""
    from gem_train.config import dumps_toml

    section: dict[str, object] = {"root": root, **{k: [v] if v else [] for k, v in splits.items()}, **extra}
    section["request_time"] = "request_time"
    section["dense"] = {"column": "dense", "n_dense": spec.n_dense} if spec.n_dense else {}
    section["sparse"] = {
        f.name: {"num_embeddings": f.num_embeddings, "max_ids": f.max_ids} for f in spec.sparse
    }
    section["sequences"] = {
        s.name: {
            "items": f"{s.name}_items",
            "actions": f"{s.name}_actions",
            "timestamps": f"{s.name}_timestamps",
            "num_items": s.num_items,
            "num_actions": s.num_actions,
            "max_len": s.max_len,
        }
        for s in spec.sequences
    }
    section["labels"] = {t: t for t in spec.tasks}
    return dumps_toml({"data": {"source": "parquet", "parquet": section}})


def _write_all(
    out: Path, spec: FeatureSpec, splits: dict[str, Iterable[GemBatch]], **extra: object
) -> dict[str, int]:
    counts = {}
    names = {}
    for key, batches in splits.items():
        counts[key] = write_split(batches, spec, out / key / "part-00000.parquet")
        names[key] = f"{key}/*.parquet"
    for key in ("train", "valid", "test"):
        names.setdefault(key, "")
    text = parquet_section(spec, str(out), names, **extra)
    tmp = out / "data.toml.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out / "data.toml")
    return counts


def export_movielens(cfg: TrainConfig, out: str | Path, chunk: int = 4096) -> dict[str, int]:
    """MovieLens-100K (``cfg.data.movielens``, the seed of ``cfg.run``) to ``out/{train,valid,test}/``.

    Rows in the built-in loader's split order (each split's event rows in order), every feature computed as
    the built-in loader computes it; ``shuffle = "global"`` then reads the very same batches back.
    Returns the rows written per split.
    """
    from gem_train.data.movielens import MovieLens100K

    if cfg.data.movielens.history_genres:
        # The Parquet schema has no per-event feature columns yet: refuse rather than write a copy that
        # silently lacks the history's genres (the README's export command sets this flag).
        raise ValueError(
            "export movielens-100k: the Parquet format cannot carry the history's genres "
            "(JaggedSequence.event_features); export with data.movielens.history_genres=false"
        )
    ml = MovieLens100K(cfg.data.movielens, seed=cfg.run.seed)

    def chunks(rows: np.ndarray) -> Iterable[GemBatch]:
        for i in range(0, len(rows), chunk):
            yield ml.make_batch(rows[i : i + chunk])

    splits = {"train": chunks(ml.train_rows), "test": chunks(ml.eval_rows)}
    if len(ml.valid_rows):
        splits["valid"] = chunks(ml.valid_rows)
    return _write_all(Path(out), ml.spec, splits, shuffle="global")


def export_synthetic(cfg: TrainConfig, out: str | Path, train_examples: int) -> dict[str, int]:
    """The synthetic dataset (``cfg.data.synthetic``, ``cfg.run.seed``) to ``out/{train,valid,test}/``.

    Train: the generator's batches ``0, 1, ...`` of ``data.batch_size`` rows, ``ceil(train_examples / B)`` of
    them; test and validation: the whole held-out splits in batches of ``data.eval_batch_size``. Read back in
    file order (``shuffle = "none"``) with the same batch sizes, the batches are the generator's.
    """
    from gem_train.data.synthetic import SyntheticAds

    if cfg.data.synthetic.history_categories:
        # As for MovieLens' genres: the Parquet schema has no per-event feature columns yet.
        raise ValueError(
            "export synthetic: the Parquet format cannot carry the history's categories "
            "(JaggedSequence.event_features); export with data.synthetic.history_categories=false"
        )
    ds = SyntheticAds(cfg.data.synthetic, seed=cfg.run.seed)
    b, eb = cfg.data.batch_size, cfg.data.eval_batch_size
    n_train = -(-train_examples // b)
    splits: dict[str, Iterable[GemBatch]] = {
        "train": (ds.make_batch("train", i, b).batch for i in range(n_train)),
        "test": (ds.get("test", i, eb).batch for i in range(ds.held_out_batches("test", eb))),
    }
    if cfg.data.synthetic.valid_examples:
        splits["valid"] = (ds.get("valid", i, eb).batch for i in range(ds.held_out_batches("valid", eb)))
    return _write_all(Path(out), ds.spec, splits, shuffle="none")
