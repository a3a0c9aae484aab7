"""The files of a ``gem-train predict`` output directory: Parquet shards, written atomically, and a manifest.

Layout::

    OUT/
        manifest.json               written last (atomically): what was predicted, how, and every shard
        <split>-<shard:05d>.parquet one shard: batches [shard * K, (shard + 1) * K) of the split's plan

Columns of a shard: the key columns (:mod:`gem_train.transfer.rows`), ``user_id`` / ``ad_id`` where the data
has them, ``<task>_prob`` and ``<task>_logit`` (float32) for every task, and with ``--embeddings`` an
``embedding`` column (``fixed_size_list<float32, D>``). Each shard's Parquet metadata says which run and
batches it holds (``gem_predict`` JSON), so a rerun skips the complete ones.

Atomicity: a shard is written to ``.tmp-<name>.<pid>``, fsynced, renamed to its name and the directory
fsynced. A crash leaves either no file of that name or a whole one; leftover temporaries are removed by the
next run. The manifest, also written through a temporary file, lists only shards that exist whole, so a
reader that trusts the manifest (:func:`read_manifest`) never sees a partial output.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem_train.checkpoint.manifest import fsync_dir, fsync_file
from gem_train.transfer.errors import TransferDataError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "PredictionFilesError",
    "read_manifest",
    "remove_temporaries",
    "shard_columns",
    "shard_info",
    "shard_name",
    "write_manifest",
    "write_shard",
]

FORMAT = "gem-train-predict/1"
MANIFEST = "manifest.json"
_META_KEY = b"gem_predict"


class PredictionFilesError(TransferDataError):
    """A ``predict`` output directory that is incomplete, damaged or of another run (one-line message)."""


def shard_name(split: str, shard: int) -> str:
    return f"{split}-{shard:05d}.parquet"


def shard_columns(columns: dict[str, np.ndarray], embedding: np.ndarray | None) -> pa.Table:
    """A shard's Arrow table: ``columns`` (name -> ``[n]``: ints, floats or strings) and the optional
    ``[n, D]`` float32 ``embedding`` as a fixed-size list column."""
    arrays, names = [], []
    for name, values in columns.items():
        if values.dtype == object and len(values) and (values == values[0]).all():  # e.g. the split
            codes = pa.array(np.zeros(len(values), np.int8))
            arrays.append(pa.DictionaryArray.from_arrays(codes, pa.array([str(values[0])], pa.string())))
        elif values.dtype == object:
            arrays.append(pa.array(values, type=pa.string()))
        else:
            arrays.append(pa.array(values))
        names.append(name)
    if embedding is not None:
        flat = pa.array(np.ascontiguousarray(embedding, dtype=np.float32).reshape(-1))
        arrays.append(pa.FixedSizeListArray.from_arrays(flat, embedding.shape[1]))
        names.append("embedding")
    return pa.Table.from_arrays(arrays, names=names)


def write_shard(path: Path, table: pa.Table, meta: dict[str, Any]) -> int:
    """Write ``table`` to ``path`` atomically (temporary file, fsync, rename, directory fsync) with ``meta``
    (JSON) in its Parquet metadata; returns the file size."""
    schema_meta = dict(table.schema.metadata or {})
    schema_meta[_META_KEY] = json.dumps(meta, sort_keys=True).encode()
    table = table.replace_schema_metadata(schema_meta)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    try:
        pq.write_table(table, tmp, compression="zstd", row_group_size=65_536)
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return path.stat().st_size


def shard_info(path: Path) -> dict[str, Any] | None:
    """A complete shard's metadata (the ``meta`` it was written with, plus ``rows`` and ``bytes``), or None
    when ``path`` is not a readable shard (a foreign or damaged file)."""
    try:
        pf = pq.ParquetFile(path)
        raw = (pf.schema_arrow.metadata or {}).get(_META_KEY)
        if raw is None:
            return None
        meta: dict[str, Any] = json.loads(raw)
        meta["rows"] = int(pf.metadata.num_rows)
        meta["bytes"] = path.stat().st_size
        return meta
    except (OSError, pa.ArrowException, ValueError):
        return None


def remove_temporaries(out: Path, names: Iterable[str]) -> None:
    """Remove leftover ``.tmp-<name>.*`` files of a crashed run for the shards ``names``."""
    for name in names:
        for tmp in out.glob(f".tmp-{name}.*"):
            tmp.unlink(missing_ok=True)


def write_manifest(out: Path, manifest: dict[str, Any]) -> Path:
    """``OUT/manifest.json``, atomically."""
    path = out / MANIFEST
    tmp = out / f".tmp-{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=True) + "\n")
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(out)
    return path


def read_manifest(out: str | Path, splits: Iterable[str] | None = None) -> dict[str, Any]:
    """The manifest of a ``predict`` output, with every listed shard (of ``splits``: all by default)
    checked to exist with its size.

    Raises:
        PredictionFilesError: no manifest (predict did not finish), another format, or a listed shard
            missing or of another size.
    """
    out = Path(out)
    path = out / MANIFEST
    if not path.is_file():
        raise PredictionFilesError(
            f"{out}: no {MANIFEST}: not a finished `gem-train predict` output (rerun predict: it skips "
            "the complete shards)"
        )
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PredictionFilesError(f"{path}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PredictionFilesError(f"{path}: not a {FORMAT} manifest")
    wanted = None if splits is None else set(splits)
    for split, info in manifest.get("splits", {}).items():
        if wanted is not None and split not in wanted:
            continue
        for shard in info["shards"]:
            f = out / shard["file"]
            if not f.is_file() or f.stat().st_size != shard["bytes"]:
                raise PredictionFilesError(
                    f"{f}: missing or of another size than the manifest says ({split})"
                )
    return manifest
