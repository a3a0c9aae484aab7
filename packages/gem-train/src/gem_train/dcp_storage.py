"""DCP storage layers of gem-train: a reader that never runs code from a checkpoint, a writer that hashes.

**Reading.** ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` unpickles ``.metadata`` with
plain :mod:`pickle`, so a crafted checkpoint runs any code it likes on load, whatever ``weights_only`` says
about the tensor files. :class:`SafeFileSystemReader` reads it with an unpickler whose ``find_class`` admits
only an allowlist: DCP's metadata dataclasses (``Metadata``, ``MetadataIndex``, ``StorageMeta``,
``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``TensorProperties`` and its
memory-format enum, the file system's ``_StorageInfo``), ``torch.Size``, torch dtypes and layouts
(``torch.serialization._get_layout``), ``pathlib`` paths (DCP stores the checkpoint id as a ``Path``) and
``collections.OrderedDict``; containers and scalars need no global. Anything else is refused with a
:class:`~gem_train.errors.CheckpointError` naming the file and the global. This is the allowlist approach of
``torch.load(weights_only=True)``; torch's own weights-only unpickler cannot be reused because it reads only
pickle protocol 2 and DCP writes ``.metadata`` with :func:`pickle.dump`'s default protocol (4: ``FRAME``,
``STACK_GLOBAL``, ``MEMOIZE``). The globals listed are what DCP pickles on torch 2.11 and 2.13 for
replicated and FSDP2-sharded (DTensor) state (checked by recording ``find_class`` on real checkpoints).
With only those callables reachable, the pickle opcodes that call (``REDUCE``, ``NEWOBJ``, ``BUILD``) can
build these plain data objects and nothing else. The tensor files are read by DCP with
``torch.load(weights_only=True)``.

**Writing.** :class:`HashingFileSystemWriter` is DCP's ``FileSystemWriter`` with a file system whose write
streams feed every byte to sha256 as it goes to the file, so the integrity manifest
(:mod:`gem_train.manifest`) costs no second read of the checkpoint. A stream that is ever seeked is not
recorded (its file is then hashed from disk when the manifest is written).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import os
import pathlib
import pickle
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from gem_train.errors import CheckpointError
from gem_train.manifest import FileDigest

__all__ = [
    "HashingFileSystemWriter",
    "SafeFileSystemReader",
    "allowed_metadata_globals",
    "safe_load_metadata",
]


# ----------------------------------------------------------------------------------------------------------
# The restricted unpickler
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def allowed_metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` of every global a DCP ``.metadata`` may name."""
    objs: list[Any] = [torch.Size, torch.serialization._get_layout, collections.OrderedDict]
    objs += [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath]
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(_dcp_md, name):  # every one of them exists in torch 2.11 and 2.13
            objs.append(getattr(_dcp_md, name))
    objs.append(_dcp_fs._StorageInfo)
    allowed = {(o.__module__, o.__qualname__): o for o in objs}
    # dtypes and layouts pickle as attributes of the torch module (e.g. GLOBAL "torch float32").
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler whose globals are restricted to :func:`allowed_metadata_globals` (exact names only: a
    dotted name such as ``Metadata.__init__.__globals__`` is not in the table)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return allowed_metadata_globals()[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"forbidden persistent id {pid!r}")


def safe_load_metadata(path: str | os.PathLike) -> Metadata:
    """Unpickle the DCP metadata file ``path`` with the restricted unpickler.

    Raises:
        CheckpointError: the file names a forbidden global (the message names the file and the global), or
            is not a DCP ``Metadata`` pickle at all.
    """
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        if str(e).startswith("forbidden "):
            raise CheckpointError(
                f"{path}: refused to load: it names the {str(e)[len('forbidden ') :]}, which is not one "
                "of DCP's metadata classes (a checkpoint may hold data only, never code; this file may have "
                "been crafted to run code on load)"
            ) from None
        raise CheckpointError(f"{path}: corrupt DCP metadata ({e})") from None
    except (EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not DCP metadata (unpickled a {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with ``.metadata`` read by :func:`safe_load_metadata` (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = safe_load_metadata(path)
        # What FileSystemReader.read_metadata does after unpickling (torch 2.11 and 2.13 alike).
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ----------------------------------------------------------------------------------------------------------
# The hashing writer
# ----------------------------------------------------------------------------------------------------------


class _HashingStream(io.RawIOBase):
    """A write-only file that feeds every byte written to sha256 and reports the digest to ``on_close``
    (``tell``/``fileno``/``flush`` pass through; after a ``seek`` the digest is not reported)."""

    def __init__(self, raw: io.BufferedWriter, on_close: Any) -> None:
        super().__init__()
        self.raw = raw
        self.on_close = on_close
        self.sha = hashlib.sha256()
        self.size = 0
        self.seeked = False

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)  # a BufferedWriter writes everything (blocking file)
        self.sha.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.seeked = True
        return self.raw.seek(offset, whence)

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.raw.close()
        super().close()
        self.on_close(None if self.seeked else FileDigest(self.size, self.sha.hexdigest()))


class _HashingFileSystem(_dcp_fs.FileSystem):
    """DCP's local ``FileSystem`` that records ``{file name: FileDigest}`` of every file it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, FileDigest] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name
        self.digests.pop(name, None)

        def record(digest: FileDigest | None) -> None:
            if digest is not None:
                self.digests[name] = digest

        stream = _HashingStream(open(path, mode), record)  # noqa: SIM115 (closed below or by DCP)
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        digest = self.digests.pop(Path(path).name, None)
        if digest is not None:
            self.digests[Path(new_path).name] = digest

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self.digests.pop(Path(path).name, None)


class HashingFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank, files fsynced) that also records the size and sha256
    of every file it writes; ``.digests`` after ``dcp.save`` maps file names to :class:`FileDigest`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.fs = _HashingFileSystem()

    @property
    def digests(self) -> dict[str, FileDigest]:
        return dict(self.fs.digests)
