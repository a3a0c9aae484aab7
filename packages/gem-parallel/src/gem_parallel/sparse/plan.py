"""Sharding plans of the embedding tables: deterministic, checked before any collective, equal on every rank.

:func:`make_plan` places the tables of a sharding group of ``G`` ranks: a table larger than an even share of
the group (``total / G``), or larger than one rank's memory, is split row-wise over the whole group; the
others go table-wise, largest first, each onto the least loaded rank (ties to the lowest rank). Everything
it reads (table shapes, ``G``, the memory budget) is the same on every rank, so every rank computes the same
plan without talking; :func:`check_plans_agree` then verifies that with one small all-gather.

Memory counted per table row: the fp32 weights (``dim x 4`` bytes) and the row-wise Adagrad accumulator
(4 bytes): what the memory model of ``benchmarks/sparse_memory_model.py`` counts.
"""

from __future__ import annotations

# First: the torchrec/fbgemm stack check (a clear error on a mismatched stack), then torchrec.
import gem_parallel._stack  # noqa: F401

# isort: split

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

__all__ = [
    "PlanError",
    "TableInfo",
    "check_plan",
    "check_plans_agree",
    "embedding_tables",
    "make_plan",
    "plan_fingerprint",
    "rank_bytes",
]


_FUSED = "fused"  # EmbeddingComputeKernel.FUSED: the optimizer runs inside the backward


class PlanError(ValueError):
    """The tables cannot be placed as asked (raised on every rank, before any collective)."""


@dataclass(frozen=True)
class TableInfo:
    """One embedding table: where it lives (``module`` path inside the sharded module) and its shape."""

    module: str
    name: str
    rows: int
    dim: int
    weight_bytes_per_row: int

    @property
    def bytes_per_row(self) -> int:
        """Weights plus the fp32 row-wise Adagrad accumulator."""
        return self.weight_bytes_per_row + 4

    @property
    def bytes(self) -> int:
        return self.rows * self.bytes_per_row


def _collections(module: nn.Module) -> list[tuple[str, EmbeddingBagCollection | EmbeddingCollection]]:
    found = [
        (n, m)
        for n, m in module.named_modules()
        if isinstance(m, EmbeddingBagCollection | EmbeddingCollection)
    ]
    if not found:
        raise PlanError(
            f"{type(module).__name__} holds no TorchRec EmbeddingBagCollection/EmbeddingCollection"
        )
    if any(n == "" for n, _ in found):
        raise PlanError(
            "shard_embeddings needs a module that *holds* the collections, not a collection itself"
        )
    return found


def embedding_tables(module: nn.Module) -> list[TableInfo]:
    """Every table of every TorchRec collection inside ``module``, in module order."""
    out = []
    for path, coll in _collections(module):
        configs = (
            coll.embedding_bag_configs()
            if isinstance(coll, EmbeddingBagCollection)
            else coll.embedding_configs()
        )
        for cfg in configs:
            size = torch.empty((), dtype=_dtype(cfg.data_type)).element_size()
            out.append(
                TableInfo(path, cfg.name, cfg.num_embeddings, cfg.embedding_dim, cfg.embedding_dim * size)
            )
    return out


def _dtype(data_type: object) -> torch.dtype:
    from torchrec.types import DataType

    return {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}.get(
        data_type,  # type: ignore[call-overload]
        torch.float32,
    )


def _row_splits(rows: int, group: int) -> list[int]:
    # TorchRec's even row-wise split: ceil(rows / G) per rank, the last ranks get the rest (maybe 0).
    block = -(-rows // group)
    return [max(0, min(block, rows - r * block)) for r in range(group)]


def rank_bytes(tables: list[TableInfo], plan: ShardingPlan, group: int) -> list[int]:
    """Bytes (weights + row-wise state) each rank of a sharding group holds under ``plan``."""
    per_rank = [0] * group
    by_key = {(t.module, t.name): t for t in tables}
    for path, module_plan in plan.plan.items():
        for name, ps in module_plan.items():  # type: ignore[attr-defined]
            t = by_key[(path, name)]
            for shard in ps.sharding_spec.shards:
                rows, cols = shard.shard_sizes
                rank = shard.placement.rank()
                # Row-wise state is per row of each shard (a column-wise shard keeps its own accumulator).
                per_rank[rank] += rows * (cols * t.weight_bytes_per_row // t.dim + 4)
    return per_rank


def make_plan(
    module: nn.Module,
    group: int,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    device_type: str,
    memory_per_rank: int | None = None,
    resident_factor: float = 1.0,
) -> ShardingPlan:
    """The plan of ``module``'s tables over a sharding group of ``group`` ranks (ranks are group-local).

    Args:
        module: holds the TorchRec collections (e.g. ``GemModel.embeddings``).
        group: ranks in the sharding group.
        sharders: the sharders the plan is for (:func:`gem_parallel.sparse.sharders.gem_sharders`).
        device_type: "cpu" or "cuda".
        memory_per_rank: bytes one rank may hold (weights + row-wise state); None = no limit.
        resident_factor: bytes held per planned byte (fully sharded 2D holds ``1 + 1/R``: the gathered
            shard during the step plus its own slice).

    Raises:
        PlanError: a table that does not fit its sharding group, or a rank over ``memory_per_rank``.
    """
    tables = embedding_tables(module)
    total = sum(t.bytes for t in tables)
    if memory_per_rank is not None:
        for t in tables:
            if t.bytes * resident_factor > group * memory_per_rank:
                raise PlanError(
                    f"table {t.name!r} ({t.rows} x {t.dim}) needs {t.bytes * resident_factor:.0f} bytes with "
                    f"its row-wise state, more than its sharding group of {group} ranks holds "
                    f"({group} x {memory_per_rank} bytes): use a larger sparse_group or more memory"
                )
    row_wise_names = {
        (t.module, t.name)
        for t in tables
        if group > 1
        and (
            t.bytes * group > total
            or (memory_per_rank is not None and t.bytes * resident_factor > memory_per_rank)
        )
    }
    load = [0] * group
    placement: dict[tuple[str, str], int] = {}
    for t in sorted(tables, key=lambda t: (-t.bytes, t.module, t.name)):
        if (t.module, t.name) in row_wise_names:
            for r, rows in enumerate(_row_splits(t.rows, group)):
                load[r] += rows * t.bytes_per_row
        else:
            r = min(range(group), key=lambda i: (load[i], i))
            placement[(t.module, t.name)] = r
            load[r] += t.bytes
    sharder_of = {s.module_type: s for s in sharders}
    plans: dict[str, EmbeddingModuleShardingPlan] = {}
    for path, coll in _collections(module):
        per_table = {
            t.name: row_wise(compute_kernel=_FUSED)
            if (path, t.name) in row_wise_names
            else table_wise(rank=placement[(path, t.name)], compute_kernel=_FUSED)
            for t in tables
            if t.module == path
        }
        plans[path] = construct_module_sharding_plan(
            coll,
            per_table,
            sharder=sharder_of[type(coll)],
            local_size=group,
            world_size=group,
            device_type=device_type,
        )
    plan = ShardingPlan(plan=plans)  # type: ignore[arg-type]
    check_plan(module, plan, group, memory_per_rank=memory_per_rank, resident_factor=resident_factor)
    return plan


def check_plan(
    module: nn.Module,
    plan: ShardingPlan,
    group: int,
    *,
    memory_per_rank: int | None = None,
    resident_factor: float = 1.0,
) -> None:
    """Check a (given or computed) plan against the tables and the group, with no collective.

    Raises:
        PlanError: a table missing from or unknown to the plan, a shard on a rank outside the group, a
            sharding type the sparse package does not run, or a rank over ``memory_per_rank``.
    """
    tables = embedding_tables(module)
    want = {(t.module, t.name) for t in tables}
    have = {(p, n) for p, mp in plan.plan.items() for n in mp}  # type: ignore[attr-defined]
    if want != have:
        raise PlanError(
            f"the plan does not cover exactly the model's tables: missing {sorted(want - have)}, "
            f"unknown {sorted(have - want)}"
        )
    allowed = {ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value,
               ShardingType.TABLE_ROW_WISE.value}  # fmt: skip
    for mp in plan.plan.values():
        for n, ps in mp.items():  # type: ignore[attr-defined]
            assert isinstance(ps, ParameterSharding)
            if ps.sharding_type not in allowed:
                raise PlanError(
                    f"table {n!r}: sharding type {ps.sharding_type!r} is not one of {sorted(allowed)}"
                )
            if ps.compute_kernel != _FUSED:
                raise PlanError(
                    f"table {n!r}: compute kernel {ps.compute_kernel!r}; the sparse package runs the fused "
                    "kernel only (the optimizer is fused into the backward)"
                )
            ranks = ps.ranks or []
            if any(r < 0 or r >= group for r in ranks):
                raise PlanError(
                    f"table {n!r} is placed on ranks {ranks}, outside a sharding group of {group}"
                )
    if memory_per_rank is not None:
        per_rank = rank_bytes(tables, plan, group)
        worst = max(range(group), key=lambda r: per_rank[r])
        if per_rank[worst] * resident_factor > memory_per_rank:
            raise PlanError(
                f"rank {worst} of the sharding group would hold {per_rank[worst] * resident_factor:.0f} "
                f"bytes of tables and row-wise state, more than memory_per_rank={memory_per_rank}"
            )


def plan_fingerprint(plan: ShardingPlan) -> str:
    """A digest of everything that places a shard (tables, types, kernels, ranks, sizes, offsets)."""
    items = []
    for p in sorted(plan.plan):
        for n, ps in sorted(plan.plan[p].items()):  # type: ignore[attr-defined]
            shards = [
                (tuple(s.shard_offsets), tuple(s.shard_sizes), str(s.placement))
                for s in ps.sharding_spec.shards
            ]
            items.append((p, n, ps.sharding_type, ps.compute_kernel, tuple(ps.ranks or []), tuple(shards)))
    return hashlib.sha256(repr(items).encode()).hexdigest()


def check_plans_agree(plan: ShardingPlan, group: dist.ProcessGroup | None = None) -> None:
    """All-gather every rank's plan digest; raise on every rank if any differs (a plan that differs across
    ranks would deadlock or silently corrupt the lookups)."""
    mine = plan_fingerprint(plan)
    size = dist.get_world_size(group)
    digests: list[str | None] = [None] * size
    dist.all_gather_object(digests, mine, group=group)
    if len(set(digests)) != 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PlanError(f"the sharding plans differ across ranks (ranks {bad} differ from rank 0)")
