"""File operations that never leave a half-done checkpoint under a checkpoint's name: durable renames,
installing a new copy over an old one, removal through a trash name, pruning."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from gem_train.checkpoint.layout import (
    REPLACED_PREFIX,
    TMP_PREFIX,
    TRASH_PREFIX,
    is_complete,
    list_checkpoints,
)
from gem_train.checkpoint.manifest import fsync_dir, fsync_file

__all__ = [
    "fsync_tree",
    "install",
    "prune_checkpoints",
    "remove_checkpoint",
    "rename_durably",
    "set_aside_checkpoint",
]


def fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def rename_durably(src: Path, dst: Path) -> None:
    """``rename(2)`` then fsync of the parent (one place, so tests can inject a crash between steps)."""
    os.rename(src, dst)
    fsync_dir(dst.parent)


def remove_checkpoint(path: str | Path) -> None:
    """Remove a checkpoint directory: renamed to ``.trash-<name>`` first (atomic), then deleted, so a crash
    mid-delete never leaves a partial directory under a checkpoint's name."""
    path = Path(path)
    if not path.exists():
        return
    trash = path.parent / (TRASH_PREFIX + path.name.removeprefix(REPLACED_PREFIX))
    if trash.exists():
        shutil.rmtree(trash)
    rename_durably(path, trash)
    shutil.rmtree(trash)


def set_aside_checkpoint(path: str | Path, prefix: str = "nonfinite-") -> Path:
    """Rename a checkpoint to ``<prefix><name>`` (no longer listed, kept for inspection); returns the new
    path. Call on one rank only."""
    path = Path(path)
    dest = path.parent / (prefix + path.name.removeprefix(REPLACED_PREFIX))
    if dest.exists():
        shutil.rmtree(dest)
    rename_durably(path, dest)
    return dest


def install(tmp: Path, final: Path) -> None:
    """Move the complete ``tmp`` to ``final``; an existing ``final`` stays as ``.replaced-<name>`` until the
    new one is in place."""
    old = final.parent / (REPLACED_PREFIX + final.name)
    if final.exists() and not is_complete(final):
        remove_checkpoint(final)  # not a checkpoint (a partial copy): nothing to keep
    if final.exists():
        if old.exists():
            remove_checkpoint(old)  # a leftover of an earlier crash: the complete `final` supersedes it
        rename_durably(final, old)
    rename_durably(tmp, final)
    if old.exists():
        remove_checkpoint(old)


def prune_checkpoints(root: str | Path, keep_last: int, protect: Iterable[str | Path] = ()) -> None:
    """Keep the newest ``keep_last`` complete checkpoints under ``root`` (and those in ``protect``); remove
    the older ones and leftovers of interrupted writes (``.tmp-*``, ``.trash-*``). Call on one rank only,
    with no save in flight."""
    root = Path(root)
    keep = {Path(p).name for p in protect}
    ckpts = list_checkpoints(root)
    keep |= {c.name for c in ckpts[-keep_last:]} if keep_last > 0 else {c.name for c in ckpts}
    for c in ckpts:
        if c.name not in keep:
            remove_checkpoint(c)
    for d in root.iterdir() if root.is_dir() else ():
        if d.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
