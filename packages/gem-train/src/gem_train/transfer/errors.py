"""The one error of knowledge-transfer data: a ``predict`` output or a teacher join that cannot be used."""

from __future__ import annotations

__all__ = ["TransferDataError"]


class TransferDataError(ValueError):
    """A ``gem-train predict`` output that is incomplete, damaged or of another run, or teacher predictions
    that do not fit the student's data (missing keys, another dataset or task set, NaN). The message is
    one line naming the file or the key; the command line reports it as ``gem-train: error: ...`` (exit 1)."""
