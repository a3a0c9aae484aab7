"""GlobalBalancer on 2 and 4 gloo ranks: samples conserved, equal sizes, jagged rows follow their samples,
balance better than the ranks' own batches and than random equal-size partitions; bad input fails on every
rank."""

from __future__ import annotations

import pytest
import torch

from gem_parallel.balance import GlobalBalancer, get_cost_model, karmarkar_karp, part_sums
from gem_parallel.testing import run_distributed

SIZES = {2: [6, 10], 4: [3, 11, 9, 9]}  # ragged per-rank counts, total a multiple of the world


def _length(uid: int) -> int:
    """A sample's length: a pure function of its id, so any rank can check what it received."""
    g = torch.Generator().manual_seed(uid)
    skew = 3.0 if uid < 1000 else 0.0  # rank 0's samples are long: the ranks start out unbalanced
    return int(torch.exp(torch.randn(1, generator=g) + 3 + skew).round().clamp(max=5000))


def _worker(rank: int, world_size: int) -> dict:
    n = SIZES[world_size][rank]
    ids = torch.arange(n, dtype=torch.int64) + 1000 * rank
    lengths = torch.tensor([_length(int(u)) for u in ids], dtype=torch.int64)
    values = torch.repeat_interleave(ids, lengths) * 10_000 + torch.cat(
        [torch.arange(int(x)) for x in lengths]
    )
    bal = GlobalBalancer("attention")
    plan = bal.plan(lengths)
    got_ids = bal.exchange(plan, ids)
    got_flags = bal.exchange(plan, ids % 2 == 0)  # bool rows travel as uint8
    got_values, got_lengths = bal.exchange_jagged(plan, values, lengths)
    errors = []
    for bad in ([-1] * n if rank == world_size - 1 else lengths.tolist(),):  # bad input on one rank only
        try:
            bal.plan(torch.tensor(bad))
        except ValueError as e:
            errors.append(str(e))
    return {"ids": got_ids, "flags": got_flags, "values": got_values, "lengths": got_lengths,
            "before": plan.cost_before, "after": plan.cost_after, "errors": errors}  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
def test_global_balancer(world: int) -> None:
    out = run_distributed(__file__, "_worker", world_size=world, timeout_s=240)
    all_ids = sorted(int(i) + 1000 * r for r, n in enumerate(SIZES[world]) for i in range(n))
    got = sorted(int(i) for o in out for i in o["ids"])
    assert got == all_ids  # every sample once
    per_rank = sum(SIZES[world]) // world
    assert all(o["ids"].numel() == per_rank for o in out)  # equal sizes
    cost = get_cost_model("attention")
    for o in out:
        assert torch.equal(o["flags"], o["ids"] % 2 == 0)
        want_len = torch.tensor([_length(int(u)) for u in o["ids"]])
        assert torch.equal(o["lengths"], want_len)  # each length follows its sample
        want_vals = torch.repeat_interleave(o["ids"], want_len) * 10_000 + torch.cat(
            [torch.arange(int(x)) for x in want_len]
        )
        assert torch.equal(o["values"], want_vals)  # and so do its rows, in order
        assert len(o["errors"]) == 1 and "rank(s) [" in o["errors"][0]  # every rank raised
    after = torch.stack(
        [cost.sample_costs(torch.tensor([_length(int(u)) for u in o["ids"]])).sum() for o in out]
    )
    torch.testing.assert_close(after, out[0]["after"])
    ratio = float(after.max() / after.mean())
    before = out[0]["before"]
    assert ratio < float(before.max() / before.mean())
    # Random equal-size partitions of the same samples, on average, are worse.
    costs = cost.sample_costs(torch.tensor([_length(u) for u in all_ids]))
    g = torch.Generator().manual_seed(0)
    rnd = [part_sums(costs, torch.randperm(len(all_ids), generator=g) % world, world) for _ in range(50)]
    assert ratio < sum(float(s.max() / s.mean()) for s in rnd) / len(rnd)
    assert ratio <= float(part_sums(costs, karmarkar_karp(costs, world), world).max() / after.mean()) + 1e-9
