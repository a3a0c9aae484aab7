"""A run's config history, ``<run dir>/config_history.jsonl``: appended, never rewritten.

``config.toml`` stays the config the run started with. The history holds one JSON object per line:

- ``{"event": "start", "time", "step": 0, "world_size", "config", "data_identity", "data_identity_sha256"}``
  when the run starts;
- ``{"event": "resume", "time", "step", "checkpoint", "world_size", "continues", "allowed", "data_allowed",
  "no_effect", "allow_change", "config", "data_identity_sha256"}`` at every resume (each change as
  ``{"key", "old", "new"}``; ``data_identity`` too when it differs from the checkpoint's).

Each entry is one ``write`` of a whole line with ``O_APPEND``, then ``fsync``: a crash leaves at most a torn
last line, which :func:`read_history` skips and the next append starts after.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any

from gem_train.config import TrainConfig, config_to_dict
from gem_train.data.identity import identity_digest
from gem_train.loop.resume_check import ResumePlan

__all__ = ["HISTORY_FILE", "append_history", "read_history", "record_resume", "record_start"]

HISTORY_FILE = "config_history.jsonl"


def append_history(run_root: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` as one line to the run's history, durably (see the module docstring)."""
    path = Path(run_root) / HISTORY_FILE
    line = (json.dumps(entry, separators=(", ", ": ")) + "\n").encode("utf-8")
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # after a torn line (a crash mid-append): start a line of our own
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # the new directory entry durable too
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_history(run_root: Path) -> list[dict[str, Any]]:
    """The entries of a run's history, oldest first (a torn line is skipped); [] if there is none."""
    path = Path(run_root) / HISTORY_FILE
    if not path.is_file():
        return []
    out = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def record_start(run_root: Path, cfg: TrainConfig, identity: dict[str, Any], world_size: int) -> None:
    """The history's first entry: the config and the data the run starts with."""
    append_history(run_root, {
        "event": "start", "time": _now(), "step": 0, "world_size": world_size, "config": config_to_dict(cfg),
        "data_identity": identity, "data_identity_sha256": identity_digest(identity),
    })  # fmt: skip


def record_resume(
    run_root: Path,
    plan: ResumePlan,
    cfg: TrainConfig,
    identity: dict[str, Any],
    saved_identity: Any,
    world_size: int,
) -> None:
    """A resume's entry: from which checkpoint, what changed (by kind) and the config it continues with."""
    entry: dict[str, Any] = {
        "event": "resume", "time": _now(), "step": plan.step, "checkpoint": str(plan.checkpoint),
        "world_size": world_size, **plan.history_entry(), "config": config_to_dict(cfg),
        "data_identity_sha256": identity_digest(identity),
    }  # fmt: skip
    if saved_identity != identity:
        entry["data_identity"] = identity
    append_history(run_root, entry)
