"""The layout of a run's ``checkpoints/`` folder: directory names, which directories are complete
checkpoints, and finding one (newest, best, named by a path)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from gem_train.checkpoint.manifest import MANIFEST

__all__ = [
    "BEST_LINK",
    "BEST_RE",
    "REPLACED_PREFIX",
    "STEP_RE",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "best_checkpoint",
    "checkpoint_step",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "resolve_checkpoint",
]


STEP_RE = re.compile(r"^step_(\d+)$")
BEST_RE = re.compile(r"^best_step_(\d+)$")
BEST_LINK = "best"  # checkpoints/best -> best_step_<N>
TMP_PREFIX = ".tmp-"  # being written
REPLACED_PREFIX = ".replaced-"  # the previous copy of a step saved again, until the new copy is in place
TRASH_PREFIX = ".trash-"  # being removed


def is_complete(d: Path) -> bool:
    return d.is_dir() and (d / MANIFEST).is_file()


def checkpoint_step(path: str | Path) -> int | None:
    """The step of a checkpoint directory name (``step_<N>``, ``best_step_<N>``, ``.replaced-step_<N>``),
    or None."""
    name = Path(path).name
    name = name.removeprefix(REPLACED_PREFIX)
    m = STEP_RE.match(name) or BEST_RE.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first: ``step_<N>`` directories with a manifest, and
    ``.replaced-step_<N>`` for a step whose ``step_<N>`` is absent (a crash while that step was re-saved)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    replaced: dict[int, Path] = {}
    for d in root.iterdir():
        is_replaced = d.name.startswith(REPLACED_PREFIX)
        m = STEP_RE.match(d.name.removeprefix(REPLACED_PREFIX))
        if m and is_complete(d):
            (replaced if is_replaced else found)[int(m.group(1))] = d
    for step, d in replaced.items():
        found.setdefault(step, d)
    return [found[s] for s in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def best_checkpoint(root: str | Path) -> Path | None:
    """``root/best`` (the link to the best-validation checkpoint) if it names a complete checkpoint (or the
    ``.replaced-`` copy of its target while that is being re-saved); else None."""
    root = Path(root)
    link = root / BEST_LINK
    if is_complete(link):
        return link
    if link.is_symlink():
        old = root / (REPLACED_PREFIX + os.readlink(link))
        if is_complete(old):
            return old
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint a path names: a checkpoint directory itself, or a run directory's newest complete
    checkpoint. Raises FileNotFoundError naming what is missing."""
    path = Path(path)
    if (path / "checkpoints").is_dir():  # a run directory: take its newest checkpoint
        ck = latest_checkpoint(path / "checkpoints")
        if ck is None:
            raise FileNotFoundError(f"run directory {path} has no complete checkpoint")
        return ck
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return path
