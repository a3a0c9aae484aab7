"""The sparse half of gem-parallel: TorchRec-sharded embedding tables (1D, 2D, fully sharded 2D) with the
row-wise Adagrad fused into the backward. (The memory/communication model of the three strategies is
benchmark code: ``benchmarks/sparse_memory_model.py``.)"""

import gem_parallel._stack  # noqa: F401  (checks the torchrec/fbgemm stack before torchrec is imported)
from gem_parallel.sparse.plan import PlanError, make_plan, plan_fingerprint
from gem_parallel.sparse.shard import SparseSharding, shard_embeddings, sparse_sharding

__all__ = [
    "PlanError",
    "SparseSharding",
    "make_plan",
    "plan_fingerprint",
    "shard_embeddings",
    "sparse_sharding",
]
