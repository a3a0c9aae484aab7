"""FSDP2 (``fully_shard``) of the dense parameters: a unit per layer, the experts on their own mesh, the root.

- Dense parameters are sharded over ``dp_shard`` and, with ``dp_replicate > 1``, replicated over
  ``dp_replicate`` (HSDP: gradients reduce-scatter inside a shard group, then all-reduce across replicas).
- Experts (held by expert parallelism, different on each EP rank) are sharded over ``efsdp`` (HSDP with
  ``dp_replicate``), FSDP's plain average over their mesh; expert parallelism has already scaled their
  gradients so that this average is the world's (see :mod:`gem_parallel.expert`).
- Units, innermost first: each expert, each entry of ``model.layers``, ``model.embeddings`` when FSDP owns
  the tables, then the root (everything else). ``ignored_params`` (the embedding tables when TorchRec shards
  them) stay out of FSDP altogether.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from gem_parallel.config import FSDPConfig
from gem_parallel.dims import ParallelDims

__all__ = ["apply_fsdp", "dense_fsdp_mesh", "expert_fsdp_mesh", "mixed_precision_policy"]


def dense_fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh dense parameters are sharded on: ``(dp_replicate, dp_shard)`` (HSDP) or ``(dp_shard,)``."""
    # dp_shard is a flattened axis: its 1-D mesh is the one flattening made (flattening again with the same
    # name returns it), not a slice of the root mesh, which torch deprecates with a warning on every run.
    if dims.dp_replicate == 1:
        return mesh["efsdp", "ep"]._flatten("dp_shard")
    # (dp_replicate, flattened dp_shard) has no other spelling in torch 2.11-2.13 than this slice.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh["dp_replicate", "dp_shard"]


def expert_fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh expert parameters are sharded on: ``(dp_replicate, efsdp)`` (HSDP) or ``(efsdp,)``."""
    return mesh["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else mesh["efsdp"]


def mixed_precision_policy(config: FSDPConfig) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``config``: parameters gathered in ``param_dtype``, gradients reduced in
    ``reduce_dtype`` (None: as they are)."""
    return MixedPrecisionPolicy(
        param_dtype=_dtype(config.param_dtype), reduce_dtype=_dtype(config.reduce_dtype)
    )


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype of an FSDPConfig, which has turned dtype names into dtypes in ``__post_init__``."""
    assert not isinstance(value, str), value
    return value


def _shard_experts(experts: Iterable[nn.Module], mesh: DeviceMesh, config: FSDPConfig) -> list[FSDPModule]:
    return [
        fully_shard(
            expert,
            mesh=mesh,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=mixed_precision_policy(config),
        )
        for expert in experts
    ]


def _set_prefetch(layers: Sequence[FSDPModule], depth: int) -> None:
    """Layer ``i`` issues the all-gathers of layers ``i+1..i+depth`` in forward and ``i-1..i-depth`` in
    backward, so each layer's communication overlaps its neighbour's compute."""
    if depth == 0 or len(layers) < 2:
        return
    for i, layer in enumerate(layers):
        ahead = list(layers[i + 1 : i + 1 + depth])
        behind = list(layers[max(0, i - depth) : i])[::-1]
        if ahead:
            layer.set_modules_to_forward_prefetch(ahead)
        if behind:
            layer.set_modules_to_backward_prefetch(behind)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    config: FSDPConfig,
    *,
    experts: Sequence[nn.Module] = (),
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """``fully_shard`` the experts, each layer of ``model.layers``, the embeddings (unless ignored), the root.

    Args:
        model: a model with a ``layers`` ModuleDict (or ModuleList) of blocks.
        mesh: the dense mesh of :meth:`ParallelDims.build_mesh`.
        dims: its degrees.
        config: FSDP2 settings.
        experts: the expert modules this rank holds (from expert parallelism): sharded on
            :func:`expert_fsdp_mesh`.
        ignored_params: parameters FSDP must leave alone (the embedding tables TorchRec shards).

    Returns:
        ``model``, now an ``FSDPModule`` (FSDP2 changes the classes in place).
    """
    mp = mixed_precision_policy(config)
    ignored = set(ignored_params or ())
    dense_mesh = dense_fsdp_mesh(mesh, dims)
    _shard_experts(experts, expert_fsdp_mesh(mesh, dims), config)
    layers = model.layers
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else cast(nn.ModuleList, layers))
    units: list[FSDPModule] = []
    for i, block in enumerate(blocks):
        # The last layer's parameters are the first backward needs: keep them gathered.
        reshard = config.reshard_after_forward and i < len(blocks) - 1
        units.append(fully_shard(block, mesh=dense_mesh, reshard_after_forward=reshard, mp_policy=mp))
    embeddings = getattr(model, "embeddings", None)
    if isinstance(embeddings, nn.Module) and any(p not in ignored for p in embeddings.parameters()):
        fully_shard(embeddings, mesh=dense_mesh, reshard_after_forward=config.reshard_after_forward,
                    mp_policy=mp, ignored_params=ignored or None)  # fmt: skip
    fully_shard(
        model, mesh=dense_mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=mp,
        ignored_params=ignored or None,
    )  # fmt: skip
    _set_prefetch(units, config.prefetch)
    return model
