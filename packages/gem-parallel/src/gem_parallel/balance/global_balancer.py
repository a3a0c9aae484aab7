"""Global load balancing, as NVIDIA recsys-examples does it: all-gather per-sample costs, partition them into
equal-size sets (Karmarkar–Karp, then swaps), move samples with an all-to-all. Communication every step;
the comparison point for :class:`~gem_parallel.balance.BaseBatchShuffler`.

Every rank computes the same partition from the same gathered costs (the partition is deterministic), so
the plan itself needs no further communication; set ``s`` goes to rank ``s`` of the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gem_parallel.balance.cost import CostModel, get_cost_model, total_lengths
from gem_parallel.balance.partition import karmarkar_karp, part_sums, refine_partition

__all__ = ["ExchangePlan", "GlobalBalancer"]


@dataclass
class ExchangePlan:
    """Where this rank's samples go and what it receives.

    Attributes:
        send_index: ``[n_local]`` int64 local sample indices in send order (grouped by destination rank).
        send_counts: samples sent to each rank (``world`` ints).
        recv_counts: samples received from each rank (``world`` ints); received samples come ordered by
            source rank, then by their index on the source.
        cost_before: ``[world]`` float64 cost of each rank's samples before the exchange.
        cost_after: ``[world]`` float64 after it.
    """

    send_index: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    cost_before: torch.Tensor
    cost_after: torch.Tensor

    @property
    def n_received(self) -> int:
        return sum(self.recv_counts)


class GlobalBalancer:
    """Balances the samples of one step across the ranks of ``group``.

    Args:
        cost: a cost model or its name (see :func:`~gem_parallel.balance.cost.get_cost_model`).
        group: the process group (default: the world).
        refine: run :func:`~gem_parallel.balance.partition.refine_partition` after Karmarkar–Karp
            (recsys-examples stops at KK; on heavy tails the swaps matter, see BENCHMARKS.md).
    """

    def __init__(self, cost: CostModel | str, *, group: dist.ProcessGroup | None = None, refine: bool = True):
        self.cost = get_cost_model(cost)
        self.group = group
        self.refine = refine

    def plan(self, lengths: Any) -> ExchangePlan:
        """Collective: gathers every rank's per-sample costs and computes the exchange.

        Args:
            lengths: ``[n_local]`` or ``[n_local, S]`` per-sample lengths of this rank's samples.

        Raises:
            ValueError: on every rank, when some rank's lengths are invalid or the total number of samples
                is not a multiple of the world size (equal-size sets).
        """
        world = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        try:
            costs = self.cost.sample_costs(total_lengths(lengths))
            error = ""
        except (ValueError, TypeError) as e:
            costs, error = torch.zeros(0, dtype=torch.float64), str(e)
        # -1 announces a bad input, so that every rank raises instead of some waiting in a collective.
        size = torch.tensor([costs.numel() if not error else -1], dtype=torch.int64)
        sizes_l = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes_l, size, group=self.group)
        sizes = torch.cat(sizes_l)
        bad = torch.nonzero(sizes < 0).flatten().tolist()
        if bad:
            raise ValueError(
                f"GlobalBalancer.plan: invalid lengths on rank(s) {bad}" + (f": {error}" if error else "")
            )
        total = int(sizes.sum())
        if total % world:
            raise ValueError(f"GlobalBalancer.plan: {total} samples in all cannot form {world} equal sets")
        width = max(int(sizes.max()), 1)
        padded = torch.cat([costs, costs.new_zeros(width - costs.numel())])
        gathered = [torch.zeros(width, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.group)
        all_costs = torch.cat([g[: int(n)] for g, n in zip(gathered, sizes.tolist(), strict=True)])
        src = torch.repeat_interleave(torch.arange(world), sizes)
        part = karmarkar_karp(all_costs, world)
        if self.refine:
            part = refine_partition(all_costs, part, world)
        start = int(sizes[:me].sum())
        dest = part[start : start + int(sizes[me])]
        send_index = torch.sort(dest, stable=True).indices
        send_counts = torch.bincount(dest, minlength=world).tolist()
        recv_counts = torch.bincount(src[part == me], minlength=world).tolist()
        return ExchangePlan(send_index, send_counts, recv_counts,
                            part_sums(all_costs, src, world), part_sums(all_costs, part, world))  # fmt: skip

    def exchange(self, plan: ExchangePlan, rows: torch.Tensor) -> torch.Tensor:
        """Collective: moves ``rows`` (``[n_local, ...]``, one row per sample) as ``plan`` says.

        Returns ``[plan.n_received, ...]``, same dtype. Bool tensors travel as uint8 (gloo has no bool).
        """
        if rows.shape[0] != plan.send_index.numel():
            raise ValueError(
                f"GlobalBalancer.exchange: {rows.shape[0]} rows for {plan.send_index.numel()} samples"
            )
        as_bool = rows.dtype == torch.bool
        send = rows.index_select(0, plan.send_index).contiguous()
        if as_bool:
            send = send.to(torch.uint8)
        out = send.new_empty((plan.n_received, *rows.shape[1:]))
        dist.all_to_all_single(out, send, plan.recv_counts, plan.send_counts, group=self.group)
        return out.bool() if as_bool else out

    def exchange_jagged(
        self, plan: ExchangePlan, values: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: moves a jagged tensor (sample ``b`` owns ``lengths[b]`` consecutive rows).

        Args:
            values: ``[total, ...]``; lengths: ``[n_local]`` int64.

        Returns:
            ``(values, lengths)`` of the received samples, in the order of :meth:`exchange`.
        """
        lengths = lengths.to(torch.int64)
        if lengths.numel() != plan.send_index.numel() or int(lengths.sum()) != values.shape[0]:
            raise ValueError(
                "GlobalBalancer.exchange_jagged: need one length per sample, summing to values.shape[0]"
                f"; got {lengths.numel()} lengths summing to {int(lengths.sum())} for {values.shape[0]} rows"
            )
        new_lengths = self.exchange(plan, lengths)
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        sl = lengths.index_select(0, plan.send_index)
        starts = offsets[:-1].index_select(0, plan.send_index)
        send_offsets = torch.cat([sl.new_zeros(1), torch.cumsum(sl, 0)])
        rows = torch.repeat_interleave(starts - send_offsets[:-1], sl) + torch.arange(int(sl.sum()))
        send = values.index_select(0, rows).contiguous()
        bounds = torch.tensor([0, *plan.send_counts]).cumsum(0)
        send_rows = [int(sl[bounds[r] : bounds[r + 1]].sum()) for r in range(len(plan.send_counts))]
        rbounds = torch.tensor([0, *plan.recv_counts]).cumsum(0)
        recv_rows = [
            int(new_lengths[rbounds[r] : rbounds[r + 1]].sum()) for r in range(len(plan.recv_counts))
        ]
        out = send.new_empty((sum(recv_rows), *values.shape[1:]))
        dist.all_to_all_single(out, send, recv_rows, send_rows, group=self.group)
        return out, new_lengths
