"""Base Batch Shuffling: every rank balances its own training batches, with no communication.

A rank's reader yields small sub-batches (nominally ``sub_batch_size`` samples). The shuffler keeps a pool
of about ``pool_batches`` training batches of them and builds each training batch of
``sub_batch_size * sub_batches_per_batch`` samples so that its cost comes close to the expected cost of a
batch. Every rank reads the same distribution, so every rank's batch lands near the same cost and the
heaviest rank is close to the mean, without any rank knowing about the others. Policies (``policy=``, see
:mod:`gem_parallel.balance.policies`):

- ``"capped"`` (default): one batch at a time from a pool refilled after each batch. The level is the
  expected cost of a sample (``mean_cost`` if given, else the rank's running mean); the batch aims at the
  level times the batch size plus ``feedback`` times the pool's excess over the level (so the pool absorbs
  this rank's sampling noise but cannot drift), but never more than ``1 + headroom`` times the level: what
  the stream brings beyond that waits in the pool and drains by up to ``headroom`` per batch. Samples that
  have waited ``soft_wait`` batches are taken first, oldest first, while they fit under the target; none
  waits more than ``max_wait``.
- ``"sliding"``: the same without the cap (the earlier default). A sample waits at most ``max_wait`` batches.
- ``"snake"``, ``"lpt"``, ``"pair"``, ``"random"``: the whole pool is split into ``pool_batches`` batches at
  once (serpentine over the sorted pool, longest-first greedy, heaviest paired with lightest, no balancing).

Guarantees: every sample of the source is emitted exactly once (a final partial pool too: the last batches
may be smaller); the order inside a batch is random; the stream is a function of the source and ``seed``;
``state_dict()`` / ``load_state_dict()`` resume it exactly, also in the middle of a pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

from gem_parallel.balance.cost import CostModel, get_cost_model, total_lengths
from gem_parallel.balance.policies import (
    POOL_POLICIES,
    capped_target,
    plan_pool,
    sliding_select,
    take_overdue,
)

__all__ = ["MIN_POOL_SAMPLES", "POLICIES", "BaseBatchShuffler", "default_pool_batches"]

POLICIES = ("capped", "sliding", *POOL_POLICIES)
ONE_AT_A_TIME = ("capped", "sliding")
# A capped pool holds the excess of heavy stretches (~ CV**2 / (2 * headroom) mean sample costs, whatever the
# batch size) and still needs light samples to complete batches around it: below ~256 samples it clogs
# (BENCHMARKS.md, "Load balancing where it is hard": 32-sample batches, 4 batches 1.075, 8 batches 1.029).
MIN_POOL_SAMPLES = 256


def default_pool_batches(batch_size: int) -> int:
    """Pool size in batches: 4, and at least :data:`MIN_POOL_SAMPLES` samples."""
    return max(4, -(-MIN_POOL_SAMPLES // batch_size))


_STATE_VERSION = 1
SubBatch = TypeVar("SubBatch")
Batch = TypeVar("Batch")


def _default_lengths(sub_batch: Any) -> list[int]:
    return [len(sample) for sample in sub_batch]


def _default_collate(sub_batches: list[Any], index: list[tuple[int, int]]) -> list[Any]:
    return [sub_batches[i][j] for i, j in index]


class BaseBatchShuffler(Generic[SubBatch, Batch]):
    """Builds cost-balanced training batches out of a rank's stream of sub-batches.

    Args:
        source: the rank's sub-batches, in order: an iterable, or a callable ``source(start)`` returning an
            iterable of the sub-batches from ordinal ``start`` on (lets a resume skip without re-reading).
            A resumed shuffler must be given the same stream.
        cost: a :class:`~gem_parallel.balance.cost.CostModel` or its name (``"linear"``, ``"attention"``,
            ``"mix"``, a path to a fitted JSON).
        lengths: ``lengths(sub_batch)`` -> per-sample lengths ``[n]`` or ``[n, S]`` (S sequences, summed).
            Default: ``len(sample)`` of each sample of a sub-batch that is a sequence of samples.
        collate: ``collate(sub_batches, index)`` -> a batch, where ``index`` lists ``(i, j)``: sample ``j``
            of ``sub_batches[i]``, in batch order. Default: the list of those samples.
        sub_batch_size: nominal samples per sub-batch.
        sub_batches_per_batch: training batch = ``sub_batch_size * sub_batches_per_batch`` samples.
        pool_batches: pool size in training batches; default :func:`default_pool_batches` (4, more for
            batches under 64 samples: at least 256 samples).
        seed: seeds the order inside each batch (and the ``"random"`` policy).
        policy: one of :data:`POLICIES`.
        headroom: (capped) the most a batch is aimed above the level, as a share of it (> 0). Smaller
            balances better and holds more in the pool (BENCHMARKS.md, "Load balancing where it is hard").
        feedback: (capped, sliding) share of the pool's excess cost shed per batch; smaller balances better,
            larger keeps the pool closer to its mean. 0 < feedback <= 1.
        max_wait: (capped, sliding) batches a sample may wait; default ``16 * pool_batches`` (capped),
            ``8 * pool_batches`` (sliding).
        soft_wait: (capped) batches after which a sample is taken first while it fits; default
            ``4 * pool_batches``.
        mean_cost: (capped, sliding) the expected cost per sample, the same on every rank: e.g.
            :func:`~gem_parallel.balance.calibration_level` of one calibration sample every rank reads alike
            (no communication; its error moves every rank's cap alike); default: the running mean of the
            samples this rank has read, whose rank-to-rank spread (~ CV / sqrt(samples read)) is what limits
            balance early on.
    """

    def __init__(
        self,
        source: Iterable[SubBatch] | Callable[[int], Iterable[SubBatch]],
        *,
        cost: CostModel | str,
        lengths: Callable[[SubBatch], Any] | None = None,
        collate: Callable[[list[SubBatch], list[tuple[int, int]]], Batch] | None = None,
        sub_batch_size: int = 128,
        sub_batches_per_batch: int = 8,
        pool_batches: int | None = None,
        seed: int = 0,
        policy: str = "capped",
        headroom: float = 0.02,
        feedback: float = 0.01,
        max_wait: int | None = None,
        soft_wait: int | None = None,
        mean_cost: float | None = None,
    ) -> None:
        for name, v in (("sub_batch_size", sub_batch_size), ("sub_batches_per_batch", sub_batches_per_batch)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"BaseBatchShuffler: {name} must be an int >= 1, got {v!r}")
        if pool_batches is None:
            pool_batches = default_pool_batches(sub_batch_size * sub_batches_per_batch)
        if not isinstance(pool_batches, int) or pool_batches < 1:
            raise ValueError(f"BaseBatchShuffler: pool_batches must be an int >= 1, got {pool_batches!r}")
        if policy not in POLICIES:
            raise ValueError(f"BaseBatchShuffler: unknown policy {policy!r}; choose from {POLICIES}")
        if not 0 < feedback <= 1:
            raise ValueError(f"BaseBatchShuffler: feedback must be in (0, 1], got {feedback}")
        if not (headroom > 0 and math.isfinite(headroom)):
            raise ValueError(f"BaseBatchShuffler: headroom must be a finite number > 0, got {headroom}")
        if max_wait is None:  # capped: overdue samples leave early, so the hard bound is rarely reached
            max_wait = (16 if policy == "capped" else 8) * pool_batches
        soft_wait = 4 * pool_batches if soft_wait is None else soft_wait
        for name, v in (("max_wait", max_wait), ("soft_wait", soft_wait)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"BaseBatchShuffler: {name} must be an int >= 0, got {v!r}")
        if mean_cost is not None and not (math.isfinite(mean_cost) and mean_cost >= 0):
            raise ValueError(f"BaseBatchShuffler: mean_cost must be a finite number >= 0, got {mean_cost}")
        self.source = source
        self.cost = get_cost_model(cost)
        self.lengths = lengths or _default_lengths
        self.collate: Callable[[list[Any], list[tuple[int, int]]], Any] = collate or _default_collate
        self.batch_size = sub_batch_size * sub_batches_per_batch
        self.pool_batches = pool_batches
        self.pool_capacity = pool_batches * self.batch_size
        self.seed = int(seed)
        self.policy = policy
        self.headroom = float(headroom)
        self.feedback = float(feedback)
        self.max_wait = max_wait
        self.soft_wait = soft_wait
        self.mean_cost = mean_cost
        self._reset()

    # -- state ------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._it: Iterator[SubBatch] | None = None
        self._next_ordinal = 0  # next sub-batch to read
        self._exhausted = False
        self._emitted = 0
        self._seen_sum = 0.0
        self._seen_n = 0
        self._live: dict[int, SubBatch] = {}  # sub-batches with samples not yet emitted
        self._left: dict[int, int] = {}  # samples of each live sub-batch not yet emitted
        self._p_ord = torch.zeros(0, dtype=torch.int64)  # pool: sub-batch ordinal,
        self._p_idx = torch.zeros(0, dtype=torch.int64)  # sample index in it,
        self._p_age = torch.zeros(0, dtype=torch.int64)  # batches waited,
        self._p_cost = torch.zeros(0, dtype=torch.float64)  # cost
        self._pending: list[list[tuple[int, int]]] = []  # planned batches (pool policies)

    def state_dict(self) -> dict[str, Any]:
        """Plain data (ints, floats, strings, lists): where the stream is, what the pool holds, what is
        planned. Sub-batches themselves are not stored: a resume re-reads them from the source."""
        return {
            "version": _STATE_VERSION,
            "policy": self.policy,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "next_ordinal": self._next_ordinal,
            "exhausted": self._exhausted,
            "emitted": self._emitted,
            "seen_sum": self._seen_sum,
            "seen_n": self._seen_n,
            "pool": {
                "ordinal": self._p_ord.tolist(),
                "index": self._p_idx.tolist(),
                "age": self._p_age.tolist(),
            },
            "pending": [[[o, i] for o, i in b] for b in self._pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`; iteration then continues the interrupted stream exactly."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"BaseBatchShuffler state: expected version {_STATE_VERSION}, got {got}")
        for key, mine in (("policy", self.policy), ("seed", self.seed), ("batch_size", self.batch_size)):
            if state[key] != mine:
                raise ValueError(
                    f"BaseBatchShuffler state: {key} {state[key]!r} differs from this shuffler's {mine!r}"
                )
        self._reset()
        pool_ord = torch.tensor(state["pool"]["ordinal"], dtype=torch.int64)
        pool_idx = torch.tensor(state["pool"]["index"], dtype=torch.int64)
        pending = [[(int(o), int(i)) for o, i in b] for b in state["pending"]]
        needed = set(pool_ord.tolist()) | {o for b in pending for o, _ in b}
        next_ordinal = int(state["next_ordinal"])
        if needed:  # re-read the sub-batches that still hold samples
            start = min(needed)
            it = self._open(start)
            costs: dict[int, torch.Tensor] = {}
            for ordinal in range(start, next_ordinal):
                try:
                    sb = next(it)
                except StopIteration:
                    raise ValueError(
                        f"BaseBatchShuffler state: the source ended at sub-batch {ordinal}, before "
                        f"{next_ordinal} (not the stream that was saved)"
                    ) from None
                if ordinal in needed:
                    self._live[ordinal] = sb
                    costs[ordinal] = self.cost.sample_costs(total_lengths(self.lengths(sb)))
            self._it = it
            for ordinal in needed:
                n_left = int((pool_ord == ordinal).sum()) + sum(o == ordinal for b in pending for o, _ in b)
                self._left[ordinal] = n_left
            pool_costs = [
                float(costs[o][i]) for o, i in zip(pool_ord.tolist(), pool_idx.tolist(), strict=True)
            ]
            self._p_cost = torch.tensor(pool_costs, dtype=torch.float64)
        self._p_ord, self._p_idx = pool_ord, pool_idx
        self._p_age = torch.tensor(state["pool"]["age"], dtype=torch.int64)
        self._pending = pending
        self._next_ordinal = next_ordinal
        self._exhausted = bool(state["exhausted"])
        self._emitted = int(state["emitted"])
        self._seen_sum = float(state["seen_sum"])
        self._seen_n = int(state["seen_n"])

    # -- reading ----------------------------------------------------------------------------------------

    def _open(self, start: int) -> Iterator[SubBatch]:
        if callable(self.source) and not isinstance(self.source, Iterable):
            return iter(self.source(start))
        it = iter(self.source)
        for _ in range(start):  # a plain iterable: re-read and drop what was fully emitted
            next(it)
        return it

    def _read_one(self) -> bool:
        if self._exhausted:
            return False
        if self._it is None:
            self._it = self._open(self._next_ordinal)
        try:
            sb = next(self._it)
        except StopIteration:
            self._exhausted = True
            return False
        costs = self.cost.sample_costs(total_lengths(self.lengths(sb)))
        n = costs.numel()
        ordinal = self._next_ordinal
        self._next_ordinal += 1
        if n == 0:
            return True
        self._live[ordinal] = sb
        self._left[ordinal] = n
        self._p_ord = torch.cat([self._p_ord, torch.full((n,), ordinal, dtype=torch.int64)])
        self._p_idx = torch.cat([self._p_idx, torch.arange(n)])
        self._p_age = torch.cat([self._p_age, torch.zeros(n, dtype=torch.int64)])
        self._p_cost = torch.cat([self._p_cost, costs])
        self._seen_sum += float(costs.sum())
        self._seen_n += n
        return True

    def _fill(self) -> None:
        while self._p_ord.numel() < self.pool_capacity and self._read_one():
            pass

    # -- building batches --------------------------------------------------------------------------------

    def _take(self, mask: torch.Tensor) -> list[tuple[int, int]]:
        picks = list(zip(self._p_ord[mask].tolist(), self._p_idx[mask].tolist(), strict=True))
        keep = ~mask
        self._p_ord, self._p_idx = self._p_ord[keep], self._p_idx[keep]
        self._p_age, self._p_cost = self._p_age[keep], self._p_cost[keep]
        return picks

    def _plan_one(self) -> list[tuple[int, int]] | None:
        """The next batch of a one-at-a-time policy (``"capped"``, ``"sliding"``)."""
        self._fill()
        n = self._p_ord.numel()
        if n == 0:
            return None
        if n <= self.batch_size:  # the source is done: the rest is the last batch
            return self._take(torch.ones(n, dtype=torch.bool))
        mu = self.mean_cost if self.mean_cost is not None else self._seen_sum / max(self._seen_n, 1)
        level = torch.tensor([mu], dtype=torch.float64)
        excess = self._p_cost.sum()[None] - n * level
        costs, age, valid = self._p_cost[None], self._p_age[None], torch.ones((1, n), dtype=torch.bool)
        forced = age >= self.max_wait
        if self.policy == "capped":
            target = capped_target(level, excess, self.batch_size, self.headroom, self.feedback)
            forced = take_overdue(costs, valid, forced, age, self.batch_size, target, self.soft_wait)
        else:
            target = self.batch_size * level + self.feedback * excess
        mask = sliding_select(costs, valid, forced, self.batch_size, target)[0]
        picks = self._take(mask)
        self._p_age += 1
        return picks

    def _plan_pool(self) -> None:
        self._fill()
        n = min(self._p_ord.numel(), self.pool_capacity)
        if n == 0:
            return
        m = -(-n // self.batch_size)
        per = -(-n // m)
        if self.policy == "pair":
            per += per % 2
        # Zero-cost dummies fill a short final pool up to m equal batches; they are dropped below.
        padded = torch.cat([self._p_cost[:n], torch.zeros(m * per - n, dtype=torch.float64)])
        gen = torch.Generator().manual_seed(self._batch_seed(-1 - self._emitted))
        labels = plan_pool(padded[None], m, self.policy, gen)[0][:n]
        head = torch.zeros(self._p_ord.numel(), dtype=torch.bool)
        head[:n] = True
        ords, idxs = self._p_ord[:n].tolist(), self._p_idx[:n].tolist()
        self._take(head)
        batches: list[list[tuple[int, int]]] = [[] for _ in range(m)]
        for o, i, lab in zip(ords, idxs, labels.tolist(), strict=True):
            batches[lab].append((o, i))
        self._pending = [b for b in batches if b]

    def _batch_seed(self, k: int) -> int:
        return (self.seed * 0x9E3779B97F4A7C15 + k * 0xBF58476D1CE4E5B9) % (2**63 - 1)

    def _emit(self, picks: list[tuple[int, int]]) -> Batch:
        gen = torch.Generator().manual_seed(self._batch_seed(self._emitted))
        order = torch.randperm(len(picks), generator=gen).tolist()  # order inside a batch stays random
        picks = [picks[k] for k in order]
        self._emitted += 1
        pos: dict[int, int] = {}
        subs: list[SubBatch] = []
        index = []
        for o, i in picks:
            if o not in pos:
                pos[o] = len(subs)
                subs.append(self._live[o])
            index.append((pos[o], i))
        batch: Batch = self.collate(subs, index)
        for o, _ in picks:
            self._left[o] -= 1
            if self._left[o] == 0:
                del self._left[o], self._live[o]
        return batch

    def next_batch(self) -> Batch | None:
        """The next training batch, or None once every sample has been emitted."""
        if self.policy in ONE_AT_A_TIME:
            picks = self._plan_one()
            return None if picks is None else self._emit(picks)
        if not self._pending:
            self._plan_pool()
        if not self._pending:
            return None
        return self._emit(self._pending.pop(0))

    def __iter__(self) -> Iterator[Batch]:
        while (batch := self.next_batch()) is not None:
            yield batch

    def batch_costs(self, lengths: Sequence[Any]) -> list[float]:
        """Cost of batches given their lengths (``[n]`` / ``[n, S]`` each), step constant included."""
        return [
            float(self.cost.sample_costs(total_lengths(x)).sum()) + self.cost.step_constant for x in lengths
        ]
