"""The jagged tile schedule of the persistent attention kernels (pure torch, CPU): the work items are
exactly the tiles that exist, each once, heaviest first by a brute-force count of the visited pairs, and
the cache is reused only for the same unmodified offsets tensors."""

from __future__ import annotations

import pytest
import torch

from gem_kernels.attention.triton.schedule import build_schedule, cached_schedule, clear_cache

BIG = 1 << 30  # the launcher's unbounded side


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _brute_cost(len_o: int, len_i: int, start: int, block: int, lo_dist: int, hi_dist: int) -> int:
    """Inner positions in the tile's band, plus the tile itself (the schedule's cost)."""
    lo = max(start - lo_dist, 0)
    hi = min(len_i, start + block + hi_dist)
    return max(hi - lo, 0) + block


@pytest.mark.parametrize(
    "lo_dist,hi_dist",
    [(BIG, BIG), (BIG, 0), (5, 3), (0, BIG)],  # none, causal, window, key side of causal
)
def test_schedule_lists_real_tiles_heaviest_first(lo_dist, hi_dist):
    lq, lk = [37, 0, 1, 70, 16, 64, 129], [5, 3, 0, 70, 200, 64, 1]
    block, heads = 32, 3
    sched = build_schedule(_offsets(lq), _offsets(lk), max(lq), block, lo_dist, hi_dist, heads)
    n_tiles = -(-max(lq) // block)
    assert sched.n_tiles == n_tiles and sched.capacity == len(lq) * n_tiles
    real = {b * n_tiles + t for b, n in enumerate(lq) for t in range(-(-n // block))}
    count = int(sched.count.item())
    assert count == len(real) * heads
    items = sched.tiles[: len(real)].tolist()
    assert sorted(items) == sorted(real)  # every real tile once, none of the empty ones
    assert sorted(sched.tiles.tolist()) == list(range(sched.capacity))  # a permutation
    costs = [
        _brute_cost(lq[i // n_tiles], lk[i // n_tiles], i % n_tiles * block, block, lo_dist, hi_dist)
        for i in items
    ]
    assert costs == sorted(costs, reverse=True)
    assert sched.tiles.dtype == torch.int32 and sched.count.dtype == torch.int32


def test_schedule_of_empty_batch_has_no_items():
    sched = build_schedule(_offsets([0, 0]), _offsets([0, 0]), 0, 32, BIG, BIG, 2)
    assert int(sched.count.item()) == 0 and sched.capacity == 2


def test_cache_reuses_only_unchanged_offsets():
    clear_cache()
    qo, ko = _offsets([37, 5]), _offsets([37, 5])
    a = cached_schedule(qo, ko, 37, 16, BIG, 0, 2)
    assert cached_schedule(qo, ko, 37, 16, BIG, 0, 2) is a
    assert cached_schedule(qo, ko, 37, 32, BIG, 0, 2) is not a  # another block
    assert cached_schedule(qo.clone(), ko, 37, 16, BIG, 0, 2) is not a  # another tensor, same values
    qo[1:] = torch.tensor([5, 42], dtype=torch.int32)  # in-place change: version bump
    b = cached_schedule(qo, ko, 37, 16, BIG, 0, 2)
    assert b is not a
    assert int(b.count.item()) == (1 + 3) * 2  # 5 rows -> 1 tile, 37 rows -> 3 tiles of 16


def test_inference_offsets_are_scheduled_afresh_and_right():
    """Under ``torch.inference_mode`` (predict) offsets have no version counter: each call builds the schedule
    again, so a change in place is seen, and it equals the schedule of ordinary tensors of the same values."""
    clear_cache()
    with torch.inference_mode():
        qo, ko = _offsets([37, 5]), _offsets([37, 5])
        a = cached_schedule(qo, ko, 37, 16, BIG, 0, 2)
        want = build_schedule(qo.clone(), ko.clone(), 37, 16, BIG, 0, 2)
        assert torch.equal(a.tiles, want.tiles) and torch.equal(a.count, want.count)
        qo[1:] = torch.tensor([5, 42], dtype=torch.int32)  # in place, inside inference mode
        b = cached_schedule(qo, ko, 37, 16, BIG, 0, 2)
        assert int(b.count.item()) == (1 + 3) * 2
