"""Equal-size k-way partition by Karmarkar–Karp largest differencing (the balanced variant).

Items sorted by cost are cut into chunks of k consecutive items; each chunk is a partial solution of k
one-item sets. The two partial solutions with the largest spread (max set sum - min set sum) are merged
repeatedly, the heaviest set of one joined with the lightest of the other, until one solution is left:
k sets of equal size whose sums are close. O(n log n) for the sort plus O((n/k) log(n/k) + n log k) for the
merges. With heavy-tailed costs the chunking is the weak point (each set takes exactly one item of every
chunk, so the set holding the heaviest item cannot shed it): :func:`refine_partition` then swaps items between
the heaviest and lightest sets. Every step is deterministic (stable sorts, a counter breaking heap ties), so
every rank that runs it on the same costs gets the same partition.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

__all__ = ["karmarkar_karp", "part_sums", "refine_partition"]


def karmarkar_karp(costs: Any, k: int) -> torch.Tensor:
    """Partitions n items into k sets of equal size with near-equal cost sums.

    Args:
        costs: ``[n]`` item costs (float; converted to float64), finite.
        k: number of sets, >= 1.

    Returns:
        ``[n]`` int64 set index in ``[0, k)`` per item. Set sizes are ``n // k`` or ``n // k + 1`` (exactly
        ``n / k`` when k divides n). Sets are numbered by increasing cost sum.
    """
    c = torch.as_tensor(costs, dtype=torch.float64).flatten()
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"karmarkar_karp: k must be an int >= 1, got {k!r}")
    if c.numel() and not bool(torch.isfinite(c).all()):
        raise ValueError("karmarkar_karp: costs hold NaN or inf")
    n = c.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    if k == 1:
        return torch.zeros(n, dtype=torch.int64)
    # Pad with zero-cost dummies to a multiple of k: they sort last, at most one per set.
    n_pad = -n % k
    padded = torch.cat([c, c.new_zeros(n_pad)])
    order = torch.sort(padded, descending=True, stable=True).indices  # [n + n_pad]
    n_chunks = order.numel() // k
    # Leaf c holds items order[c*k:(c+1)*k] (descending); its slots are its sums in ascending order.
    leaf_items = order.view(n_chunks, k).flip(1)  # [n_chunks, k], ascending cost within a chunk
    leaf_sums = torch.index_select(padded, 0, leaf_items.flatten()).view(n_chunks, k)

    sums: list[torch.Tensor] = list(leaf_sums.unbind(0))
    parent: list[int] = [-1] * n_chunks
    perm: list[torch.Tensor | None] = [None] * n_chunks
    heap = [(-float(s[-1] - s[0]), i, i) for i, s in enumerate(sums)]
    heapq.heapify(heap)
    counter = n_chunks
    # Tensor __getitem__ with an index tensor costs ~16 ms on the CPU (torch 2.13) against ~10 us for
    # index_select / scatter_: the loops below use only the latter.
    slots = torch.arange(k)
    while len(heap) > 1:
        _, _, ia = heapq.heappop(heap)
        _, _, ib = heapq.heappop(heap)
        raw = sums[ia] + sums[ib].flip(0)  # A's lightest set joins B's heaviest, and so on
        o = torch.sort(raw, stable=True).indices
        inv = torch.empty_like(o).scatter_(0, o, slots)
        new = len(sums)
        sums.append(torch.index_select(raw, 0, o))
        parent.append(-1)
        perm.append(None)
        parent[ia], perm[ia] = new, inv  # A's slot s -> new slot inv[s]
        parent[ib], perm[ib] = new, inv.flip(0)  # B's slot k-1-s joined A's slot s
        heapq.heappush(heap, (-float(sums[new][-1] - sums[new][0]), counter, new))
        counter += 1
    # Compose slot maps from the root down (a parent is always created after its children).
    final: list[torch.Tensor] = [slots] * len(sums)
    for s in range(len(sums) - 2, -1, -1):
        p, pm = parent[s], perm[s]
        assert p >= 0 and pm is not None
        final[s] = torch.index_select(final[p], 0, pm)
    leaf_final = torch.stack(final[:n_chunks])  # [n_chunks, k]
    part = torch.empty(n + n_pad, dtype=torch.int64)
    part.scatter_(0, leaf_items.flatten(), leaf_final.flatten())
    return part[:n]


def part_sums(costs: Any, part: torch.Tensor, k: int) -> torch.Tensor:
    """``[k]`` float64 cost sum of each set of ``part`` (``[n]`` int64 in ``[0, k)``)."""
    c = torch.as_tensor(costs, dtype=torch.float64).flatten()
    return torch.zeros(k, dtype=torch.float64).index_add_(0, part, c)


def refine_partition(
    costs: Any, part: torch.Tensor, k: int, *, rounds: int = 32, pairs: int = 64
) -> torch.Tensor:
    """Improves an equal-size partition by swaps that keep every set's size.

    Each round pairs the ``pairs`` heaviest sets with the as many lightest (heaviest with lightest) and, in
    every pair at once, swaps the one item of the heavy set for the one of the light set that brings the two
    sums closest together (x - y nearest half the gap; found by binary search in the light set's sorted
    costs). Rounds stop when no swap lowers a pair's larger sum, or after ``rounds``. Sizes never change.

    Args:
        costs: ``[n]`` item costs.
        part: ``[n]`` int64 set per item, as :func:`karmarkar_karp` returns (sizes n // k or n // k + 1).
        k: number of sets.

    Returns:
        ``[n]`` int64 refined set per item (a new tensor).
    """
    c = torch.as_tensor(costs, dtype=torch.float64).flatten()
    part = part.clone()
    n = c.numel()
    if k < 2 or n < 2:
        return part
    m = -(-n // k)
    n_pad = m * k - n
    sizes = torch.bincount(part, minlength=k)
    if int(sizes.max()) > m or int(sizes.min()) < m - 1:
        raise ValueError(
            f"refine_partition: set sizes must be n // k or n // k + 1, got {sizes.min()}..{sizes.max()}"
        )
    # Dummies (cost 0, never moved) top up the short sets so that every set is one row of an [k, m] matrix.
    short = torch.nonzero(sizes < m).flatten()
    cost_all = torch.cat([c, c.new_zeros(n_pad)])
    part_all = torch.cat([part, short])
    dummy = torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(n_pad, dtype=torch.bool)])
    t = min(pairs, k // 2)
    members = torch.sort(part_all, stable=True).indices.view(k, m)  # [k, m] item ids per set
    vals = cost_all[members]
    moved = torch.where(dummy[members], float("nan"), vals)  # NaN: a dummy, never swapped
    sums = vals.sum(1)
    for _ in range(rounds):
        by_sum = torch.sort(sums, descending=True, stable=True).indices
        heavy, light = by_sum[:t], by_sum[-t:].flip(0)
        gap = sums[heavy] - sums[light]  # [t] >= 0
        hv = moved[heavy]  # [t, m] candidates x
        lv, lorder = torch.sort(torch.nan_to_num(moved[light], nan=float("inf")), dim=1)  # candidates y
        want = torch.nan_to_num(hv - gap[:, None] / 2, nan=float("inf"))  # the y that would even the pair
        pos = torch.searchsorted(lv, want.contiguous())
        best_gain = torch.zeros(t, dtype=torch.float64)
        best = torch.zeros((t, 2), dtype=torch.int64)
        for cand in (pos - 1, pos):
            cand = cand.clamp(0, m - 1)
            delta = hv - torch.gather(lv, 1, cand)  # the heavy set sheds delta
            new_max = torch.maximum(sums[heavy][:, None] - delta, sums[light][:, None] + delta)
            gain = torch.nan_to_num(sums[heavy][:, None] - new_max, nan=0.0, neginf=0.0)  # > 0: max falls
            g, j = gain.max(1)
            better = g > best_gain
            best_gain = torch.where(better, g, best_gain)
            best[better, 0] = j[better]
            best[better, 1] = torch.gather(lorder, 1, torch.gather(cand, 1, j[:, None]))[:, 0][better]
        # A swap must lower the pair's max by more than rounding, or rounds could cycle on ties.
        ok = best_gain > 1e-12 * float(sums.abs().max().clamp(min=1.0))
        if not bool(ok.any()):
            break
        h, lt, jx, jy = heavy[ok], light[ok], best[ok, 0], best[ok, 1]
        xi, yi = members[h, jx], members[lt, jy]
        x, y = vals[h, jx], vals[lt, jy]
        members[h, jx], members[lt, jy] = yi, xi
        vals[h, jx], vals[lt, jy] = y, x
        moved[h, jx], moved[lt, jy] = y, x
        sums[h] += y - x
        sums[lt] += x - y
    part_all[members.flatten()] = torch.arange(k).repeat_interleave(m)
    return part_all[:n]
