"""Integrity manifests of checkpoint directories: every file's size and sha256, written last, checked first.

``manifest.json`` in a checkpoint directory::

    {"format": "gem-train-checkpoint", "version": 1,
     "files": {"<file name>": {"size": <bytes>, "sha256": "<64 hex digits>"}, ...}}

It lists every file of the directory except itself. The checkpoint writer records each file's digest from
the bytes as they are written (:class:`gem_train.checkpoint.storage.HashingFileSystemWriter`), so nothing is
read back; :func:`write_manifest` hashes from disk only a file that no writer recorded, checks every recorded
size against the file on disk, and writes the manifest last (to a temporary name, fsynced, renamed, directory
fsynced). A directory without a manifest is therefore never a complete checkpoint.

Loading checks the manifest before any other file is opened (:func:`check_files`): no file missing, none
extra, every size and every sha256 equal. The manifest protects against corruption (a flipped bit, a
truncated or half-copied file, a file from another checkpoint), not against someone who rewrites it too:
that is what the safe unpickler of :mod:`gem_train.checkpoint.storage` is for.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gem_train.checkpoint.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "FileDigest",
    "check_files",
    "digest_bytes",
    "fsync_dir",
    "fsync_file",
    "hash_file",
    "read_manifest",
    "write_manifest",
]

MANIFEST = "manifest.json"
_FORMAT = "gem-train-checkpoint"
_VERSION = 1
_CHUNK = 8 << 20  # bytes per read while hashing: large enough that hashlib (which drops the GIL) dominates


@dataclass(frozen=True)
class FileDigest:
    """Size in bytes and lower-case hex sha256 of one file."""

    size: int
    sha256: str


def digest_bytes(data: bytes) -> FileDigest:
    """The :class:`FileDigest` of ``data``."""
    return FileDigest(len(data), hashlib.sha256(data).hexdigest())


def hash_file(path: str | Path) -> FileDigest:
    """Size and sha256 of the file at ``path``, read in 8 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return FileDigest(size, h.hexdigest())


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so the names created or renamed in it are on disk."""
    fsync_file(path)


def _listing(directory: Path) -> dict[str, os.stat_result]:
    """Every entry of ``directory`` but the manifest (and its temporary), with its stat."""
    out = {}
    for entry in os.scandir(directory):
        if entry.name in (MANIFEST, MANIFEST + ".tmp"):
            continue
        out[entry.name] = entry.stat(follow_symlinks=False)
    return out


def write_manifest(directory: str | Path, recorded: Mapping[str, FileDigest]) -> dict[str, FileDigest]:
    """Write ``directory/manifest.json`` for every file in ``directory``; call it after all files are
    written and fsynced.

    Args:
        recorded: digests taken while the files were written (file name -> digest). A file of the
            directory missing here is hashed from disk; a recorded size that differs from the file's is an
            error (the bytes hashed are not the bytes on disk).
    Returns:
        The digests written.
    """
    directory = Path(directory)
    files: dict[str, FileDigest] = {}
    listing = _listing(directory)
    for name, st in sorted(listing.items()):
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{directory}: unexpected entry {name!r} (a checkpoint holds plain files only)"
            )
        digest = recorded.get(name)
        if digest is None:
            digest = hash_file(directory / name)
        elif digest.size != st.st_size:
            raise CheckpointError(
                f"{directory / name}: {digest.size} bytes were written but the file holds {st.st_size}"
            )
        files[name] = digest
    gone = sorted(set(recorded) - set(listing))
    if gone:
        raise CheckpointError(f"{directory}: files written but no longer there: {', '.join(gone)}")
    doc = {
        "format": _FORMAT,
        "version": _VERSION,
        "files": {n: {"size": d.size, "sha256": d.sha256} for n, d in files.items()},
    }
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync_dir(directory)
    return files


def read_manifest(directory: str | Path) -> dict[str, FileDigest]:
    """The manifest of a checkpoint directory (file name -> digest); :class:`CheckpointError` naming the
    manifest if it is missing or malformed."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete gem-train checkpoint: no {MANIFEST} (its write was interrupted, "
            "or it predates integrity manifests); pass a checkpoints/step_<N> directory of a run"
        )
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt manifest (not JSON: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != _VERSION:
        raise CheckpointError(
            f"{path}: not a gem-train checkpoint manifest of version {_VERSION} "
            f"(format {doc.get('format') if isinstance(doc, dict) else None!r})"
        )
    files = doc.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: corrupt manifest ('files' is not a table)")
    out = {}
    for name, entry in files.items():
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and not isinstance(entry.get("size"), bool)
            and entry["size"] >= 0
            and isinstance(entry.get("sha256"), str)
            and len(entry["sha256"]) == 64
        )
        if not ok or "/" in name or name in ("", ".", ".."):
            raise CheckpointError(f"{path}: corrupt manifest entry {name!r}: {entry!r}")
        out[name] = FileDigest(entry["size"], entry["sha256"])
    return out


def check_files(
    directory: str | Path, manifest: Mapping[str, FileDigest], hash_names: Iterable[str] | None = None
) -> list[str]:
    """Problems of ``directory`` against ``manifest``, one line each naming the file (empty: intact).

    Missing and extra files and sizes are always checked (cheap); the sha256 of the files in
    ``hash_names`` (default: all), so several ranks can share the hashing.
    """
    directory = Path(directory)
    listing = _listing(directory)
    problems = [
        f"{directory / n}: missing (listed in {MANIFEST})" for n in sorted(set(manifest) - set(listing))
    ]
    problems += [f"{directory / n}: not listed in {MANIFEST}" for n in sorted(set(listing) - set(manifest))]
    for name in sorted(set(manifest) & set(listing)):
        size = listing[name].st_size
        if size != manifest[name].size:
            problems.append(
                f"{directory / name}: {size} bytes, {MANIFEST} says {manifest[name].size} (truncated?)"
            )
    if problems:
        return problems
    for name in sorted(manifest if hash_names is None else hash_names):
        got = hash_file(directory / name)
        if got.sha256 != manifest[name].sha256:
            problems.append(f"{directory / name}: sha256 {got.sha256} differs from {MANIFEST} (corrupt)")
    return problems
