"""The Parquet dataset as a gem-train batch source: streaming, sharded, shuffled, deterministic, resumable.

**Streaming (``shuffle = "buffer"`` or ``"none"``).** The rows of a split are the rows of its files in
order, row group by row group. Each epoch ``e`` lays the row groups out in a new order (a permutation drawn
from ``(seed, e)``; file order with ``"none"``), and the ``S = world_size x max(1, num_workers)`` loader
shards take contiguous, disjoint ranges of that row space: shard ``s`` the rows
``[floor(s N / S), floor((s + 1) N / S))``, so every row is read exactly once per epoch and shard sizes
differ by at most one row. A shard reads its range in windows of ``shuffle_buffer`` rows (only the row
groups it needs, one at a time), permutes each window (drawn from ``(seed, e, s, window)``) and cuts it into
batches; a batch may span two windows or two epochs. Memory: one window, one decoded row group, one batch.

Shard ``s = rank x K + k`` is DataLoader worker ``k`` of rank ``rank``; the DataLoader takes the workers'
batches in turn, so rank batch ``i`` is batch ``i // K`` of worker ``i % K``. The stream's position is
therefore the number of batches the rank has consumed (the trainer's step, in every checkpoint): a resumed
stream starts each worker at its own next batch by arithmetic (row counts come from the footers), without
reading what came before. The position means the same only for the same world size and number of workers;
a resume that changes them is refused (:meth:`ParquetSource.check_resume`).

**Exact order (``shuffle = "global"``).** Every split is read into memory once and train batch ``i`` is a
pure function of ``i``: epoch ``e = i // (N // B)`` draws one permutation of all ``N`` rows from
``numpy.random.default_rng([seed, 11, e])``, exactly as the built-in MovieLens loader does, so a table
exported from it gives the very same batches. For tables that fit in memory.

**Held-out splits** are read in file order (no shuffle): batch ``j`` holds rows ``[j B, (j + 1) B)``. Ranks
take contiguous ranges of batches, and their workers contiguous ranges of those.

Bad rows (:mod:`.convert`): ``on_bad_row = "error"`` stops at the first, naming file, row group and row;
``"skip"`` leaves them out of their batch (which is then smaller; positions do not move) and counts them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import IterableDataset, get_worker_info

from gem_model import FeatureSpec
from gem_train.config.parquet import ParquetConfig
from gem_train.data.loader import BatchStream, LoadedBatch
from gem_train.data.parquet.convert import Block, Converter, Provenance
from gem_train.data.parquet.errors import ParquetDataError, where
from gem_train.data.parquet.schema import SPLITS, ParquetLayout, SplitFiles, resolve_root, split_files
from gem_train.data.split import Split
from gem_train.data.workers import Loader

__all__ = ["CountingLoader", "ParquetBatch", "ParquetSource", "ParquetStream"]


class ParquetBatch(LoadedBatch):
    """A loaded batch plus the bad rows left out of it (``on_bad_row = "skip"``) and the first reason, and
    the values of the ``data.parquet.keys`` columns of its rows (column -> ``[B]``; empty without keys)."""

    __slots__ = ("bad_reason", "bad_rows", "keys")

    def __init__(
        self, lb: LoadedBatch, bad_rows: int, bad_reason: str = "", keys: dict[str, np.ndarray] | None = None
    ) -> None:
        super().__init__(lb.batch, lb.index, lb.true_probs)
        self.bad_rows, self.bad_reason = bad_rows, bad_reason
        self.keys = keys or {}

    def pin_memory(self) -> ParquetBatch:
        return ParquetBatch(super().pin_memory(), self.bad_rows, self.bad_reason, self.keys)


class _Reader:
    """Reads row ranges of one split's ordered row space as Arrow tables (footers only until asked)."""

    def __init__(self, files: SplitFiles, columns: list[str]) -> None:
        self.files, self.columns = files, columns
        self._open: dict[int, pq.ParquetFile] = {}
        self._cached: tuple[int, pa.Table] | None = None  # (group, table): a group split by two windows
        self._schema: pa.Schema | None = None

    def group(self, g: int) -> pa.Table:
        if self._cached is not None and self._cached[0] == g:
            return self._cached[1]
        f, idx = int(self.files.group_file[g]), int(self.files.group_index[g])
        path = self.files.paths[f]
        if f not in self._open:
            self._open = {f: pq.ParquetFile(path)}  # one file open at a time
        try:
            # One thread: loader workers are processes already; Arrow's threads would oversubscribe the cores.
            table = self._open[f].read_row_group(idx, columns=self.columns, use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise ParquetDataError(f"cannot read ({e})", path, idx) from e
        if table.num_rows != self.files.physical_rows(g):
            raise ParquetDataError(
                f"{table.num_rows} rows, its footer said {self.files.physical_rows(g)}", path, idx
            )
        if self.files.keep is not None:  # this split's rows of the group (e.g. the training rows by time)
            table = table.take(pa.array(self.files.keep[g]))
        if self._schema is None:
            self._schema = table.schema
        elif table.schema != self._schema:
            try:
                table = table.cast(self._schema)
            except (pa.ArrowException, ValueError) as e:
                raise ParquetDataError(f"columns differ from the split's first file ({e})", path, idx) from e
        self._cached = (g, table)
        return table

    def physical_row(self, g: int, lo: int, hi: int) -> np.ndarray:
        """``[hi - lo]`` int64: the rows within row group ``g`` (as in its file) of the group's rows
        ``[lo, hi)`` of this split (they differ when the split selects rows: error messages name the
        file's row)."""
        if self.files.keep is None:
            return np.arange(lo, hi, dtype=np.int64)
        return self.files.keep[g][lo:hi]

    def rows(self, order: np.ndarray, cum: np.ndarray, a: int, b: int) -> tuple[pa.Table, Provenance]:
        """Rows ``[a, b)`` of the row space that lays the groups out in ``order`` (``cum``: its
        ``[G+1]`` cumulative row counts)."""
        first = int(np.searchsorted(cum, a, side="right")) - 1
        parts, pf, pg, pr = [], [], [], []
        i = first
        while i < len(order) and cum[i] < b:
            g = int(order[i])
            lo, hi = max(a - int(cum[i]), 0), min(b, int(cum[i + 1])) - int(cum[i])
            t = self.group(g)
            parts.append(t.slice(lo, hi - lo))
            pf.append(np.full(hi - lo, self.files.group_file[g], np.int64))
            pg.append(np.full(hi - lo, self.files.group_index[g], np.int64))
            pr.append(self.physical_row(g, lo, hi))
            i += 1
        table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        return table, Provenance(np.concatenate(pf), np.concatenate(pg), np.concatenate(pr))


class ParquetStream(IterableDataset):
    """One rank's batches of a streamed split (an ``IterableDataset`` for the DataLoader)."""

    def __init__(
        self,
        source: ParquetSource,
        split: Split,
        batch_size: int,
        rank: int,
        world_size: int,
        start: int = 0,
        max_batches: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        self.source, self.split, self.batch_size = source, split, batch_size
        self.rank, self.world_size, self.start, self.max_batches = rank, world_size, start, max_batches
        self.num_workers = max(1, num_workers)

    def __iter__(self) -> Iterator[ParquetBatch]:
        info = get_worker_info()
        worker, k = (0, 1) if info is None else (info.id, info.num_workers)
        if k != self.num_workers:
            raise RuntimeError(f"the stream was planned for {self.num_workers} workers, the loader has {k}")
        if self.split == "train":
            # After a resume at rank batch `start`, the DataLoader begins with its worker 0: that worker plays
            # the shard that owns rank batch `start` (see the module docstring).
            logical = (self.start + worker) % k
            local_start = (self.start - logical + k - 1) // k if self.start > logical else 0
            yield from self.source._train_batches(
                self.rank * k + logical, self.world_size * k, self.batch_size, local_start
            )
        else:
            yield from self.source._held_out_batches(
                self.split, self.batch_size, self.rank, self.world_size, worker, k, self.max_batches
            )


class CountingLoader(Loader):
    """A :class:`~gem_train.data.workers.Loader` of :class:`ParquetBatch` es that sums, in the main process,
    the bad rows the workers left out (``source.bad_rows[split]``) and reports them on stderr as they come."""

    def __init__(self, loader: Loader, source: ParquetSource, split: str) -> None:
        super().__init__(loader.dataloader)
        self.source, self.split = source, split

    def on_item(self, item: Any) -> None:
        n = getattr(item, "bad_rows", 0)
        if n:
            self.source.bad_rows[self.split] = self.source.bad_rows.get(self.split, 0) + n
            print(
                f"gem-train: data.on_bad_row = 'skip': left {n} bad row(s) out of a {self.split} batch "
                f"({self.source.bad_rows[self.split]} so far on this rank), e.g. "
                f"{getattr(item, 'bad_reason', '')}",
                file=sys.stderr,
            )


class ParquetSource:
    """A ``[data.parquet]`` dataset: a :class:`~gem_train.data.loader.BatchSource` with its own streams.

    Args:
        cfg: the section. seed: the run's seed (shuffles). Only footers are read here (and, with
        ``shuffle = "global"``, the splits themselves).
    Raises:
        ParquetDataError: missing files, unreadable footers, missing or mistyped columns, empty files.
        ConfigError: a declaration that cannot be a feature spec.
    """

    def __init__(self, cfg: ParquetConfig, seed: int = 0) -> None:
        cfg.validate(required=True)
        self.cfg, self.seed = cfg, int(seed)
        self.layout = ParquetLayout.from_config(cfg)
        self.root = resolve_root(cfg.root)
        try:
            self.spec: FeatureSpec = self.layout.spec()
        except ValueError as e:
            from gem_train.config import ConfigError

            raise ConfigError(f"data.parquet: {e}") from e
        self.converter = Converter(self.layout, self.spec, self.root)
        self.columns = self.layout.columns()
        self.files: dict[str, SplitFiles | None] = {}
        for split, key in SPLITS.items():
            patterns = getattr(cfg, key)
            self.files[split] = split_files(self.layout, patterns, self.root, key) if patterns else None
        self.valid_note = self._validation_split()
        self.bad_rows: dict[str, int] = {}
        self._memory: dict[str, Block] = {}
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def _validation_split(self) -> str:
        """With no valid files, cut the latest ``valid_fraction`` of the training rows off as the validation
        split (:mod:`.time_split`); returns the sentence that says where the validation split comes from."""
        valid, train = self.files["valid"], self.files["train"]
        if valid is not None:
            return (
                f"validation split: data.parquet.valid, {valid.num_rows:,} rows in {len(valid.paths)} file(s)"
            )
        from gem_train.data.parquet.time_split import split_by_time

        cut = split_by_time(train, self.layout, self.cfg.valid_fraction) if train is not None else None
        if cut is None:
            why = "= 0" if not self.cfg.valid_fraction else "cuts nothing from a 1-row training split"
            return f"no validation split: data.parquet.valid is empty and data.parquet.valid_fraction {why}"
        self.files["train"], self.files["valid"] = cut.train, cut.valid
        return cut.note

    # -- BatchSource --------------------------------------------------------------------------------------

    def rows(self, split: str) -> int:
        files = self.files.get(split)
        return files.num_rows if files is not None else 0

    def num_batches(self, split: Split, batch_size: int) -> int:
        """Held-out splits: ``ceil(rows / B)`` (0: no such split); train: ``max(1, rows // B)`` per epoch."""
        if split not in SPLITS:
            raise ValueError(f"split must be 'train', 'valid' or 'test', got {split!r}")
        n = self.rows(split)
        return max(1, n // batch_size) if split == "train" else -(-n // batch_size)

    def get(self, split: Split, index: int, batch_size: int) -> LoadedBatch:
        """Batch ``index`` by random access (the whole split in memory; ``shuffle = "global"`` order for
        train, file order for held-out splits)."""
        block = self._in_memory(split)
        if split == "train":
            per_epoch = self.num_batches("train", batch_size)
            epoch, k = divmod(int(index), per_epoch)
            if self._perm_cache is None or self._perm_cache[0] != epoch:
                perm = np.random.default_rng([self.seed, 11, epoch]).permutation(block.n)
                self._perm_cache = (epoch, perm)
            rows = self._perm_cache[1][k * batch_size : (k + 1) * batch_size]
        else:
            n = self.num_batches(split, batch_size)
            if not 0 <= index < n:
                raise IndexError(f"{split} batch {index} out of range ({n} batches)")
            rows = np.arange(index * batch_size, min((index + 1) * batch_size, block.n))
        part = block.take(rows)
        return self._loaded(part, 0, part.n, index, split)

    # -- loader hooks (gem_train.data.loader) -------------------------------------------------------------

    def make_stream(
        self, split: Split, batch_size: int, *, rank: int, world_size: int, start: int, max_batches: int,
        num_workers: int,
    ) -> IterableDataset:  # fmt: skip
        """The stream of one rank for the DataLoader (``split``: "train", "valid" or "test")."""
        if self.cfg.shuffle == "global":
            if split == "train":
                return BatchStream(self, split, batch_size, rank, world_size, start=start)
            total = self.num_batches(split, batch_size)
            total = min(total, max_batches) if max_batches else total
            per_rank = max(0, -(-(total - rank) // world_size))
            return BatchStream(self, split, batch_size, rank, world_size, start=0, stop=per_rank)
        return ParquetStream(self, split, batch_size, rank, world_size, start, max_batches, num_workers)

    def wrap_loader(self, loader: Loader, split: str) -> CountingLoader:
        return CountingLoader(loader, self, split)

    def stream_state(self, world_size: int, num_workers: int) -> dict[str, Any]:
        """What a resumed stream needs to be the same stream (saved in the checkpoint)."""
        return {"format": "parquet", "shuffle": self.cfg.shuffle, "world_size": world_size,
                "num_workers": max(1, num_workers), "train_rows": self.rows("train")}  # fmt: skip

    def data_identity(self) -> dict[str, Any]:
        """Every split's files (resolved paths, sizes, rows, footer digests), the vocabulary files and the
        columns read: :func:`gem_train.data.parquet.identity.parquet_identity`."""
        from gem_train.data.parquet.identity import parquet_identity

        return parquet_identity(self)

    def check_resume(
        self, state: dict[str, Any], world_size: int, num_workers: int, new_train_data: bool = False
    ) -> None:
        """Refuse to resume a streamed position under a different layout (it would be another stream).
        ``new_train_data``: the training files differ by an allowed change (``--allow-change``), so their
        row count may too (the stream then goes on at the same position over the new rows).

        Raises:
            ConfigError: world size, number of workers or the training rows differ from the checkpoint's.
        """
        saved = state.get("data_stream")
        if not isinstance(saved, dict) or self.cfg.shuffle == "global":
            return  # random access: the position is one batch index whatever the layout
        now = self.stream_state(world_size, num_workers)
        skip = {"train_rows"} if new_train_data else set()
        diff = [
            f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k] and k not in skip
        ]
        if diff:
            from gem_train.config import ConfigError

            raise ConfigError(
                "data.parquet: the checkpoint's stream position is only valid for the same layout; "
                f"resume with the same ranks and data.num_workers ({'; '.join(diff)})"
            )

    # -- streaming ------------------------------------------------------------------------------------------

    def _order(self, files: SplitFiles, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        g = len(files.group_rows)
        if self.cfg.shuffle == "buffer":
            order = np.random.default_rng([self.seed, 19, epoch]).permutation(g)
        else:
            order = np.arange(g)
        cum = np.zeros(g + 1, np.int64)
        np.cumsum(files.group_rows[order], out=cum[1:])
        return order, cum

    def _train_batches(
        self, shard: int, shards: int, batch_size: int, local_start: int
    ) -> Iterator[ParquetBatch]:
        files = self.files["train"]
        assert files is not None  # train files are required
        n = files.num_rows
        lo_s, hi_s = shard * n // shards, (shard + 1) * n // shards
        size = hi_s - lo_s
        if size == 0:
            raise ParquetDataError(
                f"the training split has {n} rows, fewer than ranks x loader workers = {shards}: some would "
                "get no data",
                files.paths[0],
            )
        reader = _Reader(files, self.columns)
        w = self.cfg.shuffle_buffer
        pos = local_start * batch_size
        epoch, off = divmod(pos, size)
        index = local_start
        pending: Block | None = None  # fewer than batch_size rows carried into the next window
        while True:
            order, cum = self._order(files, epoch)
            window = off // w
            while window * w < size:
                a, b = lo_s + window * w, lo_s + min((window + 1) * w, size)
                table, prov = reader.rows(order, cum, a, b)
                block = self._block(table, prov, "train")  # checked and converted in file order
                if self.cfg.shuffle == "buffer":
                    block = block.take(
                        np.random.default_rng([self.seed, 23, epoch, shard, window]).permutation(b - a)
                    )
                if off > window * w:  # resuming inside this window
                    block = block.slice(off - window * w, block.n)
                lo = 0
                if pending is not None:  # the batch spanning the previous window (or epoch) and this one
                    lo = min(batch_size - pending.n, block.n)
                    pending = Block.concat(pending, block.slice(0, lo))
                    if pending.n == batch_size:
                        yield self._loaded(pending, 0, batch_size, index, "train")
                        index, pending = index + 1, None
                full = lo + (block.n - lo) // batch_size * batch_size
                for j in range(lo, full, batch_size):
                    yield self._loaded(block, j, j + batch_size, index, "train")
                    index += 1
                if full < block.n:
                    pending = (
                        block.slice(full, block.n)
                        if pending is None
                        else Block.concat(pending, block.slice(full, block.n))
                    )
                off = 0
                window += 1
            epoch += 1

    def _held_out_batches(
        self,
        split: Split,
        batch_size: int,
        rank: int,
        world: int,
        worker: int,
        workers: int,
        max_batches: int,
    ) -> Iterator[ParquetBatch]:
        if self.files.get(split) is None:
            return
        total = self.num_batches(split, batch_size)
        total = min(total, max_batches) if max_batches else total
        r_lo, r_hi = rank * total // world, (rank + 1) * total // world
        m = r_hi - r_lo
        b_lo, b_hi = r_lo + worker * m // workers, r_lo + (worker + 1) * m // workers
        yield from self.file_order_batches(split, batch_size, b_lo, b_hi)

    def file_order_batches(
        self, split: Split, batch_size: int, b_lo: int, b_hi: int
    ) -> Iterator[ParquetBatch]:
        """Batches ``[b_lo, b_hi)`` of ``split`` in file order (batch ``j``: rows ``[j B, (j + 1) B)``, the
        last may be short), whatever ``shuffle`` says: how held-out splits are read, and how
        ``gem-train predict`` reads any split."""
        files = self.files.get(split)
        if files is None or b_lo >= b_hi:
            return
        n = files.num_rows
        reader = _Reader(files, self.columns)
        order, cum = self._order_in_file(files)
        w = max(self.cfg.shuffle_buffer // batch_size, 1)  # batches per window
        for first in range(b_lo, b_hi, w):
            last = min(first + w, b_hi)
            a, b = first * batch_size, min(last * batch_size, n)
            table, prov = reader.rows(order, cum, a, b)
            block = self._block(table, prov, split)
            for j in range(first, last):
                lo = (j - first) * batch_size
                yield self._loaded(block, lo, min(lo + batch_size, block.n), j, split)

    @staticmethod
    def _order_in_file(files: SplitFiles) -> tuple[np.ndarray, np.ndarray]:
        g = len(files.group_rows)
        cum = np.zeros(g + 1, np.int64)
        np.cumsum(files.group_rows, out=cum[1:])
        return np.arange(g), cum

    # -- helpers --------------------------------------------------------------------------------------------

    def _block(self, table: pa.Table, prov: Provenance, split: str) -> Block:
        files = self.files[split]
        assert files is not None
        return self.converter.block(table, prov, files.paths)

    def _loaded(self, block: Block, lo: int, hi: int, index: int, split: str) -> ParquetBatch:
        batch, n_bad = self.converter.batch(block, lo, hi)
        reason = ""
        if n_bad:
            files = self.files[split]
            assert files is not None
            i = lo + int(np.flatnonzero(block.bad[lo:hi])[0])
            path, g, r = (
                files.paths[int(block.prov.file[i])],
                int(block.prov.row_group[i]),
                int(block.prov.row[i]),
            )
            reason = f"{where(path, g, r)}: {block.reasons.get(i, 'bad row')}"
            if batch.batch_size == 0:
                raise ParquetDataError(
                    f"every row of {split} batch {index} is bad, e.g. this one: {block.reasons.get(i, '')}",
                    path,
                    g,
                    r,
                )
        return ParquetBatch(LoadedBatch(batch, index, None), n_bad, reason, block.key_rows(lo, hi))

    def _in_memory(self, split: str) -> Block:
        """The whole split, checked and converted once (``shuffle = "global"``)."""
        if split not in self._memory:
            files = self.files.get(split)
            if files is None:
                raise ValueError(f"no {split} split (data.parquet.{SPLITS[split]} is empty)")
            reader = _Reader(files, self.columns)
            order, cum = self._order_in_file(files)
            table, prov = reader.rows(order, cum, 0, files.num_rows)
            self._memory[split] = self._block(table, prov, split)
        return self._memory[split]
