"""``parallelize``: the one entry point that turns a model into its parallel, memory-saving training form.

It applies, in this order and only here (torchtitan's order):

1. precision conversion (gem-precision ``convert``, if ``config.precision``);
2. activation checkpointing per layer, and 3. per-layer ``torch.compile`` (one region per layer, the
   checkpoint traced inside the compiled function), plus FP8 storage of saved activations;
4. expert parallelism (every expert ensemble sharded over the ``ep`` axis);
5. FSDP2: the 8-bit all-gather's weight wrapping, then ``fully_shard`` of each expert (own mesh), each
   layer, the embeddings (unless TorchRec shards them) and the root; skipped on a one-rank mesh unless
   ``FSDPConfig.wrap_single_rank`` (see :func:`fsdp_applies`);
6. embedding sharding (the sparse half of gem-parallel), if ``config.embeddings``.

Everything that can be wrong with the request is checked first, without any collective, so every rank
raises the same error at once instead of leaving its peers waiting.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gem_parallel.all_gather import (
    check_quantized_all_gather,
    enable_quantized_all_gather,
    quantized_all_gather_targets,
)
from gem_parallel.checkpointing import (
    apply_activation_checkpointing,
    apply_saved_activation_compression,
    check_no_dropout,
)
from gem_parallel.config import ParallelConfig
from gem_parallel.dims import DENSE_AXES, ParallelDims
from gem_parallel.expert import apply_expert_parallel, check_expert_parallel, expert_ensembles
from gem_parallel.fsdp import apply_fsdp

__all__ = ["fsdp_applies", "parallelize"]


def fsdp_applies(dims: ParallelDims, config: ParallelConfig) -> bool:
    """Whether ``parallelize`` wraps the model in FSDP2: when the dense mesh has more than one rank, or
    ``config.fsdp.wrap_single_rank`` asks for it (on one rank FSDP2 has nothing to shard or reduce and only
    costs step time; the 8-bit all-gather is then off too, since nothing is gathered)."""
    return dims.dp_replicate * dims.dp_shard > 1 or config.fsdp.wrap_single_rank


def _sparse_params(model: nn.Module) -> set[nn.Parameter]:
    sparse_parameters = getattr(model, "sparse_parameters", None)
    if callable(sparse_parameters):
        return set(sparse_parameters())
    embeddings = getattr(model, "embeddings", None)
    if isinstance(embeddings, nn.Module):
        return set(embeddings.parameters())
    raise ValueError(
        "ParallelConfig.embeddings is set but the model has neither sparse_parameters() nor an "
        "`embeddings` module holding its tables"
    )


def _shard_sizes(
    model: nn.Module, dims: ParallelDims, config: ParallelConfig, names: list[str]
) -> dict[str, int]:
    """FSDP shard-group size of each named module: experts shard over ``efsdp`` under EP, the rest over
    ``dp_shard``."""
    prefixes = [f"{n}.experts." for n, _ in expert_ensembles(model)] if config.expert_parallel else []
    return {n: dims.efsdp if any(n.startswith(p) for p in prefixes) else dims.dp_shard for n in names}


def _validate(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    config: ParallelConfig,
    sparse_mesh: DeviceMesh | None = None,
) -> None:
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"parallelize: config must be a ParallelConfig, got {type(config).__name__}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict | nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"parallelize: {type(model).__name__} has no `layers` ModuleDict/ModuleList of blocks; FSDP, "
            "checkpointing and compile work per block"
        )
    if tuple(mesh.mesh_dim_names or ()) != DENSE_AXES:
        raise ValueError(f"parallelize: mesh must be ParallelDims.build_mesh's (axes {DENSE_AXES}), got "
                         f"{mesh.mesh_dim_names}")  # fmt: skip
    if mesh.size() != dims.world_size or (dist.is_initialized() and dist.get_world_size() != dims.world_size):
        raise ValueError(
            f"parallelize: dims.world_size={dims.world_size} but the mesh has {mesh.size()} ranks"
        )
    if config.expert_parallel:
        if not expert_ensembles(model):
            raise ValueError("ParallelConfig.expert_parallel=True but the model has no expert ensembles")
        check_expert_parallel(model, dims.ep)
    elif dims.ep > 1:
        raise ValueError(f"ParallelDims.ep={dims.ep} > 1 needs ParallelConfig.expert_parallel=True")
    if config.activation_checkpointing == "budget":
        check_no_dropout(model)
    ignored = _sparse_params(model) if config.embeddings is not None else set()
    if config.embeddings is not None:
        # The sparse half checks everything it will need (strategy, groups, mesh, plan) without a collective.
        from gem_parallel.sparse.shard import check_sharding

        check_sharding(
            model, dims, sparse_mesh, strategy=config.embeddings, sync_every=config.embedding_sync_every,
            lr=config.embedding_lr, eps=config.embedding_eps,
        )  # fmt: skip
    if config.all_gather != "bf16":
        targets = quantized_all_gather_targets(model, config.all_gather_min_numel, ignored)
        names = [n for n, _ in targets]
        check_quantized_all_gather(targets, config.all_gather, _shard_sizes(model, dims, config, names))


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    config: ParallelConfig,
    *,
    sparse_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply ``config`` to ``model`` on ``mesh`` (see the module docstring for the order), in place.

    Args:
        model: a model with a ``layers`` ModuleDict (e.g. ``gem_model.GemModel``), on its training device
            (or on the meta device, to be materialised with ``to_empty`` + ``init_weights`` after).
        dims: the degrees; ``mesh`` must be ``dims.build_mesh(device_type)``.
        mesh: the dense mesh.
        config: what to apply.
        sparse_mesh: ``dims.build_sparse_mesh(...)``, for the embedding sharding.

    Returns:
        The model (FSDP2 modules change class in place; the embedding sharding may return a new root).

    Raises:
        ValueError / TypeError: a misconfiguration, on every rank, before any collective.
    """
    _validate(model, dims, mesh, config, sparse_mesh)
    if config.precision is not None:
        from gem_precision import convert

        convert(model, config.precision)
    apply_activation_checkpointing(
        model, config.activation_checkpointing, compile=config.compile, memory_budget=config.memory_budget
    )
    if config.saved_activations != "bf16":
        apply_saved_activation_compression(model, config.saved_activations)
    experts = apply_expert_parallel(model, mesh["ep"]) if config.expert_parallel and dims.ep > 1 else []
    ignored = _sparse_params(model) if config.embeddings is not None else set()
    if fsdp_applies(dims, config):
        if config.all_gather != "bf16":
            enable_quantized_all_gather(
                quantized_all_gather_targets(model, config.all_gather_min_numel, ignored), config.all_gather
            )
        apply_fsdp(model, mesh, dims, config.fsdp, experts=experts, ignored_params=ignored)
    # --- embedding sharding: the sparse half of gem-parallel (gem_parallel.sparse) -------------------------
    if config.embeddings is not None:
        from gem_parallel.sparse import shard_embeddings

        model = shard_embeddings(
            model, dims, sparse_mesh, strategy=config.embeddings, sync_every=config.embedding_sync_every,
            lr=config.embedding_lr, eps=config.embedding_eps,
        )  # fmt: skip
    return model
