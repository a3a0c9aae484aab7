"""``shard_embeddings``: the model's TorchRec tables sharded by ``DistributedModelParallel``, 1D or 2D.

- ``"1d"``: every table sharded over all ranks (one sharding group; TorchRec's baseline).
- ``"2d"``: ``DistributedModelParallel`` on each sharding group (the ``sparse_shard`` axis of
  :meth:`ParallelDims.build_sparse_mesh`, ``G = dims.sparse_group`` ranks); the ``R`` groups are replicas of
  each other, averaged (weights and row-wise Adagrad state) over the ``sparse_replicate`` axis every
  ``sync_every`` steps: TorchRec ``DMPCollection``'s schedule, built so that it also runs on the CPU.
- ``"fully_sharded_2d"``: 2D where each replica keeps only ``1/R`` of its shard between steps
  (:class:`~gem_parallel.sparse.replicas.FullyShardedReplicas`); replicas are reconciled every step.

The optimizer is ``EXACT_ROWWISE_ADAGRAD`` fused into the TBE backward: no table gradient is materialized.
A table's gradient is that of the *mean* of its sharding group's per-rank losses (TorchRec divides the
gradient by the group size in the backward all-to-all, as DDP averages dense gradients); 2D replicas then
average, so every strategy optimizes the mean over all ranks. The model object is kept (its ``embeddings``
children are swapped for sharded ones in place) and gets a ``sparse_sharding`` attribute, the
:class:`SparseSharding` handle whose :meth:`~SparseSharding.step` the trainer calls after every optimizer
step.
"""

from __future__ import annotations

# First: the torchrec/fbgemm stack check (a clear error on a mismatched stack), then torchrec.
import gem_parallel._stack  # noqa: F401

# isort: split

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.remote_device import _remote_device
from torch.distributed.tensor import DTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.shards_wrapper import LocalShardsWrapper
from torchrec.distributed.types import ShardingEnv, ShardingEnv2D, ShardingPlan

from gem_parallel.config import EMBEDDING_STRATEGIES
from gem_parallel.dims import SPARSE_AXES, ParallelDims
from gem_parallel.sparse.plan import (
    PlanError,
    TableInfo,
    check_plan,
    check_plans_agree,
    embedding_tables,
    make_plan,
    rank_bytes,
)
from gem_parallel.sparse.replicas import FullyShardedReplicas, ReplicaSync, tbe_kernels, tbe_storage
from gem_parallel.sparse.sharders import gem_sharders

__all__ = ["SparseSharding", "check_sharding", "local_pieces", "shard_embeddings", "sparse_sharding"]


@dataclass
class SparseSharding:
    """What :func:`shard_embeddings` set up, and the per-step hook of the trainer.

    Attributes:
        strategy: "1d", "2d" or "fully_sharded_2d".
        plan: the TorchRec plan of one sharding group (ranks are group-local), equal on every rank.
        dmp: the ``DistributedModelParallel`` (``init_data_parallel=False``) over the sharding group.
        group_size / replicas: ``G`` and ``R`` (``G x R`` = world).
        tables: the tables as they were before sharding.
        replica_sync: 2D weight/state averaging (None for 1D and fully sharded 2D).
        fully_sharded: the slices of fully sharded 2D (None otherwise).
    """

    strategy: str
    plan: ShardingPlan
    dmp: DistributedModelParallel
    group_size: int
    replicas: int
    tables: list[TableInfo] = field(default_factory=list)
    replica_sync: ReplicaSync | None = None
    fully_sharded: FullyShardedReplicas | None = None
    steps: int = field(default=0)

    @property
    def fused_optimizer(self) -> Any:
        """TorchRec's ``KeyedOptimizer`` of the fused tables (learning rate, ``state_dict`` of the state)."""
        return self.dmp.fused_optimizer

    def step(self) -> None:
        """Call once after each optimizer step (after the backward, which already updated the tables).

        2D: averages the replicas every ``sync_every``-th call. Fully sharded 2D: reduce-scatters the updated
        shard into the slices and frees it. 1D: nothing. Collective over the replica group for 2D strategies.
        """
        self.steps += 1
        if self.replica_sync is not None:
            self.replica_sync.step()
        if self.fully_sharded is not None:
            self.fully_sharded.reshard()

    def sync(self) -> None:
        """2D: average the replicas now (e.g. before a checkpoint or an evaluation)."""
        if self.replica_sync is not None:
            self.replica_sync.sync()

    def materialize(self) -> None:
        """Fully sharded 2D: gather the shard into the kernels (before ``state_dict`` or load); else no-op."""
        if self.fully_sharded is not None:
            self.fully_sharded.gather()

    def prepare_checkpoint(self) -> None:
        """Call before ``state_dict()`` for a checkpoint: 2D syncs the replicas (DCP writes one copy of each
        shard, so unsynced replicas would lose their differences); fully sharded 2D gathers the shard."""
        self.sync()
        self.materialize()

    def local_bytes(self) -> int:
        """Bytes of table weights and row-wise state this rank holds between steps."""
        if self.fully_sharded is not None:
            return self.fully_sharded.slice_bytes
        return sum(t.numel() * t.element_size() for k in tbe_kernels(self.dmp.module) for t in tbe_storage(k))


def sparse_sharding(model: nn.Module) -> SparseSharding:
    """The :class:`SparseSharding` handle of a model returned by :func:`shard_embeddings`."""
    handle = getattr(model, "sparse_sharding", None)
    if not isinstance(handle, SparseSharding):
        raise ValueError(f"{type(model).__name__} was not sharded by gem_parallel.sparse.shard_embeddings")
    return handle


def _tables_module(model: nn.Module) -> nn.Module:
    embeddings = getattr(model, "embeddings", None)
    if not isinstance(embeddings, nn.Module):
        raise PlanError(
            f"shard_embeddings: {type(model).__name__} has no `embeddings` module holding its tables"
        )
    embedding_tables(embeddings)  # raises if it holds no TorchRec collection
    return embeddings


def _validate(dims: ParallelDims, mesh: DeviceMesh | None, strategy: str, sync_every: int) -> None:
    if strategy not in EMBEDDING_STRATEGIES:
        raise ValueError(
            f"shard_embeddings: strategy must be one of {EMBEDDING_STRATEGIES}, got {strategy!r}"
        )
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"shard_embeddings: sync_every must be an int >= 1, got {sync_every!r}")
    if not dist.is_initialized():
        raise RuntimeError("shard_embeddings needs an initialized process group (torch.distributed)")
    world = dist.get_world_size()
    if dims.world_size != world:
        raise ValueError(
            f"shard_embeddings: dims.world_size={dims.world_size} but the process group has {world}"
        )
    if world % dims.sparse_group:
        raise PlanError(
            f"shard_embeddings: sparse_group={dims.sparse_group} does not divide the world ({world})"
        )
    if strategy == "1d" and dims.sparse_group != world:
        raise ValueError(
            f"shard_embeddings: strategy '1d' shards over all {world} ranks, but dims.sparse_group="
            f"{dims.sparse_group}; use strategy '2d' (or sparse_group=-1)"
        )
    if mesh is None:
        raise ValueError("shard_embeddings: pass the sparse mesh (dims.build_sparse_mesh(device_type))")
    if tuple(mesh.mesh_dim_names or ()) != SPARSE_AXES or tuple(mesh.shape) != (
        dims.sparse_group,
        dims.sparse_replicas,
    ):
        raise ValueError(
            f"shard_embeddings: mesh must be dims.build_sparse_mesh's (axes {SPARSE_AXES}, shape "
            f"{(dims.sparse_group, dims.sparse_replicas)}), got {mesh.mesh_dim_names} {tuple(mesh.shape)}"
        )


def _device(tables: nn.Module) -> torch.device:
    return next((p.device for p in tables.parameters()), torch.device("cpu"))


def check_sharding(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    *,
    strategy: str = "1d",
    plan: ShardingPlan | None = None,
    sync_every: int = 1,
    lr: float = 0.05,
    eps: float = 1e-8,
    memory_per_rank: int | None = None,
) -> ShardingPlan:
    """Everything :func:`shard_embeddings` checks, with no collective; returns the (group-local) plan.

    Raises:
        ValueError / PlanError: the same error on every rank (all inputs are the same on every rank).
    """
    _validate(dims, mesh, strategy, sync_every)
    tables = _tables_module(model)
    sharders = gem_sharders(lr, eps)
    group, replicas = dims.sparse_group, dims.sparse_replicas
    # Fully sharded 2D gathers the whole shard for the step while keeping its own slice.
    resident = 1.0 + 1.0 / replicas if strategy == "fully_sharded_2d" and replicas > 1 else 1.0
    device = _device(tables)
    if plan is None:
        return make_plan(tables, group, sharders, device_type=device.type, memory_per_rank=memory_per_rank,
                         resident_factor=resident)  # fmt: skip
    check_plan(tables, plan, group, memory_per_rank=memory_per_rank, resident_factor=resident)
    return plan


def shard_embeddings(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    *,
    strategy: str = "1d",
    plan: ShardingPlan | None = None,
    sync_every: int = 1,
    lr: float = 0.05,
    eps: float = 1e-8,
    memory_per_rank: int | None = None,
) -> nn.Module:
    """Shard ``model.embeddings``'s TorchRec tables with the fused row-wise Adagrad; see the module docstring.

    Args:
        model: holds its tables in ``model.embeddings`` (e.g. ``gem_model.GemModel``), on its device.
        dims: the degrees (``dims.sparse_group`` = ranks per sharding group ``G``).
        mesh: ``dims.build_sparse_mesh(device_type)``.
        strategy: "1d" (needs ``sparse_group`` = world), "2d" or "fully_sharded_2d".
        plan: a TorchRec ``ShardingPlan`` for one sharding group (group-local ranks); default
            :func:`~gem_parallel.sparse.plan.make_plan`'s. Checked either way.
        sync_every: 2D: optimizer steps between replica syncs.
        lr / eps: of the fused ``EXACT_ROWWISE_ADAGRAD``.
        memory_per_rank: bytes of tables + row-wise state one rank may hold; None = no limit.

    Returns:
        ``model``, its collections replaced by sharded ones, with ``model.sparse_sharding`` set.

    Raises:
        ValueError / PlanError: a misconfiguration or a plan that cannot fit, on every rank, before any
            collective.
    """
    plan = check_sharding(
        model, dims, mesh, strategy=strategy, plan=plan, sync_every=sync_every, lr=lr, eps=eps,
        memory_per_rank=memory_per_rank,
    )  # fmt: skip
    assert mesh is not None
    tables = _tables_module(model)
    infos = embedding_tables(tables)
    group, replicas = dims.sparse_group, dims.sparse_replicas
    sharders = gem_sharders(lr, eps)
    device = _device(tables)
    # --- collectives from here on: every rank has passed the same checks ---
    check_plans_agree(plan)
    env, replica_pg, placed = _sharding_env(dims, plan, device)
    # DistributedModelParallel initialises the shards afresh: keep the unsharded weights to copy in.
    initial = {k: v.detach() for k, v in tables.state_dict().items() if not v.is_meta}
    dmp = DistributedModelParallel(
        tables, env=env, device=device, plan=placed, sharders=sharders, init_data_parallel=False
    )
    if dmp.module is not tables:  # a torchrec change: we rely on the in-place swap
        raise RuntimeError("DistributedModelParallel did not shard the embeddings in place")
    _copy_into_shards(tables, initial)
    handle = SparseSharding(strategy, plan, dmp, group, replicas, infos)
    if replica_pg is not None:
        # Start from equal replicas whatever each rank initialised, then keep them so.
        first = ReplicaSync(tables, replica_pg, sync_every if strategy == "2d" else 1)
        first.sync()
        if strategy == "2d":
            handle.replica_sync = first
        else:
            handle.fully_sharded = FullyShardedReplicas(tables, replica_pg)
    model.sparse_sharding = handle  # type: ignore[assignment]
    return model


def _sharding_env(
    dims: ParallelDims, plan: ShardingPlan, device: torch.device
) -> tuple[ShardingEnv, dist.ProcessGroup | None, ShardingPlan]:
    """TorchRec's environment for this rank, the replica group, and the plan with global ranks.

    1D: the world. 2D: ``ShardingEnv2D``, what ``DMPCollection`` builds (it asserts CUDA; this does not):
    a ("replicate", "shard") mesh whose row ``r`` is sharding group ``[r, R + r, ...]`` (the sparse mesh of
    :class:`ParallelDims`, transposed), and the group-local plan remapped to those global ranks.
    """
    world, group, replicas = dims._world, dims.sparse_group, dims.sparse_replicas
    if replicas == 1:
        return ShardingEnv.from_process_group(dist.group.WORLD), None, plan  # type: ignore[arg-type]
    layout = torch.arange(world).view(group, replicas).T.contiguous()
    mesh = DeviceMesh(device.type, layout, mesh_dim_names=("replicate", "shard"))
    sharding_pg, replica_pg = mesh.get_group("shard"), mesh.get_group("replicate")
    env = ShardingEnv2D(
        sharding_pg=sharding_pg,
        replica_pg=replica_pg,
        global_pg=dist.group.WORLD,  # type: ignore[arg-type]
        device_mesh=mesh,
        node_group_size=dims.ranks_per_host,
    )
    return env, replica_pg, _global_plan(plan, dist.get_rank() % replicas, replicas, device)


def _global_plan(plan: ShardingPlan, first: int, step: int, device: torch.device) -> ShardingPlan:
    """``plan`` with group-local rank ``i`` replaced by global rank ``i * step + first`` (as
    ``DMPCollection._remap_sharding_plan`` does)."""
    placed = copy.deepcopy(plan)
    for module_plan in placed.plan.values():
        for ps in module_plan.values():  # type: ignore[attr-defined]
            ps.ranks = [r * step + first for r in ps.ranks or []]
            for shard in ps.sharding_spec.shards if ps.sharding_spec is not None else []:
                rank = shard.placement.rank() * step + first
                shard.placement = _remote_device(f"rank:{rank}/{device.type}")
    return placed


def local_pieces(t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(offsets, tensor)`` of each local shard of a sharded state-dict entry: a ``ShardedTensor`` (1D) or
    a ``DTensor`` over a ``LocalShardsWrapper`` (2D, TorchRec's 2D state dict); the tensors are views."""
    if isinstance(t, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in t.local_shards()]
    if isinstance(t, DTensor):
        local = t.to_local()
        if isinstance(local, LocalShardsWrapper):
            return [(tuple(o), s) for o, s in zip(local.local_offsets(), local.local_shards())]
        raise TypeError(f"unexpected DTensor local tensor {type(local).__name__}")
    return []


def _copy_into_shards(module: nn.Module, initial: dict[str, torch.Tensor]) -> None:
    """Copy each whole table of ``initial`` into this rank's shards of it (views of the TBE storage)."""
    for key, st in module.state_dict().items():
        if key not in initial:
            continue
        src = initial[key]
        with torch.no_grad():
            for offsets, piece in local_pieces(st):
                index = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
                piece.copy_(src[index])


def planned_rank_bytes(handle: SparseSharding) -> list[int]:
    """Bytes each rank of a sharding group holds under the handle's plan (weights + row-wise state)."""
    return rank_bytes(handle.tables, handle.plan, handle.group_size)
