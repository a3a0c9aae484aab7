"""gem_parallel: device meshes, FSDP2/HSDP, expert parallelism, TorchRec sparse sharding, load balancing."""

from gem_parallel.dims import DENSE_AXES, SPARSE_AXES, ParallelDims

__version__ = "0.1.0"

__all__ = ["DENSE_AXES", "SPARSE_AXES", "ParallelDims"]
