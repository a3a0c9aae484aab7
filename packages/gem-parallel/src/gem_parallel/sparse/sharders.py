"""TorchRec sharders for GEM's tables: fused row-wise Adagrad in the backward, row-wise sharding on the CPU.

TorchRec's stock sharders offer row-wise and table-row-wise sharding only on CUDA, though the fused CPU
kernels run them correctly (checked against the unsharded tables in ``tests/test_sparse_1d.py``), and they
offer the dense (data-parallel) kernel, which is broken for ``EmbeddingCollection`` on the CPU (torchrec
1.8.0: wrong pooled shape, heap corruption with 2 ranks). These sharders declare row-wise for every device
and only the fused kernel, so a plan can never pick the broken one.
"""

from __future__ import annotations

# First: the torchrec/fbgemm stack check (a clear error on a mismatched stack), then torchrec.
import gem_parallel._stack  # noqa: F401

# isort: split

from typing import Any

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder, ShardingType

__all__ = ["SHARDING_TYPES", "fused_params", "gem_sharders"]

# What the plans of gem_parallel.sparse use (data-parallel is never used: replicas are 2D's job).
SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
)
_FUSED = [EmbeddingComputeKernel.FUSED.value]


def fused_params(lr: float, eps: float) -> dict[str, Any]:
    """TBE settings of the fused optimizer: FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (one fp32 accumulator per
    row, the mean of the squared row gradient), applied inside the backward."""
    if not lr > 0:
        raise ValueError(f"shard_embeddings: lr must be > 0, got {lr}")
    if not eps > 0:
        raise ValueError(f"shard_embeddings: eps must be > 0, got {eps}")
    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr, "eps": eps}


class _GemEBCSharder(EmbeddingBagCollectionSharder):
    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return list(_FUSED)


class _GemECSharder(EmbeddingCollectionSharder):
    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return list(_FUSED)


def gem_sharders(lr: float, eps: float) -> list[ModuleSharder[nn.Module]]:
    """Sharders for ``EmbeddingBagCollection`` and ``EmbeddingCollection`` with the fused optimizer."""
    params = fused_params(lr, eps)
    return [_GemEBCSharder(fused_params=params), _GemECSharder(fused_params=params)]  # type: ignore[list-item]
