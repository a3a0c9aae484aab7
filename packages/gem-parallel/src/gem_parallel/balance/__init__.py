"""Load balancing of jagged batches across data-parallel ranks.

- :class:`BaseBatchShuffler`: each rank balances its own batches from a pool of sub-batches (no
  communication).
- :class:`GlobalBalancer`: all-gathers per-sample costs, partitions them into equal-size sets
  (Karmarkar–Karp + swaps) and exchanges samples (communication every step): the comparison point.
- Cost models (:mod:`gem_parallel.balance.cost`) and the simulator (``python -m gem_parallel.balance``).
"""

from gem_parallel.balance.cost import (
    AttentionCost,
    CostModel,
    LinearCost,
    MixCost,
    calibration_level,
    default_cost_file,
    fit_mix_cost,
    get_cost_model,
)
from gem_parallel.balance.global_balancer import ExchangePlan, GlobalBalancer
from gem_parallel.balance.partition import karmarkar_karp, part_sums, refine_partition
from gem_parallel.balance.shuffler import MIN_POOL_SAMPLES, POLICIES, BaseBatchShuffler, default_pool_batches

__all__ = [
    "MIN_POOL_SAMPLES",
    "POLICIES",
    "AttentionCost",
    "BaseBatchShuffler",
    "CostModel",
    "ExchangePlan",
    "GlobalBalancer",
    "LinearCost",
    "MixCost",
    "calibration_level",
    "default_cost_file",
    "default_pool_batches",
    "fit_mix_cost",
    "get_cost_model",
    "karmarkar_karp",
    "part_sums",
    "refine_partition",
]
