"""``ParallelConfig``: how :func:`gem_parallel.parallelize` transforms a model, typed, checked in one place.

Every field is validated in ``__post_init__``; an error names the field (``ParallelConfig.all_gather``,
``FSDPConfig.param_dtype``, ...). Dtypes may be given as ``torch.dtype`` or as the strings ``"bf16"``,
``"fp16"``, ``"fp32"`` (handy in TOML); they are stored as ``torch.dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "ALL_GATHER_FORMATS",
    "EMBEDDING_STRATEGIES",
    "SAVED_ACTIVATION_FORMATS",
    "ActivationCheckpointing",
    "AllGatherFormat",
    "EmbeddingStrategy",
    "FSDPConfig",
    "ParallelConfig",
    "SavedActivationFormat",
]

# The choices of each option, as types (for configs built on this one, e.g. gem-train's [parallel]) and as
# tuples (for checks and messages).
AllGatherFormat = Literal["bf16", "fp8", "mxfp8"]
ActivationCheckpointing = Literal["none", "full", "selective", "budget"]
SavedActivationFormat = Literal["bf16", "fp8", "mxfp8"]
EmbeddingStrategy = Literal["1d", "2d", "fully_sharded_2d"]
ALL_GATHER_FORMATS: tuple[str, ...] = get_args(AllGatherFormat)
ACTIVATION_CHECKPOINTING: tuple[str, ...] = get_args(ActivationCheckpointing)
SAVED_ACTIVATION_FORMATS: tuple[str, ...] = get_args(SavedActivationFormat)
EMBEDDING_STRATEGIES: tuple[str, ...] = get_args(EmbeddingStrategy)

_DTYPE_NAMES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}  # fmt: skip


def _as_dtype(owner: str, name: str, value: Any) -> torch.dtype | None:
    if value is None or (isinstance(value, torch.dtype) and value in _DTYPE_NAMES.values()):
        return value
    if isinstance(value, str) and value in _DTYPE_NAMES:
        return _DTYPE_NAMES[value]
    raise ValueError(
        f"{owner}.{name} must be None, bf16, fp16 or fp32 (a torch.dtype or its name), got {value!r}"
    )


def _check_choice(owner: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 settings of the dense parameters (and of the experts, on their own mesh).

    Args:
        param_dtype: dtype the parameters are all-gathered and computed in (FSDP2 mixed precision);
            None keeps the parameters' own dtype (fp32 training).
        reduce_dtype: dtype of the gradient reduce-scatter / all-reduce; None = the gradients' dtype.
            ``param_dtype=bf16, reduce_dtype=fp32`` is the usual recipe (bf16 compute, fp32 reduction).
        reshard_after_forward: free the gathered parameters after each layer's forward (ZeRO-3); False
            keeps them until backward (ZeRO-2: one all-gather per step, more memory).
        prefetch: layers whose all-gather is issued ahead, in forward (next layers) and backward (previous
            layers), beyond FSDP2's implicit one; 0 leaves FSDP2's default.
        wrap_single_rank: apply ``fully_shard`` even when the dense mesh has one rank. Off by default, as in
            torchtitan (FSDP only when the shard degree is > 1): on one rank there is nothing to shard or
            reduce, and FSDP2's per-parameter hooks and copies cost +21-28% step time on ``base`` (one H200,
            eager, host-bound: see gem-parallel's BENCHMARKS.md). On for benchmarks of FSDP itself.
    """

    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = torch.float32
    reshard_after_forward: bool = True
    prefetch: int = 1
    wrap_single_rank: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _as_dtype("FSDPConfig", "param_dtype", self.param_dtype))
        object.__setattr__(self, "reduce_dtype", _as_dtype("FSDPConfig", "reduce_dtype", self.reduce_dtype))
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"FSDPConfig.reshard_after_forward must be a bool, got {self.reshard_after_forward!r}"
            )
        _check_int("FSDPConfig", "prefetch", self.prefetch, 0)
        if not isinstance(self.wrap_single_rank, bool):
            raise ValueError(f"FSDPConfig.wrap_single_rank must be a bool, got {self.wrap_single_rank!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """What :func:`gem_parallel.parallelize` applies, in its fixed order (see its docstring).

    Args:
        fsdp: FSDP2 settings (:class:`FSDPConfig`, or a dict of its fields).
        expert_parallel: shard every expert ensemble's experts over the mesh's ``ep`` axis (GEM's
            all-gather / reduce-scatter expert parallelism); needs ``ep > 1`` in the dims to do anything.
        all_gather: format of the FSDP parameter all-gather of large linear weights: "bf16" (FSDP's own:
            the parameters in ``fsdp.param_dtype``), "fp8" (E4M3, one fp32 scale per row) or "mxfp8"
            (E4M3, one E8M0 scale per 32 elements along K); each rank quantizes its own shard.
        all_gather_min_numel: linear weights smaller than this keep FSDP's own all-gather.
        activation_checkpointing: per layer of ``model.layers``: "none", "full" (recompute the whole layer),
            "selective" (save matmul / attention outputs, recompute the rest) or "budget" (torch.compile's
            memory-budget rematerialization; needs ``compile=True``).
        memory_budget: with "budget", the share in (0, 1] of the activation memory the compiled layers
            keep (1 = the compiler's default); spread over the layers where recomputation is cheapest
            per byte (torch >= 2.13; one global budget on older torch).
        saved_activations: storage of the tensors autograd saves for backward during the forward:
            "bf16" (as they are) or "fp8" / "mxfp8" (gem-precision's ``compress_saved_activations``).
        compile: ``torch.compile`` each layer of ``model.layers``.
        precision: a gem-precision ``Recipe``: convert the model's linear layers (``gem_precision.convert``)
            before anything else; None keeps them.
        precision_min_features / precision_keep_last_blocks: ``convert``'s ``min_features`` (narrower layers
            stay unconverted) and ``keep_last_blocks`` (the last N blocks stay unconverted).
        embeddings: how the embedding tables are sharded (by the sparse half of gem-parallel): "1d", "2d"
            or "fully_sharded_2d"; None leaves the tables as they are, and FSDP treats them as ordinary
            dense parameters.
        embedding_sync_every: with 2D sharding, steps between weight syncs of the table replicas.
        embedding_lr / embedding_eps: of the row-wise Adagrad fused into the sharded tables' backward.
    """

    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    expert_parallel: bool = False
    all_gather: AllGatherFormat = "bf16"
    all_gather_min_numel: int = 16384
    activation_checkpointing: ActivationCheckpointing = "none"
    memory_budget: float = 0.5
    saved_activations: SavedActivationFormat = "bf16"
    compile: bool = False
    precision: Any = None
    precision_min_features: int = 128
    precision_keep_last_blocks: int = 0
    embeddings: EmbeddingStrategy | None = None
    embedding_sync_every: int = 1
    embedding_lr: float = 0.05
    embedding_eps: float = 1e-8

    def __post_init__(self) -> None:
        owner = "ParallelConfig"
        if isinstance(self.fsdp, dict):
            object.__setattr__(self, "fsdp", FSDPConfig(**self.fsdp))
        if not isinstance(self.fsdp, FSDPConfig):
            raise ValueError(f"{owner}.fsdp must be an FSDPConfig or a dict of its fields, got {self.fsdp!r}")
        for name in ("expert_parallel", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{owner}.{name} must be a bool, got {getattr(self, name)!r}")
        _check_choice(owner, "all_gather", self.all_gather, ALL_GATHER_FORMATS)
        _check_int(owner, "all_gather_min_numel", self.all_gather_min_numel, 1)
        _check_choice(
            owner, "activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING
        )
        budget = self.memory_budget
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0.0 < budget <= 1.0:
            raise ValueError(f"{owner}.memory_budget must be a float in (0, 1], got {budget!r}")
        object.__setattr__(self, "memory_budget", float(budget))
        _check_choice(owner, "saved_activations", self.saved_activations, SAVED_ACTIVATION_FORMATS)
        if self.activation_checkpointing == "budget" and not self.compile:
            raise ValueError(
                f"{owner}.activation_checkpointing='budget' is torch.compile's rematerialization: "
                "set compile=True"
            )
        if self.precision is not None and not hasattr(self.precision, "forward"):
            raise ValueError(
                f"{owner}.precision must be a gem_precision.Recipe or None, got {self.precision!r}"
            )
        _check_int(owner, "precision_min_features", self.precision_min_features, 0)
        _check_int(owner, "precision_keep_last_blocks", self.precision_keep_last_blocks, 0)
        if self.embeddings is not None:
            _check_choice(owner, "embeddings", self.embeddings, EMBEDDING_STRATEGIES)
        _check_int(owner, "embedding_sync_every", self.embedding_sync_every, 1)
        for name in ("embedding_lr", "embedding_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"{owner}.{name} must be a float > 0, got {v!r}")
