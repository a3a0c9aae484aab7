"""The replicas of 2D sparse parallelism: every copy of a shard kept equal across its replica group.

- :class:`ReplicaSync` (2D): TorchRec ``DMPCollection.sync``'s schedule on any device: every ``sync_every``
  steps, average the weights and the row-wise Adagrad accumulators of every TBE kernel over the replica
  group (one ``allreduce_coalesced`` per dtype; gloo and NCCL both run it).
- :class:`FullyShardedReplicas` (fully sharded 2D): each rank of a replica group keeps only its ``1/R``
  slice of the shard (weights and accumulators, flattened per kernel). Before the lookup the slices are
  all-gathered into the kernel's storage; after the fused update the full copies are reduce-scattered
  (averaged) back into the slices and the kernel's storage is freed (``untyped_storage().resize_(0)``, as
  FSDP2 does), so between steps a rank holds ``shard / R``.
"""

from __future__ import annotations

# First: the torchrec/fbgemm stack check (a clear error on a mismatched stack), then torchrec.
import gem_parallel._stack  # noqa: F401

# isort: split

from collections import defaultdict

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torch import Tensor, nn

__all__ = ["FullyShardedReplicas", "ReplicaSync", "tbe_kernels", "tbe_storage"]

# torch 2.13 names them *_single and deprecates the *_tensor names with a FutureWarning on every call; 2.11
# has only the latter.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def tbe_kernels(module: nn.Module) -> list[SplitTableBatchedEmbeddingBagsCodegen]:
    """Every fbgemm TBE kernel (the sharded tables' storage) inside ``module``, in a fixed order.

    Sharded TorchRec modules keep their lookups in a plain ``_lookups`` list, not as registered children:
    walk those too, as ``DMPCollection._group_sharded_modules`` does.
    """
    found: list[SplitTableBatchedEmbeddingBagsCodegen] = []
    seen: set[int] = set()

    def walk(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen):
            found.append(m)
        for lookup in getattr(m, "_lookups", None) or []:
            if isinstance(lookup, nn.Module):
                walk(lookup)
        for _, child in m.named_children():
            walk(child)

    walk(module)
    return found


def _flat(kernel: nn.Module, prefix: str) -> Tensor:
    # A TBE keeps its weights (and each optimizer state) in one flat tensor, on the device (``_dev``),
    # the host (``_host``, the CPU kernels) or in unified memory (``_uvm``); the empty ones have 0 elements.
    tensors = [getattr(kernel, f"{prefix}_{where}") for where in ("dev", "host", "uvm")]
    full = [t for t in tensors if t.numel() > 0]
    if len(full) > 1:
        raise NotImplementedError(
            f"a TBE kernel with {prefix} in two memories (UVM caching) is not supported"
        )
    return full[0] if full else tensors[1]


def tbe_storage(kernel: SplitTableBatchedEmbeddingBagsCodegen) -> list[Tensor]:
    """The flat tensors that hold a TBE kernel's state: weights, then the row-wise Adagrad accumulator."""
    return [_flat(kernel, "weights"), _flat(kernel, "momentum1")]


class ReplicaSync:
    """Average every TBE kernel's weights and row-wise state over ``replica_group`` (2D sparse).

    Args:
        module: the sharded module (its TBE kernels are found once).
        replica_group: the ranks holding the same shards (``None`` or size 1: nothing to sync).
        sync_every: :meth:`step` syncs on every ``sync_every``-th call.
    """

    def __init__(
        self, module: nn.Module, replica_group: dist.ProcessGroup | None, sync_every: int = 1
    ) -> None:
        self.group = replica_group
        self.sync_every = sync_every
        self.steps = 0
        by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
        for kernel in tbe_kernels(module):
            for w in kernel.split_embedding_weights():
                by_dtype[w.dtype].append(w)
            for state in kernel.get_optimizer_state():
                by_dtype[state["sum"].dtype].append(state["sum"])
        self._tensors = [[t for t in ts if t.numel() > 0] for ts in by_dtype.values()]

    @property
    def replicas(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def sync(self) -> None:
        """Average now (collective over the replica group)."""
        if self.replicas == 1:
            return
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]
        for tensors in self._tensors:
            if tensors:
                self.group.allreduce_coalesced(tensors, opts).wait()  # type: ignore[union-attr]

    def step(self) -> bool:
        """Count a training step; sync if it is a ``sync_every``-th one. Returns whether it synced."""
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self.sync()
            return True
        return False


class FullyShardedReplicas:
    """Fully sharded 2D: each replica keeps ``1/R`` of its shard, gathered for a step, reduced after.

    Args:
        module: the sharded module (forward pre-hook: :meth:`gather`).
        replica_group: the ``R`` ranks that hold the same shard.

    Between steps every TBE tensor has 0 bytes of storage and ``slices`` holds this rank's part: element
    range ``[r * n / R, (r + 1) * n / R)`` of the flattened tensor padded to a multiple of ``R``.
    """

    def __init__(self, module: nn.Module, replica_group: dist.ProcessGroup) -> None:
        self.group = replica_group
        self.replicas = dist.get_world_size(replica_group)
        self.rank = dist.get_rank(replica_group)
        self._full = [t for k in tbe_kernels(module) for t in tbe_storage(k) if t.numel() > 0]
        self._numel = [t.numel() for t in self._full]
        self._nbytes = [t.untyped_storage().nbytes() for t in self._full]
        self.slices: list[Tensor] = []
        for t in self._full:
            chunk = -(-t.numel() // self.replicas)
            padded = torch.zeros(chunk * self.replicas, dtype=t.dtype, device=t.device)
            padded[: t.numel()] = t.detach().reshape(-1)
            self.slices.append(padded[self.rank * chunk : (self.rank + 1) * chunk].clone())
        self.gathered = True
        self.free()
        self._hook = module.register_forward_pre_hook(lambda mod, args: self.gather())

    @property
    def slice_bytes(self) -> int:
        """Bytes this rank keeps between steps."""
        return sum(s.numel() * s.element_size() for s in self.slices)

    def gather(self) -> None:
        """All-gather the slices into the kernels' storage (no-op if already gathered)."""
        if self.gathered:
            return
        for t, piece, numel, nbytes in zip(self._full, self.slices, self._numel, self._nbytes):
            out = torch.empty(piece.numel() * self.replicas, dtype=piece.dtype, device=piece.device)
            _all_gather_single(out, piece, group=self.group)
            with torch.no_grad():
                t.untyped_storage().resize_(nbytes)
                t.view(-1).copy_(out[:numel])
        self.gathered = True

    def reshard(self) -> None:
        """Reduce-scatter (average) the full copies into the slices, then free the kernels' storage."""
        if not self.gathered:
            return
        for i, (t, piece, numel) in enumerate(zip(self._full, self.slices, self._numel)):
            full = torch.zeros(piece.numel() * self.replicas, dtype=piece.dtype, device=piece.device)
            full[:numel] = t.detach().reshape(-1)
            out = torch.empty_like(piece)
            # gloo has no AVG reduce-scatter: sum, then divide.
            _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=self.group)
            self.slices[i] = out.div_(self.replicas)
        self.free()

    def free(self) -> None:
        """Drop the kernels' storage (their tensors keep shape and identity; only the bytes go)."""
        for t in self._full:
            t.untyped_storage().resize_(0)
        self.gathered = False
