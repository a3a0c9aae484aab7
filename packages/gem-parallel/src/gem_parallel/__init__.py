"""gem_parallel: preparing a model for training (``parallelize``): precision, per-layer compile, activation
checkpointing, device meshes, FSDP2/HSDP, expert parallelism, TorchRec sparse sharding; load balancing."""

from gem_parallel.activation_checkpoint import allocate_region_budgets, selective_policy
from gem_parallel.activation_memory import retained_bytes, saved_tensor_bytes
from gem_parallel.all_gather import QuantizedAllGatherWeight
from gem_parallel.comm_bytes import CollectiveBytes
from gem_parallel.compile import compile_counters, compile_layers, configure_compile_cache
from gem_parallel.config import FSDPConfig, ParallelConfig
from gem_parallel.dims import DENSE_AXES, SPARSE_AXES, ParallelDims
from gem_parallel.expert import LocalExperts
from gem_parallel.parallelize import parallelize

__version__ = "0.1.0"

__all__ = [
    "DENSE_AXES",
    "SPARSE_AXES",
    "CollectiveBytes",
    "FSDPConfig",
    "LocalExperts",
    "ParallelConfig",
    "ParallelDims",
    "QuantizedAllGatherWeight",
    "allocate_region_budgets",
    "compile_counters",
    "compile_layers",
    "configure_compile_cache",
    "parallelize",
    "retained_bytes",
    "saved_tensor_bytes",
    "selective_policy",
]
