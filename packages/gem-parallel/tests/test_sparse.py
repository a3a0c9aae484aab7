"""gem_parallel.sparse on gloo CPU ranks: sharded tables (1D, 2D, fully sharded 2D) equal the unsharded
tables trained with exact row-wise Adagrad in plain PyTorch (``sparse_helpers.RowWiseAdagrad``); the
per-rank bytes equal the memory model of ``benchmarks/sparse_memory_model.py``.

Tolerance: both sides are fp32 with the same update formula; they differ only in summation order (TBE
kernels vs autograd's index_add), so 1e-5 absolute on weights of size ~1 and on accumulators (measured
differences ~1e-7).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))  # sparse_memory_model

from gem_parallel.testing import run_distributed

LR, EPS, STEPS, TOL = 0.1, 1e-8, 3, 1e-5


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _run_strategy(
    rank: int, world: int, strategy: str, group: int, sync_every: int, dcp_dir: str | None = None
) -> dict:
    """Train STEPS steps sharded; return per-step losses, tables and state (whole), and replica equality."""
    import sparse_helpers as H

    from gem_parallel import ParallelDims
    from gem_parallel.sparse import shard_embeddings, sparse_sharding
    from gem_parallel.sparse.shard import planned_rank_bytes

    dims = ParallelDims(sparse_group=group)
    mesh = dims.build_sparse_mesh("cpu")
    model = H.ToyModel()
    shard_embeddings(model, dims, mesh, strategy=strategy, sync_every=sync_every, lr=LR, eps=EPS)
    handle = sparse_sharding(model)
    out: dict = {"losses": [], "bytes": handle.local_bytes(), "planned": planned_rank_bytes(handle),
                 "replicas_equal": []}  # fmt: skip
    replica_pg = mesh["sparse_replicate"].get_group() if dims.sparse_replicas > 1 else None
    for step in range(STEPS):
        loss = model.loss(*H.rank_batch(step, rank))
        loss.backward()
        handle.step()
        out["losses"].append(float(loss))
        if replica_pg is not None:
            # Are this rank's shards equal to its replicas'? (compare the digest of the local storage)
            handle.materialize()
            from gem_parallel.sparse.replicas import tbe_kernels, tbe_storage

            local = torch.cat([t.reshape(-1) for k in tbe_kernels(model.embeddings) for t in tbe_storage(k)])
            gathered = [torch.empty_like(local) for _ in range(dims.sparse_replicas)]
            dist.all_gather(gathered, local, group=replica_pg)
            out["replicas_equal"].append(all(bool(torch.equal(g, gathered[0])) for g in gathered))
    handle.materialize()
    shard_pg = mesh["sparse_shard"].get_group()
    out["tables"] = H.sharded_table_weights(model, shard_pg)
    out["state"] = H.sharded_state(model, shard_pg)
    if dcp_dir is not None:
        out["dcp"] = _dcp_round_trip(model, shard_pg, dcp_dir, rank)
    return out


def _dcp_round_trip(model, shard_pg, path: str, rank: int) -> dict[str, float]:
    """Save weights + fused optimizer state with DCP, train one more step (everything moves), load: the
    loaded tables and accumulators equal the saved ones exactly."""
    import sparse_helpers as H
    import torch.distributed.checkpoint as dcp

    from gem_parallel.sparse import sparse_sharding

    handle = sparse_sharding(model)

    def state_dicts() -> dict:
        handle.prepare_checkpoint()
        return {"tables": model.embeddings.state_dict(), "optim": handle.fused_optimizer.state_dict()}

    saved = state_dicts()
    tables, state = H.sharded_table_weights(model, shard_pg), H.sharded_state(model, shard_pg)
    dcp.save(saved, checkpoint_id=path)
    loss = model.loss(*H.rank_batch(STEPS, rank))
    loss.backward()
    handle.step()
    handle.materialize()
    moved = _max_diff(H.sharded_table_weights(model, shard_pg), tables)
    sd = state_dicts()
    dcp.load(sd, checkpoint_id=path)
    model.embeddings.load_state_dict(sd["tables"])
    handle.fused_optimizer.load_state_dict(sd["optim"])
    return {
        "moved": moved,
        "tables": _max_diff(H.sharded_table_weights(model, shard_pg), tables),
        "state": _max_diff(H.sharded_state(model, shard_pg), state),
    }


def _memory_model(world: int, replicas: int, fully_sharded: bool):
    import sparse_helpers as H
    from sparse_memory_model import Table, sparse_costs

    tables = [Table(n, r, H.DIM, 1.0, True) for n, r in H.BAG_TABLES]
    tables += [Table(n, r, H.DIM, 1.0, False) for n, r in H.SEQ_TABLES]
    strategy = "fully_sharded_2d" if fully_sharded else ("2d" if replicas > 1 else "1d")
    return sparse_costs(tables, world=world, group=world // replicas, strategy=strategy, batch_per_rank=3)


def _check_dcp(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        d = res["dcp"]
        assert d["moved"] > 1e-3 and d["tables"] == 0.0 and d["state"] == 0.0, (rank, d)


def _check_strategy(
    results: list[dict], world: int, replicas: int, sync_every: int, fully_sharded: bool = False
) -> None:
    import sparse_helpers as H

    ref = H.reference_run(world, replicas, sync_every, STEPS, LR, EPS)
    # The memory model: the group's shards sum to the tables' bytes; a rank holds total / G on average
    # (total / world fully sharded), which is what BENCHMARKS.md scales up.
    model = _memory_model(world, replicas, fully_sharded)
    assert sum(results[0]["planned"]) == model.table_bytes
    mean_bytes = sum(r["bytes"] for r in results) / world
    assert mean_bytes == pytest.approx(model.resident, rel=0.05 if fully_sharded else 0.0)  # padding
    for rank, res in enumerate(results):
        r = rank % replicas
        assert res["losses"] == pytest.approx([row[rank] for row in ref["losses"]], abs=1e-4), rank
        assert _max_diff(res["tables"], ref["tables"][r]) < TOL, rank
        assert _max_diff(res["state"], ref["state"][r]) < TOL, rank
        n_untouched = 0
        # Rows no batch touched (of any replica: syncs spread the others' updates) are bit-identical to the
        # start; the rows this replica's batches touched moved.
        for name, w in res["tables"].items():
            rows = sorted(ref["touched"][r][name])
            anywhere = set().union(*(t[name] for t in ref["touched"]))
            untouched = [i for i in range(w.shape[0]) if i not in anywhere]
            n_untouched += len(untouched)
            assert torch.equal(w[untouched], ref["initial"][name][untouched]), (rank, name)
            assert (w[rows] != ref["initial"][name][rows]).any(dim=1).all(), (rank, name)
        assert n_untouched > 0  # the batches leave some rows alone, or that check is empty
        # Per-rank bytes: exactly the plan's accounting (rows x (D x 4 + 4)); fully sharded keeps 1/R of it
        # (each flattened kernel tensor padded to a multiple of R fp32 elements).
        planned = res["planned"][rank // replicas]
        if fully_sharded:
            assert 0 <= res["bytes"] * replicas - planned < replicas * 4 * 2 * 4, (
                rank,
                res["bytes"],
                planned,
            )
        else:
            assert res["bytes"] == planned, (rank, res["bytes"], planned)
        if replicas > 1:
            # Synced steps leave the replicas equal; the others (sync_every > 1) leave them apart.
            expect = [(s + 1) % sync_every == 0 for s in range(STEPS)]
            assert res["replicas_equal"] == expect, (rank, res["replicas_equal"])


def _errors(rank: int, world: int) -> dict[str, str]:
    """Every misconfiguration raises on this rank, before any collective that could hang (the process
    group stays usable: the runs after these ones use it)."""
    import sparse_helpers as H
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    from gem_parallel import ParallelDims
    from gem_parallel.sparse import make_plan, shard_embeddings
    from gem_parallel.sparse.sharders import gem_sharders

    def attempt(fn) -> str:
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    dims = ParallelDims()
    mesh = dims.build_sparse_mesh("cpu")
    model = H.ToyModel()
    sharders = gem_sharders(LR, EPS)
    too_big = make_plan(model.embeddings, 4, sharders, device_type="cpu")  # made for groups of 4

    def own_plan() -> ShardingPlan:  # every table on this rank: differs across ranks
        plans = {}
        for path, tables, sharder in (
            ("bags", H.BAG_TABLES, sharders[0]),
            ("sequences", H.SEQ_TABLES, sharders[1]),
        ):
            per_table = {n: table_wise(rank=rank, compute_kernel="fused") for n, _ in tables}
            plans[path] = construct_module_sharding_plan(
                getattr(model.embeddings, path), per_table, sharder=sharder,
                local_size=world, world_size=world, device_type="cpu",
            )  # fmt: skip
        return ShardingPlan(plan=plans)  # type: ignore[arg-type]

    toy = H.ToyModel
    return {
        "group_not_dividing": attempt(lambda: ParallelDims(sparse_group=3)),
        "table_over_group_memory": attempt(
            lambda: shard_embeddings(H.ToyModel(), dims, mesh, memory_per_rank=500)
        ),
        "rank_over_memory": attempt(lambda: shard_embeddings(toy(), dims, mesh, memory_per_rank=1200)),
        "1d_with_groups": attempt(lambda: shard_embeddings(toy(), ParallelDims(sparse_group=1), mesh)),
        "bad_strategy": attempt(lambda: shard_embeddings(toy(), dims, mesh, strategy="3d")),
        "plan_outside_group": attempt(lambda: shard_embeddings(toy(), dims, mesh, plan=too_big)),
        "plans_differ": attempt(lambda: shard_embeddings(toy(), dims, mesh, plan=own_plan())),
        "no_mesh": attempt(lambda: shard_embeddings(toy(), dims, None)),
    }


def _worker_two(rank: int, world: int, dcp_dir: str) -> dict:
    return {"errors": _errors(rank, world), "1d": _run_strategy(rank, world, "1d", -1, 1, dcp_dir)}


@pytest.mark.distributed
def test_sparse_two_ranks(tmp_path):
    kwargs = {"dcp_dir": str(tmp_path / "ckpt")}
    results = run_distributed(__file__, "_worker_two", world_size=2, kwargs=kwargs, timeout_s=150)
    expected = {
        "group_not_dividing": "sparse_group=3 does not divide world_size=2",
        "table_over_group_memory": "table 't_a' (45 x 8) needs 1620 bytes",
        "rank_over_memory": "more than memory_per_rank=1200",
        "1d_with_groups": "strategy '1d' shards over all 2 ranks",
        "bad_strategy": "strategy must be one of",
        "plan_outside_group": "outside a sharding group of 2",
        "plans_differ": "the sharding plans differ across ranks",
        "no_mesh": "pass the sparse mesh",
    }
    for rank, res in enumerate(results):
        for case, text in expected.items():
            assert text in res["errors"][case], (rank, case, res["errors"][case])
    _check_strategy([r["1d"] for r in results], 2, 1, 1)
    _check_dcp([r["1d"] for r in results])


def _worker_four(rank: int, world: int, dcp_dir: str) -> dict:
    return {
        "1d": _run_strategy(rank, world, "1d", -1, 1),
        "2d": _run_strategy(rank, world, "2d", 2, 2, dcp_dir + "/2d"),  # DTensor state dicts, replicas
        "fs2d": _run_strategy(rank, world, "fully_sharded_2d", 2, 1, dcp_dir + "/fs2d"),
    }


@pytest.mark.distributed
def test_sparse_four_ranks(tmp_path):
    kwargs = {"dcp_dir": str(tmp_path)}
    results = run_distributed(__file__, "_worker_four", world_size=4, kwargs=kwargs, timeout_s=240)
    _check_strategy([r["1d"] for r in results], 4, 1, 1)
    _check_strategy([r["2d"] for r in results], 4, 2, 2)
    _check_strategy([r["fs2d"] for r in results], 4, 2, 1, fully_sharded=True)
    _check_dcp([r["2d"] for r in results])
    _check_dcp([r["fs2d"] for r in results])
