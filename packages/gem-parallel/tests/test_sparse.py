"""gem_parallel.sparse on gloo CPU ranks: sharded tables (1D, 2D, fully sharded 2D) equal the unsharded
tables trained with gem-train's dense-gradient RowWiseAdagrad.

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

from gem_parallel.testing import run_distributed

LR, EPS, STEPS, TOL = 0.1, 1e-8, 3, 1e-5


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _run_strategy(rank: int, world: int, strategy: str, group: int, sync_every: int) -> dict:
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
    out["tables"] = H.sharded_table_weights(model)
    out["state"] = H.sharded_state(model)
    return out


def _check_strategy(results: list[dict], world: int, replicas: int, sync_every: int) -> None:
    import sparse_helpers as H

    ref = H.reference_run(world, replicas, sync_every, STEPS, LR, EPS)
    for rank, res in enumerate(results):
        r = rank % replicas
        assert res["losses"] == pytest.approx([row[rank] for row in ref["losses"]], abs=1e-4), rank
        assert _max_diff(res["tables"], ref["tables"][r]) < TOL, rank
        assert _max_diff(res["state"], ref["state"][r]) < TOL, rank
        # Rows no batch of the replica touched are bit-identical to the start; touched rows moved.
        for name, w in res["tables"].items():
            rows = sorted(ref["touched"][r][name])
            untouched = [i for i in range(w.shape[0]) if i not in set(rows)]
            assert torch.equal(w[untouched], ref["initial"][name][untouched]), (rank, name)
            assert (w[rows] != ref["initial"][name][rows]).any(dim=1).all(), (rank, name)
        if replicas > 1:
            # Synced steps leave the replicas equal; the others (sync_every > 1) leave them apart.
            expect = [(s + 1) % sync_every == 0 for s in range(STEPS)]
            assert res["replicas_equal"] == expect, (rank, res["replicas_equal"])


def _worker_two(rank: int, world: int) -> dict:
    return {"1d": _run_strategy(rank, world, "1d", -1, 1)}


def test_sparse_two_ranks():
    results = run_distributed(__file__, "_worker_two", world_size=2, timeout_s=150)
    _check_strategy([r["1d"] for r in results], 2, 1, 1)
