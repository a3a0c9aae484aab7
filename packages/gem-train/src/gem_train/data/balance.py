"""``parallel.balancer = "base_batch_shuffling"``: this rank's training batches rebuilt by
:class:`gem_parallel.balance.BaseBatchShuffler` so that each one's cost is close to the mean.

The rank's ordinary training stream (batches of ``data.batch_size``) is read as the shuffler's sub-batches
(``sub_batch_size = data.batch_size``, ``sub_batches_per_batch = 1``): a training batch keeps
``data.batch_size`` samples, drawn from a pool of ``default_pool_batches(data.batch_size)`` batches (4, and at
least 256 samples) by the cost of each sample (``get_cost_model("mix")`` of the sum of its behaviour-sequence
lengths) with the shuffler's :data:`POLICY`: each batch aimed at the *level* (the expected cost of a sample
times the batch size), never more than ``headroom`` (2%) above it; what a heavy stretch of the stream
brings beyond that waits in the pool (at most 16 pool sizes of batches). Every sample of the stream is
trained on exactly once. A checkpoint of the earlier ``"sliding"`` policy resumes with that
policy (its state names it). The shuffler's state is in every checkpoint (``trainer_state["balancer"]``), with
``base``: the global batch at which the balanced stream began, so a resume re-reads the same stream.

A rank's sub-batches are its *carry* first (samples named by ``(global batch, row)``, in chunks of
``data.batch_size``), then the plain stream: rank ``r``'s ``k``-th plain sub-batch is global batch
``base + k * world_size + r``. A fresh run has no carry. On a resume with another world size,
:func:`reshard_balancer` turns the checkpointed ranks' pools (and any global batch below the furthest rank's
read position that some rank had not read) into the new ranks' carry and restarts the plain stream at the
first global batch no rank had read: every sample is trained exactly once across the resume. What is not
carried: each shuffler's running mean cost and its per-rank seed, so the batches are composed differently
from a run that kept its world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import GemBatch, JaggedSequence
from gem_train.data.loader import LoadedBatch

__all__ = [
    "CALIBRATION_BATCH",
    "CALIBRATION_SAMPLES",
    "POLICY",
    "BalancedTrainStream",
    "balanced_stream",
    "calibration_batches",
    "common_level",
    "concat_batches",
    "reshard_balancer",
    "sample_lengths",
]

Sample = tuple[int, int]  # (global batch index, row in it)

POLICY = "capped"  # gem_parallel.balance's default: the heaviest rank bounded by the cap (issue 38)
# The common level's calibration sample. Its error, ~ CV / sqrt(K), is common to all ranks; what matters is
# that it stays inside the capped policy's window, about -1% .. +0.7% at headroom 0.02: a level too low puts
# the caps at the true mean and the pools clog over long runs; one high by e lifts every rank to ~(1 +
# headroom)(1 + e). At K = 2**20 the error's std is 0.23% / 0.27% (the log-normal / Zipf streams of issue 38,
# CV 2.4 / 2.9): ~4 std from the low edge, ~3 from the high one (gem-parallel's BENCHMARKS.md, "A common level
# without communication": the sweep over K and over a level off by a known factor).
CALIBRATION_SAMPLES = 1_048_576  # parallel.balancer_calibration's default
CALIBRATION_BATCH = 1_024  # rows per read of the calibration sample (transient host memory)


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
        _concat_event_features(seqs),
    )


def _concat_event_features(seqs: list[JaggedSequence]) -> Tensor | None:
    feats = [s.event_features for s in seqs]
    if all(f is None for f in feats):
        return None
    if any(f is None for f in feats):
        raise ValueError("concat_batches: some sequences carry event_features and others do not")
    return torch.cat([f for f in feats if f is not None])


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


def calibration_batches(source: Any, samples: int, read_batch: int) -> list[int]:
    """The global training batches (of ``read_batch`` rows) of the calibration sample: ``ceil(samples /
    read_batch)`` of them, spread evenly over one pass of the training split when the source has passes
    (``num_batches``; the first rows alone would miss a drift of the lengths along the split, e.g. histories
    growing with time), else the first ones. A function of the source's size alone: the same on every rank."""
    n = math.ceil(samples / read_batch)
    total = source.num_batches("train", read_batch)
    stride = max(1, int(total) // n) if total else 1
    return [k * stride for k in range(n)]


def common_level(
    source: Any, samples: int = CALIBRATION_SAMPLES, read_batch: int = CALIBRATION_BATCH
) -> float:
    """The expected cost of a sample, every rank alike: the mean ``get_cost_model("mix")`` cost of
    ``samples`` rows of ``source``'s training split, the first rows of the global batches
    :func:`calibration_batches` names (``source.get("train", k, read_batch)``). A function of the source
    alone (no rank, no world size, no seed), summed exactly (:func:`gem_parallel.balance.calibration_level`):
    bit-identical on every rank. Cost: reading ``samples`` rows once, before the first batch."""
    from gem_parallel.balance import calibration_level

    if samples < 1 or read_batch < 1:
        raise ValueError(f"common_level: samples and read_batch must be >= 1, got {samples}, {read_batch}")
    lengths = [sample_lengths(source.get("train", k, read_batch).batch)
               for k in calibration_batches(source, samples, read_batch)]  # fmt: skip
    return calibration_level("mix", torch.cat(lengths)[:samples])


class BalancedTrainStream:
    """This rank's balanced training batches (``LoadedBatch``; ``index``: the emitted batch's ordinal).

    Args:
        open_stream: ``open_stream(position)`` -> this rank's ordinary training stream from global batch
            ``position`` on (``make_train_loader(position=position)``).
        base: the global batch at which the plain part of the balanced stream begins.
        world_size: ranks reading the stream (rank ``r``'s plain sub-batch ``k`` is global batch
            ``base + k * world_size + r``).
        batch_size, seed: ``data.batch_size`` and the shuffler's seed (per rank: see :func:`balanced_stream`).
        policy: the shuffler's policy (:data:`POLICY`; a resumed stream keeps its checkpoint's).
        mean_cost: the level (the shuffler's ``mean_cost``: :func:`common_level`, the same on every rank);
            None: each rank's running mean (a checkpoint of an older gem-train).
        pin: pin the emitted batches (they are new tensors, no longer the loader's pinned ones).
        carry: ``(global batch, row)`` samples read before the plain stream, ``batch_size`` per sub-batch.
        fetch: ``fetch(global_batch)`` -> that training batch (needed with a ``carry``).
    """

    def __init__(
        self, open_stream: Callable[[int], Any], *, base: int, world_size: int, batch_size: int, seed: int,
        pin: bool = False, carry: Sequence[Sample] = (), fetch: Callable[[int], LoadedBatch] | None = None,
        policy: str = POLICY, mean_cost: float | None = None,
    ) -> None:  # fmt: skip
        from gem_parallel.balance import BaseBatchShuffler

        if carry and fetch is None:
            raise ValueError("BalancedTrainStream: a carry needs fetch")
        self.base, self.world_size, self.pin = base, world_size, pin
        self.batch_size = batch_size
        self.carry = [(int(b), int(r)) for b, r in carry]
        self.n_carry = -(-len(self.carry) // batch_size)  # carry sub-batches
        self._fetch = fetch
        self._open = open_stream
        self.shuffler: BaseBatchShuffler[LoadedBatch, LoadedBatch] = BaseBatchShuffler(
            self._sub_batches,
            cost="mix",
            lengths=lambda lb: sample_lengths(lb.batch),
            collate=collate,
            sub_batch_size=batch_size,
            sub_batches_per_batch=1,
            seed=seed,
            policy=policy,
            mean_cost=mean_cost,
        )
        self._states: dict[int, dict[str, Any]] = {}
        self._emitted = 0

    def _carry_batch(self, ordinal: int) -> LoadedBatch:
        """Carry sub-batch ``ordinal``: its samples, fetched from their global batches, in carry order."""
        assert self._fetch is not None
        rows = self.carry[ordinal * self.batch_size : (ordinal + 1) * self.batch_size]
        where: dict[int, int] = {}
        subs: list[LoadedBatch] = []
        for b, _ in rows:
            if b not in where:
                where[b] = len(subs)
                subs.append(self._fetch(b))
        return collate(subs, [(where[b], r) for b, r in rows])

    def _sub_batches(self, start: int) -> Iterator[LoadedBatch]:
        """The shuffler's source: sub-batches from ordinal ``start`` on (carry, then the plain stream)."""
        for o in range(start, self.n_carry):
            yield self._carry_batch(o)
        yield from self._open(self.base + max(0, start - self.n_carry) * self.world_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues the stream of a checkpoint's :meth:`state_after` (same ``base``, world size, carry)."""
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


def balanced_stream(
    source: Any, *, rank: int, world_size: int, batch_size: int, seed: int, base: int = 0,
    carry: Sequence[Sample] = (), num_workers: int = 0, pin: bool = False, policy: str = POLICY,
    mean_cost: float | None = None,
) -> BalancedTrainStream:  # fmt: skip
    """Rank ``rank``'s balanced stream of ``source`` (a ``BatchSource``): the trainer's and the one-process
    reference's (``benchmarks/one_process_reference.py``). ``seed``: the run's; each rank's shuffler gets its
    own. ``mean_cost``: the level, :func:`common_level` of ``source`` in the trainer (None: each rank's
    running mean)."""
    from gem_train.data.loader import make_train_loader

    def open_stream(position: int) -> Any:
        return make_train_loader(
            source, batch_size, position=position, rank=rank, world_size=world_size,
            num_workers=num_workers,
        )  # fmt: skip

    return BalancedTrainStream(
        open_stream, base=base, world_size=world_size, batch_size=batch_size, seed=seed + 7_919 * rank,
        pin=pin, carry=carry, fetch=lambda b: source.get("train", b, batch_size), policy=policy,
        mean_cost=mean_cost,
    )  # fmt: skip


def reshard_balancer(saved: dict[str, Any], world_size: int) -> tuple[int, list[list[Sample]]]:
    """The balanced stream of a checkpoint (``trainer_state["balancer"]``) laid out for ``world_size``
    ranks: ``(base, carry of each new rank)``.

    The carry is every sample the checkpointed ranks had read but not trained (their shufflers' pools and
    planned batches, as of the last trained step), plus every sample of a global batch below the new
    ``base`` that some rank had not read yet; sorted by ``(global batch, row)`` and dealt out in contiguous,
    near-equal parts. The new ``base`` is the first global batch of the plain stream no rank had read.
    """
    old_world, base = int(saved["world_size"]), int(saved["base"])
    bs = int(saved["batch_size"])
    carries = saved.get("carry") or [[] for _ in range(old_world)]
    left: list[Sample] = []
    plain_read = []
    for r, state in enumerate(saved["ranks"]):
        carry = [(int(b), int(i)) for b, i in carries[r]]
        n_carry = -(-len(carry) // bs)

        def ident(o: int, i: int, r: int = r, carry: list[Sample] = carry, n_carry: int = n_carry) -> Sample:
            return carry[o * bs + i] if o < n_carry else (base + (o - n_carry) * old_world + r, i)

        read = 0 if state is None else int(state["next_ordinal"])
        if state is not None:
            pool = zip(state["pool"]["ordinal"], state["pool"]["index"], strict=True)
            left += [ident(int(o), int(i)) for o, i in pool]
            left += [ident(int(o), int(i)) for b in state["pending"] for o, i in b]
        left += carry[read * bs :]  # carry sub-batches not read yet
        plain_read.append(max(0, read - n_carry))
    furthest = max(plain_read)
    for r, k0 in enumerate(plain_read):  # plain batches below the furthest read position, unread by r
        left += [(base + k * old_world + r, j) for k in range(k0, furthest) for j in range(bs)]
    left.sort()
    if len(set(left)) != len(left):
        raise ValueError("the checkpoint's balancer state names a sample twice (a corrupt state)")
    n = len(left)
    parts = [left[q * n // world_size : (q + 1) * n // world_size] for q in range(world_size)]
    return base + furthest * old_world, parts
