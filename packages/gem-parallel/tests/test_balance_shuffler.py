"""BaseBatchShuffler, every policy: exact conservation, determinism by seed, exact resume mid-pool, better
balance. The capped policy's own tests: test_balance_capped.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gem_parallel.balance import BaseBatchShuffler
from gem_parallel.balance.shuffler import POLICIES

SB, K, POOL = 8, 4, 3  # sub-batches of 8, batches of 32, pools of 3 batches: small and fast


def _source(
    n_sub: int, seed: int = 0, *, ragged: bool = True, sigma: float = 1.2
) -> list[list[tuple[int, int]]]:
    """Sub-batches of (sample id, length) with log-normal lengths (0 included); ragged sizes incl. empty."""
    g = torch.Generator().manual_seed(seed)
    out, uid = [], 0
    for s in range(n_sub):
        size = SB if not ragged else [SB, SB, 5, SB, 1, SB, 0, SB, 7][s % 9]
        lens = torch.exp(4 + sigma * torch.randn(size, generator=g)).round().clamp(max=4000).long()
        lens[torch.rand(size, generator=g) < 0.05] = 0
        out.append([(uid + i, int(x)) for i, x in enumerate(lens)])
        uid += size
    return out


def _make(source, policy: str, seed: int = 1, **kw) -> BaseBatchShuffler:
    return BaseBatchShuffler(
        source, cost=kw.pop("cost", "attention"), lengths=lambda sb: [x[1] for x in sb], sub_batch_size=SB,
        sub_batches_per_batch=K, pool_batches=POOL, seed=seed, policy=policy, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("policy", POLICIES)
def test_every_sample_exactly_once(policy: str) -> None:
    src = _source(61)  # 61 sub-batches, ragged: the last pool is partial
    ids = sorted(x[0] for sb in src for x in sb)
    batches = list(_make(src, policy))
    out = [x[0] for b in batches for x in b]
    assert sorted(out) == ids and len(out) == len(set(out))
    sizes = [len(b) for b in batches]
    assert all(0 < s <= SB * K for s in sizes)
    assert sum(s == SB * K for s in sizes) >= len(sizes) - POOL  # only the final pool's batches are short


@pytest.mark.parametrize("policy", POLICIES)
def test_deterministic_by_seed(policy: str) -> None:
    src = _source(40)
    a, b = list(_make(src, policy, seed=5)), list(_make(src, policy, seed=5))
    c = list(_make(src, policy, seed=6))
    assert a == b
    assert a != c  # another seed: another order inside the batches


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cut", [1, 4, 11])  # inside the first pool, inside later pools
def test_resume_mid_pool_is_exact(policy: str, cut: int) -> None:
    src = _source(70, seed=2)
    full = list(_make(src, policy))
    first = _make(src, policy)
    head = [first.next_batch() for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))  # plain data: survives JSON
    # A fresh shuffler over a fresh source, given as `source(start)` (skips without re-reading) and as a
    # plain iterable (re-reads and drops what was emitted).
    starts: list[int] = []

    def from_start(start: int):
        starts.append(start)
        return iter(src[start:])

    for source in (from_start, iter(src)):
        resumed = _make(source, policy)
        resumed.load_state_dict(state)
        assert head + list(resumed) == full
    live = state["pool"]["ordinal"] + [o for b in state["pending"] for o, _ in b]
    assert starts == [min(live)]  # the callable source is opened once, at the oldest live sub-batch


@pytest.mark.parametrize("policy", ["capped", "sliding"])
def test_order_inside_batch_is_random(policy: str) -> None:
    src = _source(60, ragged=False)
    for b in _make(src, policy):
        lens = [x[1] for x in b]
        assert lens != sorted(lens) and lens != sorted(lens, reverse=True)


def _step_ratios(policy: str, ranks: int, steps: int, **kw) -> list[float]:
    """max / mean over `ranks` independent shufflers (one per rank, own data) of each step's batch cost."""
    per_rank = []
    for r in range(ranks):
        sh = _make(
            _source(K * (steps + POOL), seed=100 + r, ragged=False, sigma=0.7), policy, cost="linear", **kw
        )
        per_rank.append([sum(x[1] for x in b) for b in list(sh)[:steps]])
    costs = torch.tensor(per_rank, dtype=torch.float64)  # [ranks, steps]
    return (costs.max(0).values / costs.mean(0)).tolist()


def test_balance_beats_random_on_skewed_lengths() -> None:
    """Log-normal lengths (sigma 0.7), linear cost, 16 ranks with their own data, 12 steps of 32 samples.
    Measured excess of the heaviest rank over the mean: random 0.29; pool policies 0.16-0.17 (the pool's
    own noise, 1/sqrt(3) of random's); sliding and capped 0.11 from a cold start (their running mean is still
    noisy) and 0.010 when the mean cost per sample is known (feedback 0.01; the cap, 0.02 above, is not
    reached on this easy stream, so capped = sliding). Bounds leave room over those."""
    steps = 12
    excess = {p: sum(_step_ratios(p, 16, steps)) / steps - 1 for p in POLICIES}
    mean_cost = math.exp(4 + 0.7**2 / 2)
    known = {
        p: sum(_step_ratios(p, 16, steps, mean_cost=mean_cost)) / steps - 1 for p in ("sliding", "capped")
    }
    assert excess["random"] > 0.2
    for p in ("pair", "lpt", "snake"):
        assert excess[p] < 0.7 * excess["random"], (p, excess)
    for p in ("sliding", "capped"):
        assert excess[p] < 0.5 * excess["random"], (p, excess)
        assert known[p] < 0.1 * excess["random"], (p, known)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="policy"):
        _make([], "nope")
    with pytest.raises(ValueError, match="sub_batch_size"):
        BaseBatchShuffler([], cost="linear", sub_batch_size=0)
    with pytest.raises(ValueError, match="feedback"):
        _make([], "sliding", feedback=0.0)
    with pytest.raises(ValueError, match="headroom"):
        _make([], "capped", headroom=0.0)
    with pytest.raises(ValueError, match="soft_wait"):
        _make([], "capped", soft_wait=-1)
    sh = _make(_source(10), "sliding")
    sh.next_batch()
    state = sh.state_dict()
    with pytest.raises(ValueError, match="policy"):
        _make(_source(10), "snake").load_state_dict(state)
    with pytest.raises(ValueError, match="source ended"):
        _make(_source(2), "sliding").load_state_dict({**state, "next_ordinal": 50})
    assert list(_make([], "sliding")) == []


def test_sliding_wait_is_bounded() -> None:
    """A sample read while batch k is built is emitted by batch k + max_wait at the latest (while fewer
    than a batch of samples are overdue at once, which a pool of 3 batches keeps at max_wait 4)."""
    src = _source(80, seed=4, ragged=False)
    read_at: dict[int, int] = {}
    built = [0]

    def source(start: int):
        for sb in src[start:]:
            for uid, _ in sb:
                read_at[uid] = built[0]
            yield sb

    sh = _make(source, "sliding", max_wait=4)
    waits = []
    while (batch := sh.next_batch()) is not None:
        waits += [built[0] - read_at[uid] for uid, _ in batch]
        built[0] += 1
    assert len(waits) == 80 * SB and max(waits) <= 4
    assert max(waits) == 4  # the bound binds: some samples did wait that long
