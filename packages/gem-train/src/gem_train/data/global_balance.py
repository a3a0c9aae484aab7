"""``parallel.balancer = "global"``: every training step's samples rebalanced across the ranks by
:class:`gem_parallel.balance.GlobalBalancer` (all-gather of per-sample costs, equal-size Karmarkar-Karp with
swaps, all-to-all of the samples). Communication at every step, on every rank.

Each rank reads its ordinary batch (global batch ``k * W + r`` at step ``k``), the ranks agree on a
partition of the ``W * data.batch_size`` samples into ``W`` sets of ``data.batch_size`` (every rank computes
the same one from the gathered costs, ``get_cost_model("mix")`` of the sum of each sample's behaviour-sequence
lengths), and set ``s`` is moved to rank ``s``: received samples come ordered by source rank, then by their
row on the source. Nothing is held back, so the stream's position is the ordinary one (global batches read):
checkpoints need nothing more, resume is exact on the same world size, and on another one no sample is
repeated or skipped. The exchange runs on the host, over a gloo group when the default one is NCCL.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import GemBatch, JaggedSequence
from gem_train.data.balance import sample_lengths
from gem_train.data.loader import LoadedBatch

__all__ = ["GlobalBalancedStream", "exchange_batch", "partition_batches"]


def _seq(bal: Any, plan: Any, s: JaggedSequence, max_len: int) -> JaggedSequence:
    # The three value tensors of a sequence (int64) travel as the columns of one [total, 3] tensor.
    values = torch.stack([s.item_ids, s.action_ids, s.timestamps], dim=1)
    got, lengths = bal.exchange_jagged(plan, values, s.lengths)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    features = None
    if s.event_features is not None:
        # Float [total, F] rows: a second exchange of the same plan and lengths, so row i still belongs to
        # event i (every rank has them or none: they follow the shared spec).
        features, _ = bal.exchange_jagged(plan, s.event_features, s.lengths)
    return JaggedSequence(offsets, max_len, got[:, 0].clone(), got[:, 1].clone(), got[:, 2].clone(), features)


def exchange_batch(bal: Any, plan: Any, batch: GemBatch) -> GemBatch:
    """Collective: ``batch``'s samples moved as ``plan`` (a ``GlobalBalancer.plan`` of its lengths) says.

    ``max_len`` of each sequence becomes the largest over the ranks (one all-reduce), as joining the ranks'
    batches would make it.
    """
    keys = batch.sparse.keys()
    values, lengths = [], []
    for key in keys:
        jt = batch.sparse[key]
        v, n = bal.exchange_jagged(plan, jt.values(), jt.lengths())
        values.append(v)
        lengths.append(n)
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values) if values else batch.sparse.values()[:0],
        lengths=torch.cat(lengths) if lengths else batch.sparse.lengths()[:0],
        stride=plan.n_received,
    )
    names = list(batch.sequences)
    max_len = torch.tensor([batch.sequences[k].max_len for k in names], dtype=torch.int64)
    if names:
        dist.all_reduce(max_len, op=dist.ReduceOp.MAX, group=bal.group)
    return GemBatch(
        dense=bal.exchange(plan, batch.dense),
        sparse=sparse,
        sequences={k: _seq(bal, plan, batch.sequences[k], int(m)) for k, m in zip(names, max_len.tolist())},
        request_time=bal.exchange(plan, batch.request_time),
        labels=bal.exchange(plan, batch.labels),
        label_mask=bal.exchange(plan, batch.label_mask),
    )


class GlobalBalancedStream:
    """This rank's training batches, each rebalanced with the other ranks' (collective per batch).

    Args:
        loader: this rank's ordinary training stream (``LoadedBatch``es, ``make_train_loader``).
        pin: pin the exchanged batches (new tensors, no longer the loader's pinned ones).

    ``plans`` keeps the last few :class:`gem_parallel.balance.ExchangePlan` (``cost_before`` /
    ``cost_after`` of every rank), for logging and tests.
    """

    def __init__(self, loader: Iterable[LoadedBatch], *, pin: bool = False) -> None:
        from gem_parallel.balance import GlobalBalancer

        # The exchange is on host tensors: NCCL cannot move them, gloo can.
        group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.balancer = GlobalBalancer("mix", group=group)
        self.loader, self.pin = loader, pin
        self.plans: list[Any] = []

    def __iter__(self) -> Iterator[LoadedBatch]:
        for lb in self.loader:
            plan = self.balancer.plan(sample_lengths(lb.batch))
            self.plans = [*self.plans[-7:], plan]
            batch = exchange_batch(self.balancer, plan, lb.batch)
            probs = None
            if lb.true_probs is not None:
                rows = torch.from_numpy(np.ascontiguousarray(lb.true_probs, dtype=np.float64))
                probs = self.balancer.exchange(plan, rows).numpy()
            out = LoadedBatch(batch, lb.index, probs)
            yield out.pin_memory() if self.pin else out


def partition_batches(batches: list[GemBatch]) -> list[Tensor]:
    """One process's view of a global step: the rows (of the ranks' batches joined in rank order) that
    each rank trains after the exchange, as :class:`GlobalBalancer` computes them (the reference)."""
    from gem_parallel.balance import get_cost_model, karmarkar_karp, refine_partition
    from gem_parallel.balance.cost import total_lengths

    world, cost = len(batches), get_cost_model("mix")
    costs = torch.cat([cost.sample_costs(total_lengths(sample_lengths(b))) for b in batches])
    part = refine_partition(costs, karmarkar_karp(costs, world), world)
    return [torch.nonzero(part == s).flatten() for s in range(world)]
