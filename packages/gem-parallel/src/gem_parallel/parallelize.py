"""``parallelize``: the one entry point that prepares a model for training, on one rank or on many.

It applies, in this order and only here (torchtitan's ``parallelize_fn`` order):

1. precision conversion (gem-precision ``convert``, if ``config.precision``);
2. activation checkpointing per layer and 3. per-layer ``torch.compile`` (:mod:`gem_parallel.compile`:
   dynamic jagged sizes, persistent caches; the same on one rank and on many), plus FP8 storage of saved
   activations;
4. expert parallelism (every expert ensemble sharded over the ``ep`` axis);
5. FSDP2: the 8-bit all-gather's weight wrapping, then ``fully_shard`` of each expert (own mesh), each
   layer, the embeddings (unless TorchRec shards them) and the root; skipped on a one-rank mesh unless
   ``FSDPConfig.wrap_single_rank`` (see :func:`fsdp_applies`);
6. embedding sharding (the sparse half of gem-parallel), if ``config.embeddings``.

One rank (``dims`` None or of world size 1, no process group needed): steps 1-3 only. A model without
``layers`` blocks (a plain MLP) gets steps 1-3 on the whole model and, on several ranks, DDP (every parameter
replicated); it takes no option that needs blocks.

Everything that can be wrong with the request is checked first, without any collective, so every rank
raises the same error at once instead of leaving its peers waiting.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gem_parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    apply_saved_activation_compression,
    check_no_dropout,
)
from gem_parallel.all_gather import (
    check_quantized_all_gather,
    enable_quantized_all_gather,
    group_quantized_all_gather,
    quantized_all_gather_targets,
)
from gem_parallel.compile import compile_layers
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


def _world(dims: ParallelDims) -> int:
    """The resolved world size (``ParallelDims`` fills it in on construction)."""
    return int(dims.world_size or 1)


def has_blocks(model: nn.Module) -> bool:
    """Whether ``model`` has a non-empty ``layers`` ModuleDict/ModuleList of blocks (what FSDP,
    activation checkpointing and expert parallelism work on, one block at a time)."""
    layers = getattr(model, "layers", None)
    return isinstance(layers, nn.ModuleDict | nn.ModuleList) and len(layers) > 0


def _needs_blocks(config: ParallelConfig) -> list[str]:
    """The options of ``config`` that work per block (named as the error names them)."""
    out = []
    if config.activation_checkpointing != "none":
        out.append(f"activation_checkpointing={config.activation_checkpointing!r}")
    if config.expert_parallel:
        out.append("expert_parallel=True")
    if config.all_gather != "bf16":
        out.append(f"all_gather={config.all_gather!r}")
    if config.embeddings is not None:
        out.append(f"embeddings={config.embeddings!r}")
    if config.fsdp.wrap_single_rank:
        out.append("fsdp.wrap_single_rank=True")
    return out


def _validate(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    config: ParallelConfig,
    sparse_mesh: DeviceMesh | None = None,
) -> None:
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"parallelize: config must be a ParallelConfig, got {type(config).__name__}")
    # A world of one beside a larger process group prepares this rank's model alone (evaluation).
    if _world(dims) > 1 and dist.is_initialized() and dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"parallelize: dims.world_size={dims.world_size} but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    if not has_blocks(model):
        needs = _needs_blocks(config)
        if needs:
            raise ValueError(
                f"parallelize: {type(model).__name__} has no `layers` ModuleDict/ModuleList of blocks, which "
                f"{', '.join(needs)} work on (FSDP, checkpointing, experts and table sharding are per block)"
            )
        if _world(dims) > 1 and not dist.is_initialized():
            raise ValueError(f"parallelize: world_size={dims.world_size} needs an initialized process group")
        return
    if _world(dims) == 1 and mesh is None and not dist.is_initialized():
        # One process without a process group: nothing to shard, gather or reduce.
        if config.fsdp.wrap_single_rank or config.embeddings is not None:
            raise ValueError(
                "parallelize: fsdp.wrap_single_rank and embeddings need a process group (even of one rank)"
            )
    elif mesh is not None:
        if tuple(mesh.mesh_dim_names or ()) != DENSE_AXES:
            raise ValueError(f"parallelize: mesh must be ParallelDims.build_mesh's (axes {DENSE_AXES}), "
                             f"got {mesh.mesh_dim_names}")  # fmt: skip
        if mesh.size() != dims.world_size:
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


def _device_type(model: nn.Module) -> str:
    """Where the model trains: its parameters' device type (a model on the meta device: CUDA if there)."""
    p = next(model.parameters(), None)
    if p is None or p.device.type == "meta":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return p.device.type


def _data_parallel(model: nn.Module) -> nn.Module:
    """DDP of a model without blocks (every parameter replicated, gradients averaged)."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=True,  # an embedding table may see no ids in a batch
    )


def parallelize(
    model: nn.Module,
    dims: ParallelDims | None = None,
    mesh: DeviceMesh | None = None,
    config: ParallelConfig | None = None,
    *,
    sparse_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Prepare ``model`` for training with ``config`` (see the module docstring for the order), in place.

    Args:
        model: any ``nn.Module``; per-block options (activation checkpointing, expert parallelism, the 8-bit
            all-gather, table sharding) need a ``layers`` ModuleDict/ModuleList of blocks (e.g.
            ``gem_model.GemModel``). On its training device (or on the meta device, to be materialised
            with ``to_empty`` + ``init_weights`` after).
        dims: the degrees; None: one rank (``ParallelDims(world_size=1)``).
        mesh: the dense mesh, ``dims.build_mesh(device_type)``; None builds it when the world has several
            ranks (one rank needs none).
        config: what to apply; None: ``ParallelConfig()`` (nothing but FSDP/DDP on several ranks).
        sparse_mesh: ``dims.build_sparse_mesh(...)``, for the embedding sharding; None builds it.

    Returns:
        The model (FSDP2 modules change class in place; the embedding sharding and DDP return a new root).
        A root made by the embedding sharding carries ``sparse_sharding`` (its fused optimizer, 2D syncs).

    Raises:
        ValueError / TypeError: a misconfiguration, on every rank, before any collective.
    """
    dims = dims if dims is not None else ParallelDims(world_size=1)
    config = config if config is not None else ParallelConfig()
    device_type = _device_type(model)
    # A process group of one rank can still wrap FSDP2 (wrap_single_rank) or shard tables.
    one_rank_wrap = config.fsdp.wrap_single_rank or config.embeddings is not None
    if mesh is None and has_blocks(model) and (_world(dims) > 1 or (one_rank_wrap and dist.is_initialized())):
        mesh = dims.build_mesh(device_type)
    if sparse_mesh is None and config.embeddings is not None and dist.is_initialized():
        sparse_mesh = dims.build_sparse_mesh(device_type)
    _validate(model, dims, mesh, config, sparse_mesh)
    if config.precision is not None:
        from gem_precision import convert

        convert(
            model, config.precision, min_features=config.precision_min_features,
            keep_last_blocks=config.precision_keep_last_blocks,
        )  # fmt: skip
    if not has_blocks(model):
        if config.compile:
            compile_layers(model)
        if config.saved_activations != "bf16":
            apply_saved_activation_compression(model, config.saved_activations)
        return _data_parallel(model) if _world(dims) > 1 else model
    apply_activation_checkpointing(
        model, config.activation_checkpointing, compile=config.compile, memory_budget=config.memory_budget
    )
    if config.saved_activations != "bf16":
        apply_saved_activation_compression(model, config.saved_activations)
    if mesh is None:  # one rank, no process group
        return model
    experts = apply_expert_parallel(model, mesh["ep"]) if config.expert_parallel and dims.ep > 1 else []
    ignored = _sparse_params(model) if config.embeddings is not None else set()
    if fsdp_applies(dims, config):
        if config.all_gather != "bf16":
            enable_quantized_all_gather(
                quantized_all_gather_targets(model, config.all_gather_min_numel, ignored), config.all_gather
            )
        apply_fsdp(model, mesh, dims, config.fsdp, experts=experts, ignored_params=ignored)
        if config.all_gather != "bf16":
            group_quantized_all_gather(model)  # one quantize launch per unit and round
    # --- embedding sharding: the sparse half of gem-parallel (gem_parallel.sparse) -------------------------
    if config.embeddings is not None:
        from gem_parallel.sparse import shard_embeddings

        model = shard_embeddings(
            model, dims, sparse_mesh, strategy=config.embeddings, sync_every=config.embedding_sync_every,
            lr=config.embedding_lr, eps=config.embedding_eps,
        )  # fmt: skip
    return model
