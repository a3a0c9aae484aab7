"""DCP storage layers of gem-train: a reader that never runs code from a checkpoint, a writer that records
its files.

**Reading.** ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` unpickles ``.metadata`` with
plain :mod:`pickle`, so a crafted checkpoint runs any code it likes on load, whatever ``weights_only`` says
about the tensor files. :class:`SafeFileSystemReader` reads it with an unpickler whose ``find_class`` admits
only an allowlist: DCP's metadata dataclasses (``Metadata``, ``MetadataIndex``, ``StorageMeta``,
``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``TensorProperties`` and its
memory-format enum, the file system's ``_StorageInfo``), ``torch.Size``, torch dtypes and layouts
(``torch.serialization._get_layout``), ``pathlib`` paths (DCP stores the checkpoint id as a ``Path``) and
``collections.OrderedDict``; containers and scalars need no global. Anything else is refused with a
:class:`~gem_train.checkpoint.errors.CheckpointError` naming the file and the global. This is the allowlist
approach of ``torch.load(weights_only=True)``; torch's own weights-only unpickler cannot be reused because it
reads only pickle protocol 2 and DCP writes ``.metadata`` with :func:`pickle.dump`'s default protocol (4:
``FRAME``, ``STACK_GLOBAL``, ``MEMOIZE``). The globals listed are what DCP pickles on torch 2.11 and 2.13 for
replicated and FSDP2-sharded (DTensor) state (checked by recording ``find_class`` on real checkpoints).
With only those callables reachable, the pickle opcodes that call (``REDUCE``, ``NEWOBJ``, ``BUILD``) can
build these plain data objects and nothing else. The tensor files are read by DCP with
``torch.load(weights_only=True)``.

**Writing.** :class:`RecordingFileSystemWriter` is DCP's ``FileSystemWriter`` (files fsynced) that records
which files this rank wrote, so that each rank hashes its own files when the checkpoint is sealed
(:mod:`gem_train.checkpoint.sealing`): hashing is not done while writing, which would lengthen the pause of
training.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pathlib
import pickle
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from gem_train.checkpoint.errors import CheckpointError

__all__ = [
    "RecordingFileSystemWriter",
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


class _Forbidden(pickle.UnpicklingError):
    """What the restricted unpickler refused; the message completes "the file ..."."""


def _allowed_build_types() -> tuple[type, ...]:
    """The classes whose instances a ``BUILD`` opcode may fill in (DCP's dataclasses, ``OrderedDict``)."""
    return tuple(o for o in allowed_metadata_globals().values() if isinstance(o, type))


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickler restricted as torch's weights-only unpickler is, for pickle protocol 4.

    - ``find_class`` admits exactly the names of :func:`allowed_metadata_globals` (a dotted name such as
      ``Metadata.__init__.__globals__`` is not in the table);
    - ``BUILD`` (set an object's state) only on an *instance* of an allowed class: never on a class or a
      module-level object, which would let a file rewrite the attributes of DCP's classes;
    - no extension codes (``EXT1/2/4`` look objects up in copyreg's process-wide cache, past
      ``find_class``) and no persistent ids.

    It is Python's own pure-Python unpickler (``pickle._Unpickler``) with those opcodes replaced: the C
    unpickler cannot be restricted opcode by opcode. A metadata file is small (KBs to a few MB).
    """

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return allowed_metadata_globals()[(module, name)]
        except KeyError:
            raise _Forbidden(f"names the global {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Forbidden(f"uses a persistent id ({pid!r})")

    def _load_build(self) -> None:
        stack: list[Any] = self.stack  # type: ignore[attr-defined]  # pickle._Unpickler's own, untyped
        inst = stack[-2] if len(stack) >= 2 else None
        if isinstance(inst, type) or not isinstance(inst, _allowed_build_types()):
            what = inst.__qualname__ if isinstance(inst, type) else type(inst).__qualname__
            raise _Forbidden(f"sets the state of {'the class ' if isinstance(inst, type) else ''}{what}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # untyped in typeshed

    def _load_ext(self) -> None:
        raise _Forbidden("uses an extension code (EXT opcode)")

    dispatch[pickle.BUILD[0]] = _load_build
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _load_ext
    del _op


def _check_storage_data(metadata: Metadata, path: str | os.PathLike) -> None:
    """Every file a checkpoint's metadata points at is a plain name inside its directory (DCP writes flat
    names such as ``__0_0.distcp``), with sane offsets: a crafted file must not make the loader read
    ``../../somewhere``."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path}: corrupt DCP metadata (storage_data is {type(storage).__name__})")
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if (
            not isinstance(rel, str)
            or rel in ("", ".", "..")
            or "/" in rel
            or "\\" in rel
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, length))
        ):
            raise CheckpointError(
                f"{path}: refused to load: entry {getattr(index, 'fqn', index)!r} points at "
                f"{rel!r} (offset {offset!r}, length {length!r}), not a file of this checkpoint"
            )


def safe_load_metadata(path: str | os.PathLike) -> Metadata:
    """Unpickle the DCP metadata file ``path`` with the restricted unpickler.

    Raises:
        CheckpointError: the file names a forbidden global (the message names the file and the global), or
            is not a DCP ``Metadata`` pickle at all.
    """
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Forbidden as e:
        raise CheckpointError(
            f"{path}: refused to load: it {e}, which DCP metadata never does (a checkpoint may hold data "
            "only, never code; this file may have been crafted to run code on load)"
        ) from None
    except OSError:
        raise
    except Exception as e:  # anything else a data-only pickle can raise (truncated, garbage): corrupt
        raise CheckpointError(f"{path}: corrupt DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not DCP metadata (unpickled a {type(metadata).__name__})")
    _check_storage_data(metadata, path)
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with ``.metadata`` read by :func:`safe_load_metadata` (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = safe_load_metadata(path)
        # What FileSystemReader.read_metadata does after unpickling (torch 2.11 and 2.13 alike).
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


# ----------------------------------------------------------------------------------------------------------
# The recording writer
# ----------------------------------------------------------------------------------------------------------


class _RecordingFileSystem(_dcp_fs.FileSystem):
    """DCP's local ``FileSystem`` that records the names of the files it writes (renames and removals
    followed), so each rank knows which files of a checkpoint are its own to hash."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" in mode or "a" in mode:
            self.names.add(Path(path).name)
        with super().create_stream(path, mode) as stream:
            yield stream

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.names:
            self.names.discard(Path(path).name)
            self.names.add(Path(new_path).name)

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self.names.discard(Path(path).name)


class RecordingFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank, every file fsynced) that records what it wrote:
    ``.written`` after ``dcp.save`` is the set of file names this rank created in the directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.fs = self.recording = _RecordingFileSystem()

    @property
    def written(self) -> set[str]:
        return set(self.recording.names)
