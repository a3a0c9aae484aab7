"""The identity of a ``[data.parquet]`` dataset (see :mod:`gem_train.data.identity`): cheap, from the footers.

Each file of each split is recorded by its resolved path (symbolic links followed), its size, its row count
(the file's, also where the split reads part of it: the validation split cut from the training files by
``data.parquet.valid_fraction``; the split's own count is its ``rows``) and the sha256 of its footer: the
Thrift ``FileMetaData`` bytes between the data and the file's last 8 bytes (``<footer length: u32 LE>PAR1``).
The footer holds the schema, every row group's row count, and every column chunk's offsets, sizes and
statistics, so rewriting a file with other rows changes it (reading it costs one seek and one read per file,
never the data). What it cannot see: a rewrite that keeps the size and every byte
of the footer (the same values' statistics, offsets and sizes), i.e. values swapped within a page of the same
compressed size. Vocabulary files (``ids = "vocab"``) are hashed whole.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from gem_train.data.identity import DataDifference, show
from gem_train.data.parquet.errors import ParquetDataError
from gem_train.data.parquet.schema import SPLITS

if TYPE_CHECKING:
    from gem_train.data.parquet.reader import ParquetSource

__all__ = ["footer_digest", "parquet_differences", "parquet_identity"]

_MAGIC = (b"PAR1", b"PARE")  # plain and encrypted footers


def footer_digest(path: str | Path) -> tuple[int, str]:
    """``(file size in bytes, sha256 of the footer bytes)`` of a Parquet file.

    Raises:
        ParquetDataError: the file cannot be read or does not end like a Parquet file.
    """
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < 12:
                raise ParquetDataError(f"not a Parquet file ({size} bytes)", str(path))
            f.seek(size - 8)
            tail = f.read(8)
            n = int.from_bytes(tail[:4], "little")
            if tail[4:] not in _MAGIC or n > size - 12:
                raise ParquetDataError("not a Parquet file (no footer at its end)", str(path))
            f.seek(size - 8 - n)
            footer = f.read(n)
    except OSError as e:
        raise ParquetDataError(f"cannot read its footer ({e})", str(path)) from e
    return size, hashlib.sha256(footer).hexdigest()


def _file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parquet_identity(source: ParquetSource) -> dict[str, Any]:
    """The identity of ``source``'s data: ``settings`` (the resolved root, the columns read and their types)
    and ``content`` (every split's files, the vocabulary files)."""
    splits: dict[str, Any] = {}
    types: dict[str, str] = {}
    for split, files in source.files.items():
        if files is None:
            continue
        entries = []
        for path in files.paths:
            size, digest = footer_digest(path)
            rows = pq.read_metadata(path).num_rows  # the file's, whatever part of it the split reads
            entry = {"path": os.path.realpath(path), "size": size, "rows": rows, "footer_sha256": digest}
            entries.append(entry)
        splits[split] = {"rows": files.num_rows, "files": entries}
        if not types:
            schema = pq.read_schema(files.paths[0])
            types = {c: str(schema.field(c).type) for c in source.columns if c in schema.names}
    vocab: dict[str, Any] = {}
    features = [("sparse", n, sp.vocab_file) for n, sp in source.layout.sparse]
    features += [("sequences", n, sq.vocab_file) for n, sq in source.layout.sequences]
    for group, name, vocab_file in features:
        if vocab_file:
            p = vocab_file if Path(vocab_file).is_absolute() else str(source.root / vocab_file)
            key = f"data.parquet.{group}.{name}.vocab_file"
            vocab[key] = {"path": os.path.realpath(p), "size": os.path.getsize(p), "sha256": _file_sha256(p)}
    return {
        "source": "parquet",
        "settings": {"root": os.path.realpath(source.root), "columns": types},
        "content": {"splits": splits, "vocab_files": vocab},
    }


def _files_detail(old: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    """What differs between two records of one split's files, naming the files."""
    if old is None or new is None:
        have = old or new
        assert have is not None
        what = f"{len(have['files'])} file(s), {have['rows']} rows"
        return f"the split is new ({what})" if old is None else f"the split is gone (it had {what})"

    def names(paths: list[str]) -> str:
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        return ", ".join(paths[:3]) + more

    a = {f["path"]: f for f in old["files"]}
    b = {f["path"]: f for f in new["files"]}
    parts = []
    if old["rows"] != new["rows"]:
        parts.append(f"rows {old['rows']} -> {new['rows']}")
    changed = []
    for path in [p for p in a if p in b and a[p] != b[p]]:
        x, y = a[path], b[path]
        diff = [f"{k} {x[k]} -> {y[k]}" for k in ("size", "rows") if x[k] != y[k]]
        if x["footer_sha256"] != y["footer_sha256"]:
            diff.append("footer differs")
        changed.append(f"{path} ({', '.join(diff)})")
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        parts.append(f"rewritten: {'; '.join(changed[:3])}{more}")
    gone, added = [p for p in a if p not in b], [p for p in b if p not in a]
    if gone:
        parts.append(f"no longer read: {names(gone)}")
    if added:
        parts.append(f"newly read: {names(added)}")
    if not (changed or gone or added):
        parts.append("the same files, read in another order")
    return "files differ: " + "; ".join(parts)


def parquet_differences(old: dict[str, Any], new: dict[str, Any]) -> list[DataDifference]:
    """Each split whose files differ (key ``data.parquet.<split>``, accepted also by an allowed change of
    ``data.parquet.root``), and each vocabulary file that differs."""
    a, b = old.get("content") or {}, new.get("content") or {}
    out = []
    splits_a, splits_b = a.get("splits") or {}, b.get("splits") or {}
    for split, key in SPLITS.items():
        x, y = splits_a.get(split), splits_b.get(split)
        if x != y:
            k = f"data.parquet.{key}"
            # With no valid files the validation split is cut from the training files by valid_fraction:
            # a change of either moves both splits' rows.
            moved_by: tuple[str, ...] = ("data.source", "data.parquet.root", k, "data.parquet.valid_fraction")
            moved_by += ("data.parquet.train",) if split == "valid" else ()
            out.append(DataDifference(k, _files_detail(x, y), moved_by))
    va, vb = a.get("vocab_files") or {}, b.get("vocab_files") or {}
    for k in sorted(set(va) | set(vb)):
        x, y = va.get(k), vb.get(k)
        if x != y:
            if x is None:
                detail = f"vocabulary file {show((y or {}).get('path'))} is new"
            elif y is None:
                detail = f"vocabulary file {show(x['path'])} is gone"
            else:
                detail = f"vocabulary file {x['path']} -> {y['path']} (size {x['size']} -> {y['size']}"
                detail += ", sha256 differs)" if x["sha256"] != y["sha256"] else ")"
            out.append(DataDifference(k, detail, ("data.source", "data.parquet.root", k)))
    return out
