"""MovieLens-100K as a CTR task, fetched at run time from the ``recbole==1.2.1`` wheel on PyPI.

The data (GroupLens' terms) is never committed: :func:`fetch_movielens_100k` runs
``pip download --no-deps recbole==1.2.1`` into a cache directory and extracts
``recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}`` from the wheel (a zip). Those are tab-separated
files with a typed header (``user_id:token  item_id:token  rating:float  timestamp:float`` and so on).

The task: every rating event is a candidate impression (the movie is the "ad"), label ``ctr`` =
``rating >= like_threshold``; the user's earlier events, oldest first, are the history (item ids, ratings as
action ids 1..5, timestamps and, with ``history_genres``, the multi-hot genres of each history item),
truncated to the most recent ``max_len``. Events are ordered by
(timestamp, item id) per user; the history of an event holds only the user's events with a strictly
earlier timestamp (ML-100K users rate several movies in the same second: those are not "earlier").
Three splits, by time within each user:

- ``"test"`` (the test split): the last ``eval_fraction`` of each user's events (at least one);
- ``"valid"`` (the validation split, for model selection): the ``valid_fraction`` of the user's events just
  before those (``ceil(valid_fraction * count)``, but never the user's last training event: a user keeps at
  least one training event); ``valid_fraction = 0`` disables it;
- ``"train"``: the rest, i.e. every event before the user's validation and test events.

So for every user, training events < validation events < test events in time. The history of a validation
or test event holds all the user's earlier events (known at request time: for a test event that includes
the user's validation events), never the event itself or later ones.

Features (only from the past or from static attributes, so nothing leaks the label):
- sparse: ``user_id``, ``user_gender``, ``user_age``, ``user_occupation``, ``user_zip`` (the first digit of
  the zip code, the US postal region; 10 for a non-numeric code), ``ad_id`` (the movie),
  ``ad_genres`` (multi-hot, up to 6), ``ad_year`` (release-year bucket);
- history events (``history_genres``, the default): the genres of each history item as a multi-hot
  ``[total, num_genres]`` float32 row (``JaggedSequence.event_features``; row ``i`` is the genres of
  history event ``i``'s own movie, not the candidate's). The model's bias-free ``Linear(num_genres, E)`` of
  a multi-hot row is the sum-pooled embedding bag of those genre ids: the same multi-hot genre feature
  the candidate has, as a small dense matmul with no TorchRec table to shard;
- dense (8): age, release year, log training popularity of the movie, log history length, mean and
  like-rate of the history's ratings, log hours since the previous event, history like-rate of the movie's
  genres.
"""

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
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import FeatureSpec, GemBatch, JaggedSequence, SequenceFeature, SparseFeature
from gem_train.config import MovieLensConfig
from gem_train.data.loader import LoadedBatch
from gem_train.data.split import HELD_OUT, Split, check_split

__all__ = [
    "DataFetchError",
    "MovieLens100K",
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
_MAX_TIMESTAMP = 4_102_444_800
_WHEEL_DIR = "recbole/dataset_example/ml-100k/"
_FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
_N_DENSE = 8
_MAX_GENRES = 6
_N_YEAR_BUCKETS = 16
_N_ZIP = 11  # first digit of a US zip code (0-9), 10 for anything else (e.g. Canadian codes)
_AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # the ML-1M convention, applied to ML-100K's exact ages


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
    zip_region = np.full(num_users, _N_ZIP - 1, np.int64)
    occ_vocab: dict[str, int] = {}
    for (ln, f), u in zip(users, uids):
        age[u] = _int(p, ln, "age", f[1], 1, 120)
        if f[2] not in ("M", "F"):
            raise MovieLensFormatError(f"{p}: record {ln}: gender {f[2]!r} is not M or F")
        gender[u] = f[2] == "F"
        occ[u] = occ_vocab.setdefault(f[3], len(occ_vocab))
        z = f[4].strip()[:1]
        zip_region[u] = int(z) if z.isascii() and z.isdigit() else _N_ZIP - 1

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
        genres[i] = [genre_vocab.setdefault(g, len(genre_vocab)) for g in f[3].split()][:_MAX_GENRES]

    p = d / "ml-100k.inter"
    n = len(inter)
    arr = np.zeros((n, 4), np.int64)
    no_user = f" (no such user in {d / 'ml-100k.user'})"
    no_item = f" (no such item in {d / 'ml-100k.item'})"
    for k, (ln, f) in enumerate(inter):
        u = _int(p, ln, "user_id", f[0], 1, num_users - 1, no_user)
        i = _int(p, ln, "item_id", f[1], 1, num_items - 1, no_item)
        ts = _int(p, ln, "timestamp", f[3], 0, _MAX_TIMESTAMP, " (Unix seconds before 2100)")
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


# ----------------------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------------------


class MovieLens100K:
    """ML-100K CTR examples as ``GemBatch``es (a :class:`~gem_train.data.loader.BatchSource`).

    ``events`` defaults to fetching (if needed) and parsing the files from ``cfg.cache_dir``.
    """

    def __init__(self, cfg: MovieLensConfig, seed: int = 0, events: MovieLensEvents | None = None) -> None:
        self.cfg = cfg
        self.seed = int(seed)
        if events is None:
            events = read_movielens_100k(fetch_movielens_100k(cfg.cache_dir or None), cfg.max_users)
        self.ev = ev = events
        n = len(ev.user)
        if n == 0:
            raise ValueError("MovieLens-100K: no events (max_users too small?)")
        # Position of every event in its user's time order; the test tail of each user and, before it, the
        # validation block.
        pos = np.arange(n) - ev.user_start[ev.user]
        count = ev.user_start[ev.user + 1] - ev.user_start[ev.user]
        n_eval = np.maximum(1, np.ceil(cfg.eval_fraction * count)).astype(np.int64)
        n_valid = np.zeros_like(n_eval)
        if cfg.valid_fraction > 0:
            want = np.ceil(cfg.valid_fraction * count).astype(np.int64)
            n_valid = np.clip(want, 0, np.maximum(count - n_eval - 1, 0))
        is_eval = pos >= count - n_eval
        is_valid = ~is_eval & (pos >= count - n_eval - n_valid)
        self.pos = pos
        # Where each event's history ends (exclusive, a position in its user's order): the user's first
        # event at the same timestamp, so no event at the candidate's second (or later) is in its history.
        key = ev.user * (_MAX_TIMESTAMP + 1) + ev.timestamp  # sorted: events are by (user, time, item)
        self.hist_end = np.searchsorted(key, key, side="left") - ev.user_start[ev.user]
        self.train_rows = np.flatnonzero(~is_eval & ~is_valid)
        self.valid_rows = np.flatnonzero(is_valid)
        self.eval_rows = np.flatnonzero(is_eval)
        self.label = (ev.rating >= cfg.like_threshold).astype(np.float32)
        # Movie popularity from the training split only.
        self.item_pop = np.bincount(ev.item[self.train_rows], minlength=ev.num_items).astype(np.float64)
        self._perm_cache: tuple[int, np.ndarray] | None = None
        # [num_items, num_genres] float32 multi-hot genres of every movie (the history's event features).
        self.item_genre_hot = np.zeros((ev.num_items, ev.num_genres), np.float32)
        for i, gs in enumerate(ev.item_genres):
            self.item_genre_hot[i, gs] = 1.0
        self.spec = FeatureSpec(
            n_dense=_N_DENSE,
            sparse=(
                SparseFeature("user_id", ev.num_users),
                SparseFeature("user_gender", 2),
                SparseFeature("user_age", len(_AGE_BUCKETS) + 1),
                SparseFeature("user_occupation", ev.num_occupations),
                SparseFeature("user_zip", _N_ZIP),
                SparseFeature("ad_id", ev.num_items),
                SparseFeature("ad_genres", ev.num_genres, max_ids=_MAX_GENRES),
                SparseFeature("ad_year", _N_YEAR_BUCKETS),
            ),
            sequences=(
                SequenceFeature(
                    "history",
                    ev.num_items,
                    6,
                    cfg.max_len,
                    num_event_features=ev.num_genres if cfg.history_genres else 0,
                ),
            ),
            tasks=("ctr",),
        )

    # BatchSource -------------------------------------------------------------------------------------------

    def num_batches(self, split: Split, batch_size: int) -> int:
        """Batches in one pass over ``split`` ("train", "valid" or "test"); "valid" has 0 when disabled."""
        if split in HELD_OUT:
            return -(-len(self._held_out(split)) // batch_size)
        check_split(split)
        return max(1, len(self.train_rows) // batch_size)

    def _held_out(self, split: Split) -> np.ndarray:
        return self.eval_rows if split == "test" else self.valid_rows

    def rows(self, split: Split, index: int, batch_size: int) -> np.ndarray:
        """Event rows of batch ``index``: valid/test in a fixed order; train reshuffled every epoch by the
        seed."""
        if split in HELD_OUT:
            n = self.num_batches(split, batch_size)
            if not 0 <= index < n:
                raise IndexError(f"{split} batch {index} out of range ({n} batches)")
            return self._held_out(split)[index * batch_size : (index + 1) * batch_size]
        check_split(split)
        per_epoch = self.num_batches("train", batch_size)
        epoch, k = divmod(int(index), per_epoch)
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, 11, epoch]).permutation(len(self.train_rows))
            self._perm_cache = (epoch, perm)
        return self.train_rows[self._perm_cache[1][k * batch_size : (k + 1) * batch_size]]

    def get(self, split: Split, index: int, batch_size: int) -> LoadedBatch:
        return LoadedBatch(self.make_batch(self.rows(split, index, batch_size)), index, None)

    # Building ----------------------------------------------------------------------------------------------

    def make_batch(self, rows: np.ndarray) -> GemBatch:
        """The ``GemBatch`` of event rows ``rows`` [B]."""
        ev, b = self.ev, len(rows)
        u, it = ev.user[rows], ev.item[rows]
        start = ev.user_start[u]
        pos = self.hist_end[rows]
        lo = np.maximum(0, pos - self.cfg.max_len)
        lengths = (pos - lo).astype(np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        owner = np.repeat(np.arange(b), lengths)
        # Event index of every history entry: user start + lo + (rank within this history).
        h = start[owner] + lo[owner] + (np.arange(offsets[-1]) - offsets[owner])
        h_items, h_rating, h_ts = ev.item[h], ev.rating[h], ev.timestamp[h]

        # History statistics (dense features); an empty history gives zeros.
        has = lengths > 0
        like = (h_rating >= self.cfg.like_threshold).astype(np.float64)
        sum_r = np.bincount(owner, weights=h_rating.astype(np.float64), minlength=b)
        sum_like = np.bincount(owner, weights=like, minlength=b)
        mean_r = np.where(has, sum_r / np.maximum(lengths, 1), 3.0)
        like_rate = np.where(has, sum_like / np.maximum(lengths, 1), 0.5)
        last_ts = np.where(has, h_ts[np.maximum(offsets[1:] - 1, 0)] if len(h) else 0, ev.timestamp[rows])
        gap_h = np.maximum(ev.timestamp[rows] - last_ts, 0) / 3600.0
        # Like rate of the user's history on the candidate's genres.
        g_like = np.full(b, 0.5)
        cand_genres = [set(ev.item_genres[i]) for i in it]
        if len(h):
            match = np.fromiter(
                (bool(cand_genres[o] & set(ev.item_genres[x])) for o, x in zip(owner, h_items)),
                dtype=bool,
                count=len(h),
            )
            m_cnt = np.bincount(owner, weights=match.astype(np.float64), minlength=b)
            m_like = np.bincount(owner, weights=match * like, minlength=b)
            g_like = np.where(m_cnt > 0, (m_like + 0.5) / (m_cnt + 1.0), 0.5)
        year = ev.item_year[it]
        dense = np.stack(
            [
                (ev.user_age[u] - 33.0) / 12.0,
                np.where(year > 0, (year - 1988.0) / 15.0, 0.0),
                np.log1p(self.item_pop[it]) / 6.0 - 0.5,
                np.log1p(lengths) / 5.0 - 0.5,
                mean_r - 3.5,
                like_rate - 0.55,
                np.log1p(gap_h) / 8.0,
                g_like - 0.55,
            ],
            axis=1,
        ).astype(np.float32)

        genres = [ev.item_genres[i] or [0] for i in it]
        n_gen = np.array([len(g) for g in genres], np.int64)
        year_bucket = np.where(year > 0, np.clip((year - 1920) // 5, 0, _N_YEAR_BUCKETS - 1), 0)
        age_bucket = np.searchsorted(np.array(_AGE_BUCKETS), ev.user_age[u], side="right")
        ones = np.ones(b, np.int64)
        t = torch.from_numpy
        genre_ids = np.fromiter((x for g in genres for x in g), np.int64, int(n_gen.sum()))
        values = [
            u, ev.user_gender[u], age_bucket, ev.user_occupation[u], ev.user_zip[u], it, genre_ids,
            year_bucket,
        ]  # fmt: skip
        sparse = KeyedJaggedTensor(
            keys=self.spec.sparse_names,
            values=t(np.concatenate(values).astype(np.int64)),
            lengths=t(np.concatenate([ones, ones, ones, ones, ones, ones, n_gen, ones])),
            stride=b,
        )
        history = JaggedSequence(
            offsets=t(offsets.astype(np.int64)),
            max_len=max(int(lengths.max()) if b else 0, 1),
            item_ids=t(h_items.astype(np.int64)),
            action_ids=t(h_rating.astype(np.int64)),
            timestamps=t(h_ts.astype(np.int64)),
            event_features=t(self.item_genre_hot[h_items]) if self.cfg.history_genres else None,
        )
        return GemBatch(
            dense=t(dense),
            sparse=sparse,
            sequences={"history": history},
            request_time=t(ev.timestamp[rows].astype(np.int64)),
            labels=t(self.label[rows][:, None].copy()),
            label_mask=torch.ones(b, 1, dtype=torch.bool),
        )
