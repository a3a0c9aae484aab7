"""The error of a bad Parquet input: it names the file and, for a bad row, its row group and row."""

from __future__ import annotations

__all__ = ["ParquetDataError", "where"]


def where(path: str, row_group: int | None = None, row: int | None = None) -> str:
    """``file F, row group G, row R`` (row counted from 0 within the row group)."""
    out = f"file {path}"
    if row_group is not None:
        out += f", row group {row_group}"
    if row is not None:
        out += f", row {row}"
    return out


class ParquetDataError(ValueError):
    """A Parquet input that does not fit its ``[data.parquet]`` declaration.

    Attributes:
        path: the file; ``row_group``, ``row``: the first bad row (None where the whole file is at fault).
    """

    def __init__(self, msg: str, path: str, row_group: int | None = None, row: int | None = None) -> None:
        super().__init__(f"{where(path, row_group, row)}: {msg}")
        self.msg, self.path, self.row_group, self.row = msg, path, row_group, row

    def __reduce__(self) -> tuple[type[ParquetDataError], tuple[str, str, int | None, int | None]]:
        # Rebuilt from its fields (the default would call it with the formatted message alone): a loader
        # worker's error reaches the main process as this same error (gem_train.data.workers).
        return type(self), (self.msg, self.path, self.row_group, self.row)
