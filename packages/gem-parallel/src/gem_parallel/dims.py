"""``ParallelDims``: the degrees of every parallel axis, checked in one place, and the meshes they make.

Dense side (one mesh over all ranks, axes laid out by network tier, fastest innermost)::

    rank = r * dp_shard + f * ep + e        r < dp_replicate, f < efsdp = dp_shard // ep, e < ep

- ``ep`` (innermost: inside a host): the expert-parallel group. Its ranks all-gather activations and
  reduce-scatter expert outputs every layer, the most bandwidth-hungry collective, so it stays on NVLink.
- ``dp_shard`` = ``efsdp x ep`` (next): the FSDP shard group (reduce-scatter of gradients, all-gather of
  parameters). Expert parameters are FSDP-sharded over ``efsdp`` only (each EP rank holds other experts).
- ``dp_replicate`` (outermost): HSDP replicas (one gradient all-reduce per step, across hosts or zones).

Sparse side (a second mesh over the same ranks, TorchRec's 2D layout)::

    rank = g * sparse_replicas + r          g < sparse_group, r < sparse_replicas = world // sparse_group

A sharding group (``sparse_shard`` axis, fixed ``r``) is ranks ``[r, R + r, 2R + r, ...]``: tables are
model-parallel inside it. A replica group (``sparse_replicate`` axis, fixed ``g``) is ``R`` consecutive ranks,
so a shard's replicas sit on one host and their weight sync stays intra-host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DENSE_AXES", "SPARSE_AXES", "ParallelDims"]

DENSE_AXES = ("dp_replicate", "efsdp", "ep")
SPARSE_AXES = ("sparse_shard", "sparse_replicate")


def _default_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _default_ranks_per_host(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism; ``-1`` means "whatever the world size leaves".

    Args:
        dp_replicate: HSDP replicas of the dense parameters (outermost axis).
        dp_shard: FSDP shard group size of the dense parameters; ``-1`` = ``world // dp_replicate``.
        ep: expert-parallel degree (innermost axis, a divisor of ``dp_shard``): each EP rank holds
            ``n_experts / ep`` experts of every expert ensemble.
        sparse_group: ranks per embedding sharding group; ``-1`` = the world (1D sharding). Smaller groups
            give 2D sparse parallelism with ``world // sparse_group`` replicas per shard.
        world_size: total ranks; default: the process group's size, else ``$WORLD_SIZE``, else 1.
        ranks_per_host: ranks on one host (first network tier); default ``$LOCAL_WORLD_SIZE`` or the world.
        hosts_per_zone: hosts per zone (second tier: a rack or a network zone); None = one zone.

    Raises:
        ValueError: naming the axis, when sizes are not positive or do not multiply to the world size.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    sparse_group: int = -1
    world_size: int | None = None
    ranks_per_host: int | None = None
    hosts_per_zone: int | None = None
    _resolved: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        world = _default_world_size() if self.world_size is None else self.world_size
        _check_positive("world_size", world)
        for name in ("dp_replicate", "ep"):
            _check_positive(name, getattr(self, name))
        for name in ("dp_shard", "sparse_group"):
            v = getattr(self, name)
            if v != -1:
                _check_positive(name, v, allow_auto=True)
        if world % self.dp_replicate:
            raise ValueError(
                f"ParallelDims: dp_replicate={self.dp_replicate} does not divide world_size={world}"
            )
        dp_shard = world // self.dp_replicate if self.dp_shard == -1 else self.dp_shard
        if self.dp_replicate * dp_shard != world:
            raise ValueError(
                f"ParallelDims: dp_replicate * dp_shard = {self.dp_replicate} * {dp_shard} = "
                f"{self.dp_replicate * dp_shard} != world_size={world} (set dp_shard=-1 to fill)"
            )
        if dp_shard % self.ep:
            raise ValueError(
                f"ParallelDims: ep={self.ep} must divide dp_shard={dp_shard} (experts are split inside "
                "the FSDP shard group)"
            )
        sparse = world if self.sparse_group == -1 else self.sparse_group
        if world % sparse:
            raise ValueError(f"ParallelDims: sparse_group={sparse} does not divide world_size={world}")
        per_host = _default_ranks_per_host(world) if self.ranks_per_host is None else self.ranks_per_host
        _check_positive("ranks_per_host", per_host)
        if world % per_host and per_host < world:
            raise ValueError(f"ParallelDims: ranks_per_host={per_host} does not divide world_size={world}")
        if self.hosts_per_zone is not None:
            _check_positive("hosts_per_zone", self.hosts_per_zone)
        object.__setattr__(self, "world_size", world)
        object.__setattr__(self, "dp_shard", dp_shard)
        object.__setattr__(self, "sparse_group", sparse)
        object.__setattr__(self, "ranks_per_host", min(per_host, world))
        object.__setattr__(self, "_resolved", True)

    # -- derived degrees ----------------------------------------------------------------------------------

    @property
    def _world(self) -> int:
        """``world_size`` as __post_init__ resolved it (an int from then on)."""
        assert self.world_size is not None
        return self.world_size

    @property
    def _per_host(self) -> int:
        """``ranks_per_host`` as __post_init__ resolved it."""
        assert self.ranks_per_host is not None
        return self.ranks_per_host

    @property
    def dp(self) -> int:
        """Data-parallel degree of the dense parameters (every rank reads its own batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """FSDP shard degree of expert parameters (``dp_shard // ep``)."""
        return self.dp_shard // self.ep

    @property
    def sparse_replicas(self) -> int:
        """Copies of every embedding shard (1 for 1D sharding)."""
        return self._world // self.sparse_group

    @property
    def expert_gradient_divide_factor(self) -> int:
        """What expert gradients must be divided by to average over the world's batches.

        An expert sees the EP group's gathered batch, so its gradient already sums ``ep`` ranks' losses;
        FSDP over its ``dp_replicate x efsdp`` mesh averages over ``world // ep`` copies. Dividing by the
        world size (not ``world // ep``) gives the same gradient as the dense parameters' average.
        """
        return self._world

    # -- rank layout --------------------------------------------------------------------------------------

    def dense_coordinates(self, rank: int) -> dict[str, int]:
        """``{"dp_replicate", "efsdp", "ep", "dp_shard"}`` coordinates of ``rank`` on the dense mesh."""
        r, rest = divmod(rank, self.dp_shard)
        f, e = divmod(rest, self.ep)
        return {"dp_replicate": r, "efsdp": f, "ep": e, "dp_shard": rest}

    def sparse_coordinates(self, rank: int) -> dict[str, int]:
        """``{"sparse_shard", "sparse_replicate"}`` coordinates of ``rank`` on the sparse mesh."""
        g, r = divmod(rank, self.sparse_replicas)
        return {"sparse_shard": g, "sparse_replicate": r}

    def sparse_sharding_group(self, rank: int) -> list[int]:
        """Ranks of ``rank``'s embedding sharding group (strided: ``[r, R + r, 2R + r, ...]``)."""
        r = rank % self.sparse_replicas
        return list(range(r, self._world, self.sparse_replicas))

    def sparse_replica_group(self, rank: int) -> list[int]:
        """Ranks holding the same embedding shards as ``rank`` (consecutive: one host)."""
        start = rank - rank % self.sparse_replicas
        return list(range(start, start + self.sparse_replicas))

    def tier(self, ranks: list[int]) -> str:
        """The slowest network tier a collective over ``ranks`` crosses: "host", "zone" or "cluster"."""
        hosts = {r // self._per_host for r in ranks}
        if len(hosts) <= 1:
            return "host"
        if self.hosts_per_zone is None:
            return "cluster"
        return "zone" if len({h // self.hosts_per_zone for h in hosts}) <= 1 else "cluster"

    def axis_tiers(self, rank: int = 0) -> dict[str, str]:
        """For each axis, the slowest tier its group (the one holding ``rank``) crosses."""
        c = self.dense_coordinates(rank)
        base = c["dp_replicate"] * self.dp_shard
        groups = {
            "ep": [base + c["efsdp"] * self.ep + e for e in range(self.ep)],
            "dp_shard": [base + s for s in range(self.dp_shard)],
            "dp_replicate": [r * self.dp_shard + c["dp_shard"] for r in range(self.dp_replicate)],
            "sparse_shard": self.sparse_sharding_group(rank),
            "sparse_replicate": self.sparse_replica_group(rank),
        }
        return {axis: self.tier(ranks) for axis, ranks in groups.items()}

    # -- meshes -------------------------------------------------------------------------------------------

    def _check_world(self) -> None:
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims: world_size={self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The dense mesh: axes ``dp_replicate``, ``efsdp``, ``ep``, plus the flattened ``dp_shard``
        (= ``efsdp x ep``) and ``dp`` (all three). Collective: call it on every rank, in the same order.
        """
        self._check_world()
        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.efsdp, self.ep), mesh_dim_names=DENSE_AXES
        )
        mesh["efsdp", "ep"]._flatten("dp_shard")
        mesh["dp_replicate", "efsdp", "ep"]._flatten("dp")
        mesh["dp_replicate", "efsdp"]._flatten("expert_dp")
        return mesh

    def build_sparse_mesh(self, device_type: str) -> DeviceMesh:
        """The sparse mesh: ``sparse_shard`` (a sharding group) x ``sparse_replicate`` (its replicas).
        Collective, like :meth:`build_mesh`."""
        self._check_world()
        return init_device_mesh(
            device_type, (self.sparse_group, self.sparse_replicas), mesh_dim_names=SPARSE_AXES
        )


def _check_positive(name: str, value: object, allow_auto: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        auto = " or -1 (fill)" if allow_auto else ""
        raise ValueError(f"ParallelDims: {name} must be a positive int{auto}, got {value!r}")
