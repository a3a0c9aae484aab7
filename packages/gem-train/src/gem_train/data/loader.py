"""Streaming, multi-worker, deterministic and resumable loading of ``GemBatch``es.

A :class:`BatchSource` builds batch ``i`` of a split as a pure function of ``i``. :class:`BatchStream`, an
``IterableDataset``, gives rank ``r`` of ``W`` ranks the global batches ``p + r, p + r + W, ...`` (``p``:
the global batches consumed before, by any number of ranks) and splits those among its DataLoader workers
round-robin (worker ``w`` of ``K`` makes every ``K``-th). The DataLoader
reads workers in round-robin order, so the sequence a rank sees is the same for any number of workers, and
the position of the stream is one integer: the number of global batches consumed. That integer is in every
checkpoint; a resumed stream starts from it (:func:`make_train_loader` with ``position``), on any number of
ranks.

Errors and shutdown (:mod:`gem_train.data.workers`): an exception in a loader worker reaches the main process
as the original exception (type and message, as with ``num_workers = 0``) at the batch it would have made,
after the loader's workers were shut down; an iterator that is closed, used as a context manager, dropped
or still open at interpreter exit shuts its workers down too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gem_model import FeatureSpec, GemBatch
from gem_train.data.split import HELD_OUT, HeldOutSplit, Split, check_split
from gem_train.data.workers import Loader, guarded, worker_init

__all__ = ["BatchSource", "BatchStream", "LoadedBatch", "Loader", "make_eval_loader", "make_train_loader"]


class LoadedBatch:
    """A batch and, for synthetic data, the hidden model's probabilities ``[B, T]`` (else None)."""

    __slots__ = ("batch", "index", "true_probs")

    def __init__(self, batch: GemBatch, index: int, true_probs: np.ndarray | None) -> None:
        self.batch = batch
        self.index = index
        self.true_probs = true_probs

    def pin_memory(self) -> LoadedBatch:
        return LoadedBatch(self.batch.pin_memory(), self.index, self.true_probs)


class BatchSource(Protocol):
    """What a dataset provides to the loader."""

    spec: FeatureSpec

    def get(self, split: Split, index: int, batch_size: int) -> LoadedBatch:
        """Batch ``index`` of ``split`` ("train": any index >= 0, endless; "valid" (validation, for model
        selection) and "test": ``< num_batches``)."""
        ...

    def num_batches(self, split: Split, batch_size: int) -> int | None:
        """Batches in one pass over ``split`` (None: endless; 0 for "valid": no validation split)."""
        ...


class BatchStream(IterableDataset):
    """The batches of one rank from its local position ``start`` on (``stop``: exclusive end of this rank's
    stream); ``offset`` global batches were consumed before (by any number of ranks)."""

    def __init__(
        self,
        source: BatchSource,
        split: Split,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        stop: int | None = None,
        offset: int = 0,
    ) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        self.source, self.split, self.batch_size = source, split, batch_size
        self.rank, self.world_size, self.start, self.stop = rank, world_size, start, stop
        self.offset = offset

    def __iter__(self) -> Iterator[LoadedBatch]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        k = self.start + worker
        while self.stop is None or k < self.stop:
            global_index = self.offset + k * self.world_size + self.rank
            yield self.source.get(self.split, global_index, self.batch_size)
            k += n_workers


def _loader(stream: IterableDataset, num_workers: int, pin: bool) -> Loader:
    return Loader(
        DataLoader(
            guarded(stream) if num_workers > 0 else stream,
            batch_size=None,  # the source makes whole batches
            num_workers=num_workers,
            pin_memory=pin,
            persistent_workers=False,
            prefetch_factor=4 if num_workers > 0 else None,
            # A private generator: creating a DataLoader iterator draws a base seed, which would otherwise
            # come from (and move) the global torch RNG that exact resume restores.
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=worker_init if num_workers > 0 else None,
        )
    )


def _own_stream(
    source: Any, split: str, batch_size: int, rank: int, world_size: int, start: int, max_batches: int,
    num_workers: int, pin: bool,
) -> Loader:  # fmt: skip
    """The loader of a source that makes its own streams (``make_stream``), or the source's wrapper of it
    (``wrap_loader``: it counts what the workers report, e.g. skipped bad rows)."""
    stream = source.make_stream(
        split, batch_size, rank=rank, world_size=world_size, start=start, max_batches=max_batches,
        num_workers=num_workers,
    )  # fmt: skip
    loader = _loader(stream, num_workers, pin)
    wrap = getattr(source, "wrap_loader", None)
    return wrap(loader, split) if wrap is not None else loader


def make_train_loader(
    source: BatchSource,
    batch_size: int,
    *,
    start: int = 0,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
    position: int | None = None,
) -> Loader:
    """The endless training stream of this rank, from this rank's batch ``start`` on; or, with
    ``position`` (global batches consumed so far, by any number of ranks), from that point of the global
    stream: rank ``r``'s ``k``-th batch is then global batch ``position + k * world_size + r``, so a run
    resumed on another world size repeats and skips no batch.

    Iterate it (``LoadedBatch`` es); ``close()`` it, or use it in a ``with`` block, to end its worker
    processes before the stream ends (:mod:`gem_train.data.workers`)."""
    if hasattr(source, "make_stream"):  # a source with its own streams (gem_train.data.parquet)
        # Its position is per rank (its resume check refuses another layout): position // world_size.
        local = start if position is None else position // world_size
        return _own_stream(source, "train", batch_size, rank, world_size, local, 0, num_workers, pin_memory)
    if position is not None:
        stream = BatchStream(source, "train", batch_size, rank, world_size, offset=position)
    else:
        stream = BatchStream(source, "train", batch_size, rank, world_size, start=start)
    return _loader(stream, num_workers, pin_memory)


def make_eval_loader(
    source: BatchSource,
    batch_size: int,
    *,
    max_batches: int = 0,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
    split: HeldOutSplit = "test",
) -> Loader:
    """This rank's share of a held-out split: ``split`` "test" (the default) or "valid" (validation);
    all of it, or the first ``max_batches`` batches. A :class:`~gem_train.data.workers.Loader`, as
    :func:`make_train_loader`'s."""
    check_split(split, HELD_OUT)
    if hasattr(source, "make_stream"):  # a source with its own streams (gem_train.data.parquet)
        return _own_stream(
            source, split, batch_size, rank, world_size, 0, max_batches, num_workers, pin_memory
        )
    total = source.num_batches(split, batch_size)
    if total is None:
        raise ValueError(f"the {split} split must be finite")
    if max_batches:
        total = min(total, max_batches)
    # Rank r takes global batches r, r + W, ...: per-rank count = ceil((total - r) / W).
    per_rank = max(0, -(-(total - rank) // world_size))
    stream = BatchStream(source, split, batch_size, rank, world_size, start=0, stop=per_rank)
    return _loader(stream, num_workers, pin_memory)
