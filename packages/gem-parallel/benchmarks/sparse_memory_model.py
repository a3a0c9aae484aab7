"""Memory and communication model of 1D, 2D and fully sharded 2D embedding sharding, per rank and per step.

Benchmark code (``sparse_memory.py`` evaluates it at scale and against measurements); tests/test_sparse.py
and tests/test_sparse_plan.py check it. It was ``gem_parallel.sparse.memory`` until nothing in the package
used it.

Counted as :class:`gem_parallel.CollectiveBytes` counts (so a measurement reads the same quantity): an
all-to-all by the tensor a rank sends (its own part included), a reduce-scatter by its input, an all-gather
by its output, an all-reduce by its tensor (a ring moves ``2 (n-1)/n`` of that over the wire).

Tables are placed by :func:`gem_parallel.sparse.plan.make_plan`'s rule: a table over ``1/G`` of the total
bytes is row-wise over the sharding group of ``G`` ranks, the others table-wise. Per step, every rank:

- sends its ids (``id_bytes`` each) and one length per (feature, sample) to the tables' owners (all-to-all);
- gets back one ``D``-wide fp32 row per sequence id and per pooled (feature, sample); table-wise and
  sequence shards send those rows by all-to-all, a row-wise pooled table by a reduce-scatter of the partial
  sums of the whole group's batch (``G x B x D`` per feature and rank); the backward moves the same volume
  the other way (all-to-all, or an all-gather for row-wise pooled gradients);
- 2D: all-reduces its shard (weights + row-wise state) over the ``R`` replicas every ``sync_every`` steps;
- fully sharded 2D: all-gathers the shard before the lookup and reduce-scatters it after the update, every
  step, keeping ``1/R`` of it in between (the gathered shard is transient: peak = shard + shard / R).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SparseCosts", "Table", "sparse_costs"]


@dataclass(frozen=True)
class Table:
    """One table and how a sample uses it.

    Args:
        rows / dim: the table's shape (fp32 rows plus one fp32 row-wise Adagrad accumulator per row).
        ids_per_sample: mean ids a sample looks up in it.
        pooled: True for a sum-pooled bag (one row per sample), False for a sequence (one row per id).
    """

    name: str
    rows: int
    dim: int
    ids_per_sample: float
    pooled: bool

    @property
    def bytes(self) -> int:
        return self.rows * (self.dim * 4 + 4)


@dataclass(frozen=True)
class SparseCosts:
    """Per-rank bytes: ``resident`` (tables + state between steps), ``peak`` (during the step), and per step
    ``all_to_all``, ``reduce_scatter``, ``all_gather``, ``all_reduce`` (see the module docstring)."""

    strategy: str
    world: int
    group: int
    replicas: int
    table_bytes: int
    resident: float
    peak: float
    all_to_all: float
    reduce_scatter: float
    all_gather: float
    all_reduce: float

    def as_dict(self) -> dict[str, float | int | str]:
        return dict(self.__dict__)


def sparse_costs(
    tables: list[Table],
    *,
    world: int,
    group: int,
    strategy: str,
    batch_per_rank: int,
    sync_every: int = 1,
    id_bytes: int = 8,
    length_bytes: int = 8,
) -> SparseCosts:
    """The model's per-rank bytes for ``strategy`` ("1d", "2d", "fully_sharded_2d") on ``world`` ranks in
    sharding groups of ``group`` (1D: ``group == world``)."""
    if world % group:
        raise ValueError(f"sparse_costs: group={group} does not divide world={world}")
    if strategy == "1d" and group != world:
        raise ValueError("sparse_costs: 1d shards over the world (group == world)")
    replicas = world // group
    total = sum(t.bytes for t in tables)
    b = batch_per_rank
    ids = sum(t.ids_per_sample for t in tables) * b
    a2a = ids * id_bytes + len(tables) * b * length_bytes
    rs = ag = 0.0
    for t in tables:
        row = t.dim * 4
        if not t.pooled:
            a2a += 2 * t.ids_per_sample * b * row  # forward rows, backward row gradients
        elif t.bytes * group > total and group > 1:  # row-wise pooled: partial sums of the group's batch
            rs += group * b * row
            ag += group * b * row
        else:
            a2a += 2 * b * row
    shard = total / group
    resident = peak = shard
    all_reduce = 0.0
    if strategy == "2d" and replicas > 1:
        all_reduce = shard / sync_every
    elif strategy == "fully_sharded_2d" and replicas > 1:
        resident = shard / replicas
        peak = shard + resident
        ag += shard
        rs += shard
    return SparseCosts(strategy, world, group, replicas, total, resident, peak, a2a, rs, ag, all_reduce)
