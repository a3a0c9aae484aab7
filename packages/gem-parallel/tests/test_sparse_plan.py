"""gem_parallel.sparse plans and the benchmarks' memory model in one process (no process group): deterministic
plans, the placement rule, the per-rank accounting, and the model's formulas on hand-computed cases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import sparse_helpers as H
from sparse_memory_model import Table, sparse_costs

from gem_parallel.sparse import PlanError, make_plan, plan_fingerprint
from gem_parallel.sparse.plan import embedding_tables, rank_bytes
from gem_parallel.sparse.sharders import gem_sharders


def _plan(group: int, **kw):
    return make_plan(H.ToyModel().embeddings, group, gem_sharders(0.1, 1e-8), device_type="cpu", **kw)


def test_plan_is_deterministic_and_follows_the_rule():
    a, b = _plan(2), _plan(2)
    assert plan_fingerprint(a) == plan_fingerprint(b)
    assert plan_fingerprint(_plan(4)) != plan_fingerprint(a)
    types = {n: ps.sharding_type for mp in a.plan.values() for n, ps in mp.items()}
    # t_a: 45 x (8 x 4 + 4) = 1620 of 3096 bytes, over 1/2 of the total: row-wise; the rest table-wise.
    assert types == {"t_a": "row_wise", "t_b": "table_wise", "t_s": "table_wise", "t_t": "table_wise"}
    tables = embedding_tables(H.ToyModel().embeddings)
    per_rank = rank_bytes(tables, a, 2)
    assert sum(per_rank) == sum(t.bytes for t in tables) == 3096
    # Greedy by size: t_a halves (23, 22 rows), t_s (1044) to rank 1, t_t (180) and t_b (252) to rank 0.
    assert per_rank == [23 * 36 + 180 + 252, 22 * 36 + 1044]
    four = {n: ps.sharding_type for mp in _plan(4).plan.values() for n, ps in mp.items()}
    assert four["t_a"] == four["t_s"] == "row_wise"  # each over a quarter of the bytes


def test_plan_memory_errors():
    with pytest.raises(PlanError, match="needs 1620 bytes"):
        _plan(2, memory_per_rank=800)
    with pytest.raises(PlanError, match="more than memory_per_rank=1500"):
        _plan(2, memory_per_rank=1500)
    assert (
        max(rank_bytes(embedding_tables(H.ToyModel().embeddings), _plan(2, memory_per_rank=1900), 2)) <= 1900
    )


def test_memory_model_formulas():
    tables = [Table("big", 1000, 4, 2.0, pooled=True), Table("seq", 100, 4, 10.0, pooled=False),
              Table("small", 10, 4, 1.0, pooled=True)]  # fmt: skip
    total = (1000 + 100 + 10) * 20
    one = sparse_costs(tables, world=4, group=4, strategy="1d", batch_per_rank=3)
    assert one.table_bytes == total and one.resident == one.peak == total / 4
    # ids (13 per sample x 8 B) + lengths (3 tables x 8 B) per sample; seq rows both ways; small pooled both
    # ways; "big" (> 1/4 of the bytes) row-wise: reduce-scatter / all-gather of the group's partial sums.
    assert one.all_to_all == 3 * (13 * 8 + 3 * 8) + 2 * 10 * 3 * 16 + 2 * 3 * 16
    assert one.reduce_scatter == one.all_gather == 4 * 3 * 16 and one.all_reduce == 0
    two = sparse_costs(tables, world=4, group=2, strategy="2d", batch_per_rank=3, sync_every=2)
    assert two.resident == total / 2 and two.all_reduce == total / 2 / 2
    fs = sparse_costs(tables, world=4, group=2, strategy="fully_sharded_2d", batch_per_rank=3)
    assert fs.resident == total / 4 and fs.peak == total / 2 + total / 4
    assert fs.all_gather == 2 * 3 * 16 + total / 2 and fs.all_reduce == 0
    with pytest.raises(ValueError, match="does not divide"):
        sparse_costs(tables, world=4, group=3, strategy="2d", batch_per_rank=1)
