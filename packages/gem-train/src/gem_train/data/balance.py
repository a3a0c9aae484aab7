"""``parallel.balancer = "base_batch_shuffling"``: this rank's training batches rebuilt by
:class:`gem_parallel.balance.BaseBatchShuffler` so that each one's cost is close to the mean.

The rank's ordinary training stream (batches of ``data.batch_size``) is read as the shuffler's sub-batches
(``sub_batch_size = data.batch_size``, ``sub_batches_per_batch = 1``): a training batch keeps
``data.batch_size`` samples, drawn from a pool of :data:`POOL_BATCHES` batches by the cost of each sample
(``get_cost_model("mix")`` of the sum of its behaviour-sequence lengths). Every sample of the stream is
trained on exactly once. The shuffler's state is in every checkpoint (``trainer_state["balancer"]``), with
``base``: the global batch at which the balanced stream began, so a resume re-reads the same stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import GemBatch, JaggedSequence
from gem_train.data.loader import LoadedBatch

__all__ = ["POOL_BATCHES", "BalancedTrainStream", "concat_batches", "sample_lengths"]

POOL_BATCHES = 4  # pool of the shuffler, in training batches (gem_parallel.balance's default)


def sample_lengths(batch: GemBatch) -> Tensor:
    """``[B, S]`` int64: the length of each of the S behaviour sequences of each sample."""
    if not batch.sequences:
        return torch.zeros(batch.batch_size, 0, dtype=torch.int64)
    return torch.stack([s.lengths.cpu() for s in batch.sequences.values()], dim=1)


def _concat_seq(seqs: list[JaggedSequence]) -> JaggedSequence:
    lengths = torch.cat([s.lengths for s in seqs])
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    return JaggedSequence(
        offsets,
        max(s.max_len for s in seqs),
        torch.cat([s.item_ids for s in seqs]),
        torch.cat([s.action_ids for s in seqs]),
        torch.cat([s.timestamps for s in seqs]),
    )


def concat_batches(batches: list[GemBatch]) -> GemBatch:
    """The samples of ``batches`` one after the other (same features in each)."""
    if len(batches) == 1:
        return batches[0]
    keys = batches[0].sparse.keys()
    values, lengths = [], []
    for key in keys:
        for b in batches:
            jt = b.sparse[key]
            values.append(jt.values())
            lengths.append(jt.lengths())
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values) if values else batches[0].sparse.values()[:0],
        lengths=torch.cat(lengths) if lengths else batches[0].sparse.lengths()[:0],
        stride=sum(b.batch_size for b in batches),
    )
    return GemBatch(
        dense=torch.cat([b.dense for b in batches]),
        sparse=sparse,
        sequences={k: _concat_seq([b.sequences[k] for b in batches]) for k in batches[0].sequences},
        request_time=torch.cat([b.request_time for b in batches]),
        labels=torch.cat([b.labels for b in batches]),
        label_mask=torch.cat([b.label_mask for b in batches]),
    )


def collate(subs: list[LoadedBatch], index: list[tuple[int, int]]) -> LoadedBatch:
    """The shuffler's collate: sample ``j`` of ``subs[i]`` for each ``(i, j)`` of ``index``, in order."""
    starts = np.cumsum([0] + [s.batch.batch_size for s in subs])
    rows = [int(starts[i]) + j for i, j in index]
    batch = concat_batches([s.batch for s in subs]).select(rows)
    probs = None
    if all(s.true_probs is not None for s in subs):
        probs = np.concatenate([s.true_probs for s in subs])[rows]
    return LoadedBatch(batch, -1, probs)


class BalancedTrainStream:
    """This rank's balanced training batches (``LoadedBatch``; ``index``: the emitted batch's ordinal).

    Args:
        open_stream: ``open_stream(base)`` -> this rank's ordinary training stream from global batch
            ``base`` on (``make_train_loader(position=base)``).
        base: the global batch at which the balanced stream begins.
        world_size: ranks reading the stream (rank ``r``'s sub-batch ``k`` is global batch
            ``base + k * world_size + r``).
        batch_size, seed: ``data.batch_size`` and the run's seed (per rank: the caller adds the rank).
        pin: pin the emitted batches (they are new tensors, no longer the loader's pinned ones).
    """

    def __init__(
        self, open_stream: Callable[[int], Any], *, base: int, world_size: int, batch_size: int, seed: int,
        pin: bool = False,
    ) -> None:  # fmt: skip
        from gem_parallel.balance import BaseBatchShuffler

        self.base, self.world_size, self.pin = base, world_size, pin
        self.shuffler: BaseBatchShuffler[LoadedBatch, LoadedBatch] = BaseBatchShuffler(
            lambda start: open_stream(base + start * world_size),
            cost="mix",
            lengths=lambda lb: sample_lengths(lb.batch),
            collate=collate,
            sub_batch_size=batch_size,
            sub_batches_per_batch=1,
            pool_batches=POOL_BATCHES,
            seed=seed,
        )
        self._states: dict[int, dict[str, Any]] = {}
        self._emitted = 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues the stream of a checkpoint's :meth:`state_after` (same ``base`` and world size)."""
        self.shuffler.load_state_dict(state)
        self._emitted = int(state["emitted"])

    def state_after(self, index: int) -> dict[str, Any]:
        """The shuffler's state right after batch ``index`` was emitted (read ahead batches are not in it:
        the device prefetcher holds one). Drops the states of earlier batches."""
        for k in [k for k in list(self._states) if k < index]:  # list(): the prefetch thread adds
            del self._states[k]
        return self._states[index]

    def __iter__(self) -> Iterator[LoadedBatch]:
        while (lb := self.shuffler.next_batch()) is not None:
            lb.index = self._emitted
            self._states[self._emitted] = self.shuffler.state_dict()
            self._emitted += 1
            yield lb.pin_memory() if self.pin else lb
