"""Errors shared by gem-train's checkpoint modules (kept apart so the storage layers below
:mod:`gem_train.checkpoint` can raise them without an import cycle)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, unsafe or does not match the run loading it.

    The message names the checkpoint directory and, where one file is at fault, that file.
    """
