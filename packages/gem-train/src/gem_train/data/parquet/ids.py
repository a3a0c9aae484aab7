"""Raw ids into table rows: already in range, hashed (a stated, stable hash), or through a vocabulary file.

The hash (``ids = "hash"``) of a raw int64 id ``x`` into a table of ``n`` rows is

    splitmix64(x as uint64) mod n

with splitmix64 the finalizer of Steele, Lea and Flood's SplitMix64 (arithmetic mod 2**64:
``z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9; z = (z ^ (z >> 27)) * 0x94d049bb133111eb; z ^= z >> 31``).
It depends on nothing but ``x`` and ``n``: the same id lands in the same row on every machine, run and
version. Distinct raw ids that land in the same row collide; ``gem-train data inspect`` counts them.

A vocabulary file (``ids = "vocab"``) is UTF-8 text of one raw int64 id per line; the id on line ``k``
(counting from 0) maps to row ``k``. An id not in it is a bad row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["IdMapper", "load_vocabulary", "splitmix64"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finalizer of int64 ``x`` (any shape), as uint64."""
    z = np.asarray(x, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def load_vocabulary(path: str | Path) -> np.ndarray:
    """The raw ids of a vocabulary file, ``[V]`` int64 in file order (line k -> row k).

    Raises:
        ValueError: naming the file and line of a value that is not an int64, or of a repeated id.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"vocabulary file {p} does not exist")
    ids: list[int] = []
    first: dict[int, int] = {}
    with p.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            text = line.strip()
            try:
                v = int(text)
            except ValueError:
                raise ValueError(
                    f"vocabulary file {p}, line {line_no}: {text!r} is not an integer id"
                ) from None
            if not -(2**63) <= v < 2**63:
                raise ValueError(f"vocabulary file {p}, line {line_no}: {v} does not fit in int64")
            if v in first:
                raise ValueError(f"vocabulary file {p}, line {line_no}: id {v} repeats line {first[v]}")
            first[v] = line_no
            ids.append(v)
    if not ids:
        raise ValueError(f"vocabulary file {p} is empty")
    return np.array(ids, dtype=np.int64)


class IdMapper:
    """Maps raw int64 ids of one feature to rows in ``[0, size)``; ``__call__`` returns the rows and a mask
    of the ids that could not be mapped (out of range for "raw", unknown for "vocab"; none for "hash")."""

    def __init__(self, mode: str, size: int, vocab_file: str | Path = "") -> None:
        self.mode, self.size = mode, int(size)
        if mode == "vocab":
            vocab = load_vocabulary(vocab_file)
            if len(vocab) > self.size:
                raise ValueError(
                    f"vocabulary file {vocab_file} has {len(vocab)} ids, more than the {self.size} table rows"
                )
            self._order = np.argsort(vocab, kind="stable")
            self._sorted = vocab[self._order]
        elif mode not in ("raw", "hash"):
            raise ValueError(f"unknown id mode {mode!r}")

    def __call__(self, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, bad)``: ``[N]`` int64 rows (0 where bad) and ``[N]`` bool."""
        raw = np.asarray(raw, dtype=np.int64)
        if self.mode == "raw":
            bad = (raw < 0) | (raw >= self.size)
            return (np.where(bad, 0, raw) if bad.any() else raw), bad
        if self.mode == "hash":
            return (splitmix64(raw) % np.uint64(self.size)).astype(np.int64), np.zeros(raw.shape, bool)
        pos = np.searchsorted(self._sorted, raw)
        pos_c = np.minimum(pos, len(self._sorted) - 1)
        bad = self._sorted[pos_c] != raw
        return np.where(bad, 0, self._order[pos_c]).astype(np.int64), bad
