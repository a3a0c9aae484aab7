"""``parallelize(..., ParallelConfig(embeddings="2d"))`` on 4 gloo ranks: the toy model, whose tables are
sharded 2D (2 sharding groups of 2, replicas averaged) and whose dense part is FSDP2-sharded matches one
process on the global batch: the losses and every dense gradient after the first step, and the tables stay
equal across replicas after the sync.

Tolerances as in test_dense_parallel.py (fp32; sums reordered across ranks): losses 1e-5 relative,
gradients 1e-4 of each tensor's largest entry.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dense_helpers import build_model, full, max_rel_diff, rank_slices, reference_loss, small_config

from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims, parallelize
from gem_parallel.testing import run_distributed
from gem_parallel.testing.toy_model import toy_batch, toy_loss

SIZES = [2, 2, 2, 2]  # TorchRec's CPU kernels need equal batches per rank (no variable batch size)


def _worker(rank: int, world: int) -> dict:
    from gem_parallel.sparse import sparse_sharding
    from gem_parallel.sparse.replicas import tbe_kernels, tbe_storage

    dims = ParallelDims(sparse_group=2)
    config = small_config(n_experts=2)
    ref = build_model(config)
    model = copy.deepcopy(ref)
    cfg = ParallelConfig(embeddings="2d", fsdp=FSDPConfig(reduce_dtype=None), embedding_lr=0.1)
    model = parallelize(model, dims, dims.build_mesh("cpu"), cfg, sparse_mesh=dims.build_sparse_mesh("cpu"))
    handle = sparse_sharding(model)
    batch = toy_batch(config, sum(SIZES), seed=7)
    local = batch.select(rank_slices(SIZES)[rank])
    loss = toy_loss(model(local), local)
    loss.backward()
    ref_loss = reference_loss(ref, batch, SIZES)
    ref_loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    ref_params = dict(ref.named_parameters())
    dense = {n: p for n, p in model.named_parameters() if not n.startswith("embeddings.")}
    grads = {n: max_rel_diff(full(p.grad), ref_params[n].grad) for n, p in dense.items()}
    before = torch.cat([t.reshape(-1).clone() for k in tbe_kernels(model.embeddings) for t in tbe_storage(k)])
    handle.step()  # 2D, sync_every=1: average the replicas
    after = torch.cat([t.reshape(-1) for k in tbe_kernels(model.embeddings) for t in tbe_storage(k)])
    gathered = [torch.empty_like(after) for _ in range(2)]
    dist.all_gather(gathered, after, group=dims.build_sparse_mesh("cpu")["sparse_replicate"].get_group())
    return {
        "loss": float(mean) / world,
        "ref_loss": float(ref_loss),
        "grads": grads,
        "n_dense": len(dense),
        "n_ref_dense": sum(1 for n in ref_params if not n.startswith("embeddings.")),
        "no_table_grads": all(p.grad is None for p in model.embeddings.parameters()),
        "sync_changed": bool((before != after).any()),
        "replicas_equal": bool(torch.equal(gathered[0], gathered[1])),
        "sharded": type(model.embeddings.bags).__name__,
    }


@pytest.mark.distributed
def test_parallelize_2d_embeddings_match_one_process():
    results = run_distributed(__file__, "_worker", world_size=4, timeout_s=200)
    for rank, r in enumerate(results):
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (rank, r["loss"], r["ref_loss"])
        worst = max(r["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-4, (rank, worst)
        assert r["n_dense"] == r["n_ref_dense"] > 0
        assert r["sharded"] == "ShardedEmbeddingBagCollection"
        assert r["no_table_grads"]  # the optimizer is fused: no table gradient is materialized
        assert r["sync_changed"] and r["replicas_equal"], rank
