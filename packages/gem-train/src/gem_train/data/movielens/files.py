"""The MovieLens-100K files: fetched at run time from the ``recbole==1.2.1`` wheel on PyPI (never committed:
GroupLens' terms) and read into :class:`MovieLensEvents`, every field checked (a bad record is a
:class:`MovieLensFormatError` naming file, line and field)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "MAX_GENRES",
    "MAX_TIMESTAMP",
    "N_ZIP",
    "DataFetchError",
    "MovieLensEvents",
    "MovieLensFormatError",
    "default_cache_dir",
    "fetch_movielens_100k",
    "read_movielens_100k",
]

RECBOLE = "recbole==1.2.1"
# sha256 of recbole-1.2.1-py3-none-any.whl on PyPI (the only file of that release), and of the three files
# taken from it: a download or a cache that differs is refused.
RECBOLE_WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
FILE_SHA256 = {
    "ml-100k.inter": "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
    "ml-100k.user": "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972",
    "ml-100k.item": "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",
}
# Unix seconds before 2100: ML-100K's timestamps are 1997-98; a larger value is a corrupt record (and would
# overflow int64 arithmetic further on if it were near 2**63).
MAX_TIMESTAMP = 4_102_444_800
_WHEEL_DIR = "recbole/dataset_example/ml-100k/"
_FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
MAX_GENRES = 6
N_ZIP = 11  # first digit of a US zip code (0-9), 10 for anything else (e.g. Canadian codes)


class DataFetchError(RuntimeError):
    """MovieLens-100K could not be fetched (no pip, no network, not the expected wheel)."""


class MovieLensFormatError(ValueError):
    """A corrupt MovieLens file: the message names the file and the record (line)."""


def default_cache_dir() -> Path:
    """``$GEM_CACHE_DIR`` or ``~/.cache/gem``."""
    return Path(os.environ.get("GEM_CACHE_DIR", Path.home() / ".cache" / "gem"))


def _pip_command() -> list[str]:
    # The interpreter's own pip first; a uv-made venv has none, so fall back to pip on PATH.
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, check=False)
    if probe.returncode == 0:
        return [sys.executable, "-m", "pip"]
    for name in ("pip", "pip3"):
        exe = shutil.which(name)
        if exe:
            return [exe]
    raise DataFetchError(
        "fetching MovieLens-100K needs pip (to run `pip download --no-deps recbole==1.2.1`); none found. "
        "Install pip, or download the wheel yourself and pass it with --wheel"
    )


def fetch_movielens_100k(cache_dir: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """Make sure ``<cache_dir>/ml-100k/`` holds the three ML-100K files; return that directory.

    Args:
        cache_dir: where to keep the wheel and the files (default :func:`default_cache_dir`).
        wheel: a recbole wheel already downloaded (skips pip).
    Raises:
        RuntimeError: the download failed (no network, no pip) or the wheel lacks the dataset.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out = cache / "ml-100k"
    if all((out / f).is_file() and _sha256(out / f) == FILE_SHA256[f] for f in _FILES):
        return out
    cache.mkdir(parents=True, exist_ok=True)
    if wheel is None:
        found = sorted(cache.glob("recbole-1.2.1-*.whl"))
        if not found:
            cmd = [*_pip_command(), "download", "--no-deps", "--only-binary=:all:", RECBOLE, "-d", str(cache)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise DataFetchError(
                    f"`{' '.join(cmd)}` failed (exit {proc.returncode}); is PyPI reachable?\n"
                    f"{proc.stderr.strip()[-2000:]}"
                )
            found = sorted(cache.glob("recbole-1.2.1-*.whl"))
            if not found:
                raise DataFetchError(f"pip reported success but no recbole wheel is in {cache}")
        wheel = found[0]
    got = _sha256(Path(wheel))
    if got != RECBOLE_WHEEL_SHA256:
        raise DataFetchError(
            f"{wheel}: sha256 {got} is not the known sha256 of recbole-1.2.1-py3-none-any.whl "
            f"({RECBOLE_WHEEL_SHA256}): refusing a corrupt or substituted wheel (delete it and fetch again)"
        )
    tmp = cache / "ml-100k.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in _FILES:
            member = _WHEEL_DIR + f
            if member not in names:
                raise DataFetchError(f"{wheel} has no {member}; is it the recbole 1.2.1 wheel?")
            (tmp / f).write_bytes(z.read(member))
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)  # atomic: a half-extracted directory is never taken for a complete one
    return out


# ----------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_table(path: Path, header: list[str]) -> list[tuple[int, list[str]]]:
    """(line number, fields) of each record of a recbole atomic file, after checking its header."""
    if not path.is_file():
        raise MovieLensFormatError(f"{path}: file missing; run `gem-train data movielens-100k`")
    with path.open(encoding="utf-8", errors="strict") as f:
        try:
            lines = f.read().splitlines()
        except UnicodeDecodeError as e:
            raise MovieLensFormatError(f"{path}: not UTF-8 text ({e})") from e
    if not lines:
        raise MovieLensFormatError(f"{path}: empty file")
    got = [h.split(":")[0] for h in lines[0].split("\t")]
    if got != header:
        raise MovieLensFormatError(f"{path}: record 1 (header): expected columns {header}, got {got}")
    rows = []
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            raise MovieLensFormatError(
                f"{path}: record {i}: expected {len(header)} tab-separated fields, "
                f"got {len(fields)}: {line!r}"
            )
        rows.append((i, fields))
    return rows


def _int(path: Path, line: int, name: str, text: str, lo: int, hi: int, why: str = "") -> int:
    """The integer of a field (``12`` or ``12.0``) within ``[lo, hi]``, else :class:`MovieLensFormatError`
    naming the file, the record and the field (never OverflowError: ``inf``, ``1e400``, huge values)."""
    t = text.strip()
    try:
        v = int(t)
    except ValueError:
        try:
            f = float(t)
        except ValueError:
            f = math.nan
        if not math.isfinite(f) or f != math.floor(f):
            raise MovieLensFormatError(f"{path}: record {line}: {name} {text!r} is not an integer") from None
        if not -(2.0**62) <= f <= 2.0**62:
            raise MovieLensFormatError(
                f"{path}: record {line}: {name} {text!r} outside [{lo}, {hi}]{why}"
            ) from None
        v = int(f)
    if not lo <= v <= hi:
        raise MovieLensFormatError(f"{path}: record {line}: {name} {text.strip()} outside [{lo}, {hi}]{why}")
    return v


def _unique_ids(path: Path, rows: list[tuple[int, list[str]]], name: str) -> list[int]:
    """The ids (first column) of a ``.user``/``.item`` file: ML-100K numbers them consecutively from 1, so
    each must lie in [1, number of records] and occur once."""
    n = len(rows)
    if n == 0:
        raise MovieLensFormatError(f"{path}: no records")
    why = f" (ML-100K numbers its {n} {name.split('_')[0]}s consecutively from 1)"
    ids: list[int] = []
    seen: dict[int, int] = {}
    for ln, f in rows:
        v = _int(path, ln, name, f[0], 1, n, why)
        if v in seen:
            raise MovieLensFormatError(f"{path}: record {ln}: duplicate {name} {v} (also record {seen[v]})")
        seen[v] = ln
        ids.append(v)
    return ids


@dataclass
class MovieLensEvents:
    """The parsed dataset: events sorted by (user, timestamp, item), plus user and item attributes.

    Event arrays are ``[N]`` int64; ``user_start`` ``[U+1]`` gives each user's contiguous event range.
    """

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    user_start: np.ndarray  # indexed by user id (0 unused), length num_users + 1
    num_users: int  # max user id + 1
    num_items: int  # max item id + 1
    user_age: np.ndarray  # [num_users]
    user_gender: np.ndarray  # [num_users] 0/1
    user_occupation: np.ndarray  # [num_users]
    num_occupations: int
    user_zip: np.ndarray  # [num_users] first digit of the zip code, 10 = not a digit
    item_year: np.ndarray  # [num_items], 0 = unknown
    item_genres: list[list[int]]  # [num_items] genre ids
    num_genres: int


def read_movielens_100k(directory: str | Path, max_users: int = 0) -> MovieLensEvents:
    """Parse the three ML-100K files in ``directory``; ``max_users > 0`` keeps users 1..max_users.

    Raises:
        MovieLensFormatError: naming the file and the record, for any corrupt record.
    """
    d = Path(directory)
    users = _read_table(d / "ml-100k.user", ["user_id", "age", "gender", "occupation", "zip_code"])
    items = _read_table(d / "ml-100k.item", ["item_id", "movie_title", "release_year", "class"])
    inter = _read_table(d / "ml-100k.inter", ["user_id", "item_id", "rating", "timestamp"])

    p = d / "ml-100k.user"
    uids = _unique_ids(p, users, "user_id")
    num_users = max(uids) + 1
    age = np.zeros(num_users, np.int64)
    gender = np.zeros(num_users, np.int64)
    occ = np.zeros(num_users, np.int64)
    zip_region = np.full(num_users, N_ZIP - 1, np.int64)
    occ_vocab: dict[str, int] = {}
    for (ln, f), u in zip(users, uids):
        age[u] = _int(p, ln, "age", f[1], 1, 120)
        if f[2] not in ("M", "F"):
            raise MovieLensFormatError(f"{p}: record {ln}: gender {f[2]!r} is not M or F")
        gender[u] = f[2] == "F"
        occ[u] = occ_vocab.setdefault(f[3], len(occ_vocab))
        z = f[4].strip()[:1]
        zip_region[u] = int(z) if z.isascii() and z.isdigit() else N_ZIP - 1

    p = d / "ml-100k.item"
    iids = _unique_ids(p, items, "item_id")
    num_items = max(iids) + 1
    year = np.zeros(num_items, np.int64)
    genres: list[list[int]] = [[] for _ in range(num_items)]
    genre_vocab: dict[str, int] = {}
    for (_ln, f), i in zip(items, iids):
        # release_year is a *token* column: mostly a year, but "unkonwn" (sic) and "V" occur; any token
        # that is not a plausible year is an unknown year (0).
        tok = f[2].strip()
        year[i] = int(tok) if tok.isascii() and tok.isdigit() and 1900 <= int(tok) <= 2100 else 0
        genres[i] = [genre_vocab.setdefault(g, len(genre_vocab)) for g in f[3].split()][:MAX_GENRES]

    p = d / "ml-100k.inter"
    n = len(inter)
    arr = np.zeros((n, 4), np.int64)
    no_user = f" (no such user in {d / 'ml-100k.user'})"
    no_item = f" (no such item in {d / 'ml-100k.item'})"
    for k, (ln, f) in enumerate(inter):
        u = _int(p, ln, "user_id", f[0], 1, num_users - 1, no_user)
        i = _int(p, ln, "item_id", f[1], 1, num_items - 1, no_item)
        ts = _int(p, ln, "timestamp", f[3], 0, MAX_TIMESTAMP, " (Unix seconds before 2100)")
        arr[k] = (u, i, _int(p, ln, "rating", f[2], 1, 5), ts)
    if max_users > 0:
        arr = arr[arr[:, 0] <= max_users]
    order = np.lexsort((arr[:, 1], arr[:, 3], arr[:, 0]))  # by user, then time, then item
    arr = arr[order]
    user_start = np.searchsorted(arr[:, 0], np.arange(num_users + 1))
    return MovieLensEvents(
        user=arr[:, 0].copy(), item=arr[:, 1].copy(), rating=arr[:, 2].copy(), timestamp=arr[:, 3].copy(),
        user_start=user_start, num_users=num_users, num_items=num_items, user_age=age, user_gender=gender,
        user_occupation=occ, user_zip=zip_region, num_occupations=max(len(occ_vocab), 1), item_year=year,
        item_genres=genres, num_genres=max(len(genre_vocab), 1),
    )  # fmt: skip
