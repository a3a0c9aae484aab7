"""Activation checkpointing per layer (full, selective, memory budget) and FP8 saved activations.

Every entry of ``model.layers`` becomes a *region*: its class is swapped for a subclass whose ``forward``
runs the original one under the chosen policy (as FSDP2 swaps classes: parameter names, ``isinstance`` and
hooks stay as they were):

- "full": ``torch.utils.checkpoint`` (non-reentrant); only the layer's inputs stay alive, all of it is
  recomputed in backward.
- "selective": the same with torch's selective-checkpoint contexts: outputs of matmuls and attention
  kernels are saved, everything else (norms, activations, gates, residual adds) is recomputed.
- "budget": torch.compile's memory-budget rematerialization. On torch >= 2.13 each layer gets its own
  budget (``torch.autograd.graph.region_activation_memory_budget``), allocated where recomputation is
  cheapest per byte (:func:`allocate_region_budgets`) from a calibration of every layer during the first
  forward (that step runs the layers eagerly with full checkpointing; later steps run compiled). On older
  torch one global budget (``torch._functorch.config.activation_memory_budget``) covers all layers.
- ``compile=True``: the region's function is compiled by :func:`gem_parallel.compile.compile_function` (one
  compiled function per policy, shared by identical layers, with the jagged sizes dynamic as everywhere in
  gem; with "full"/"selective" the checkpoint is traced inside it). With "none" and ``compile=True`` the
  layers are compiled as they are (:func:`gem_parallel.compile.compile_layers`), with no region around them.

Saved activations in FP8 / MXFP8 (:func:`apply_saved_activation_compression`): the whole forward runs
under gem-precision's ``compress_saved_activations``, so every tensor autograd saves (all of them with
"none", the compiled layers' saves with "budget", whatever is saved outside the checkpointed layers with
"full" / "selective") is stored quantized. What ``torch.utils.checkpoint`` holds itself (a checkpointed
layer's inputs, the matmul outputs selective checkpointing keeps) does not pass through autograd's
saved-tensor hooks and stays as it is.

Known trap, pytorch#190758: under a memory budget the partitioner may recompute random ops (dropout) in
backward with fresh randomness, silently corrupting gradients. "budget" therefore refuses a model holding
active dropout modules (at parallelize time), and the calibration refuses any random op inside a layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from gem_parallel.activation_memory import is_activation
from gem_parallel.compile import compile_function, compile_layers

__all__ = [
    "ROOFLINE_FLOPS_PER_BYTE",
    "allocate_region_budgets",
    "apply_activation_checkpointing",
    "apply_saved_activation_compression",
    "check_no_dropout",
    "has_region_budgets",
    "selective_policy",
]

# Recompute cost model of a region: FLOPs + this x bytes of activations it produces (the H200's ridge
# point: 989 TFLOP/s dense bf16 over ~4.3 TB/s of HBM), i.e. a roofline estimate of its forward time.
ROOFLINE_FLOPS_PER_BYTE = 230.0

_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def has_region_budgets() -> bool:
    """Whether this torch has per-region memory budgets (``region_activation_memory_budget``, 2.13+)."""
    return hasattr(torch.autograd.graph, "region_activation_memory_budget")


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the outputs of matmuls and attention kernels (expensive to recompute, per byte), recompute
    the rest (pointwise ops, norms, reductions: cheap, and most of the bytes)."""
    if op in _MATMULS or ("attention" in op.name() and not op.name().startswith("aten::")):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(selective_policy)


# -- region functions (module passed as an argument, so one compiled function serves identical layers) ------


def _region(module: nn.Module) -> _Region:
    # A plain attribute set by apply_activation_checkpointing (Module attributes type as Tensor | Module).
    return cast(_Region, module._gem_region)


def _full(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(_region(module).forward, module, *args, use_reentrant=False, **kwargs)


def _selective(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(
        _region(module).forward, module, *args, use_reentrant=False, context_fn=_sac_context, **kwargs
    )


def _budgeted(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The budget travels as text: dynamo specialises strings, while a float attribute may be traced as a
    # symbolic float, which the region annotation cannot take.
    region = _region(module)
    budget = region.budget_text
    if budget is None:  # torch < 2.13: the global knob, set once
        return region.forward(module, *args, **kwargs)
    with torch.autograd.graph.region_activation_memory_budget(float(budget)):
        return region.forward(module, *args, **kwargs)


_POLICY_FUNCTIONS = {"full": _full, "selective": _selective, "budget": _budgeted}
_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled(policy: str) -> Callable[..., Any]:
    if policy not in _COMPILED:
        _COMPILED[policy] = compile_function(_POLICY_FUNCTIONS[policy])
    return _COMPILED[policy]


class _Region:
    """How one layer runs: its original forward, policy, compile flag and (with "budget") budget."""

    def __init__(
        self,
        name: str,
        forward: Callable[..., Any],
        policy: str,
        compile: bool,
        planner: _BudgetPlanner | None,
    ) -> None:
        self.name, self.forward, self.policy, self.planner = name, forward, policy, planner
        self.budget: float | None = None
        self.budget_text: str | None = None
        self.run = _compiled(policy) if compile else _POLICY_FUNCTIONS[policy]

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.planner is not None and not self.planner.ready:
            return self.planner.calibrate(self, module, args, kwargs)
        return self.run(module, *args, **kwargs)


_REGION_CLASSES: dict[type, type] = {}


def _region_class(cls: type) -> type:
    if cls not in _REGION_CLASSES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _region(self)(self, *args, **kwargs)

        _REGION_CLASSES[cls] = type(f"Region{cls.__name__}", (cls,), {"forward": forward})
    return _REGION_CLASSES[cls]


# -- memory budgets ------------------------------------------------------------------------------------------


def allocate_region_budgets(costs: dict[str, tuple[float, float]], budget: float) -> dict[str, float]:
    """Per-region budgets keeping ``budget`` of the total activation bytes, recomputing where it is cheapest.

    Args:
        costs: region -> ``(recompute cost, activation bytes at budget 1)``.
        budget: share in [0, 1] of the total bytes to keep.

    Returns:
        region -> budget in [0, 1]. Regions are freed in order of recompute cost per byte (cheapest
        first), each entirely (budget 0) until the bytes to free are reached; one region may end with a
        fractional budget (the optimum of the fractional knapsack over linear cost curves), the rest keep 1.
    """
    total = sum(b for _, b in costs.values())
    to_free = (1.0 - budget) * total
    out = {name: 1.0 for name in costs}
    order = sorted(costs, key=lambda n: (costs[n][0] / max(costs[n][1], 1.0), n))
    for name in order:
        nbytes = costs[name][1]
        if to_free <= 0 or nbytes <= 0:
            continue
        freed = min(nbytes, to_free)
        out[name] = 1.0 - freed / nbytes
        to_free -= freed
    return out


class _RefuseRandom(TorchDispatchMode):
    """Raises on any random op (pytorch#190758: a memory budget may recompute it with fresh randomness)."""

    def __init__(self, region: str) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise RuntimeError(
                f"activation_checkpointing='budget': layer {self.region!r} runs the random op {func} "
                "(dropout?). Under a memory budget torch.compile may recompute it in backward with fresh "
                "randomness (pytorch#190758), silently corrupting gradients; use 'selective' or 'full'."
            )
        return func(*args, **(kwargs or {}))


def _measure(
    region: _Region, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[float, float]:
    """(roofline recompute cost, saved activation bytes) of one eager forward of the region; nothing is
    kept (the saved-tensor hook counts and discards)."""
    nbytes = 0

    def pack(t: torch.Tensor) -> None:
        nonlocal nbytes
        if is_activation(t):
            nbytes += t.numel() * t.element_size()
        return None

    def unpack(_: object) -> NoReturn:
        raise RuntimeError("calibration graphs are never backpropagated")

    counter = FlopCounterMode(display=False)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    with torch.enable_grad(), hooks, counter, _RefuseRandom(region.name):
        region.forward(module, *args, **kwargs)
    return float(counter.get_total_flops()) + ROOFLINE_FLOPS_PER_BYTE * nbytes, float(nbytes)


class _BudgetPlanner:
    """Calibrates every region once (first forward), then gives each its budget; every rank agrees."""

    def __init__(self, names: list[str], budget: float) -> None:
        self.names, self.budget = names, budget
        self.costs: dict[str, tuple[float, float]] = {}
        self.regions: dict[str, _Region] = {}
        self.ready = False

    def calibrate(
        self, region: _Region, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self.costs[region.name] = _measure(region, module, args, kwargs)
        self.regions[region.name] = region
        if len(self.costs) == len(self.names):
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            self._assign(device)
        # This step's real forward: full checkpointing holds the least while budgets are unknown.
        return _full(module, *args, **kwargs)

    def _assign(self, device: torch.device) -> None:
        flat = torch.tensor(
            [v for n in self.names for v in self.costs[n]], dtype=torch.float64, device=device
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(
                flat
            )  # the same budgets on every rank, so the same recomputation (and collectives)
        values = flat.view(-1, 2).tolist()
        budgets = allocate_region_budgets({n: tuple(v) for n, v in zip(self.names, values)}, self.budget)
        for name, b in budgets.items():
            self.regions[name].budget = b
            self.regions[name].budget_text = repr(b)
        self.ready = True

    @property
    def budgets(self) -> dict[str, float | None]:
        return {n: r.budget for n, r in self.regions.items()}


def check_no_dropout(model: nn.Module) -> None:
    """Raises ``ValueError`` when ``model`` holds a dropout module with ``p > 0`` (see pytorch#190758)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            raise ValueError(
                f"activation_checkpointing='budget' with dropout ({name}: p={m.p}): a memory budget may "
                "recompute random ops in backward with fresh randomness (pytorch#190758), silently "
                "corrupting gradients; use 'selective' or 'full', or drop the dropout"
            )


def _set_recompile_limit(at_least: int) -> None:
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    if getattr(cfg, name) < at_least:
        setattr(cfg, name, at_least)


def apply_activation_checkpointing(
    model: nn.Module, policy: str, *, compile: bool = False, memory_budget: float = 1.0
) -> dict[str, Any]:
    """Make every entry of ``model.layers`` a region run under ``policy`` (in place).

    Args:
        model: a model with a ``layers`` ModuleDict / ModuleList.
        policy: "none", "full", "selective" or "budget" ("budget" needs ``compile``).
        compile: compile each layer (with a region: the region's function; with "none": the layer itself).
        memory_budget: with "budget", the share of activation bytes to keep, in (0, 1].

    Returns:
        ``{"regions": [names], "planner": ...}``; with "budget" on torch >= 2.13 ``planner.budgets`` holds
        each region's budget once the first forward has calibrated them.
    """
    if policy == "budget":
        if not compile:
            raise ValueError("activation_checkpointing='budget' needs compile=True")
        check_no_dropout(model)
    if policy == "none":
        if compile:
            compile_layers(model)
        return {"regions": [], "planner": None}
    layers = model.layers
    items = (
        list(layers.items())
        if isinstance(layers, nn.ModuleDict)
        else list(enumerate(cast(nn.ModuleList, layers)))
    )
    names = [f"layers.{k}" for k, _ in items]
    planner = None
    if policy == "budget":
        if has_region_budgets():
            planner = _BudgetPlanner(names, memory_budget)
        else:
            torch._functorch.config.activation_memory_budget = memory_budget
            warnings.warn(
                f"torch {torch.__version__} has no per-region memory budgets: one global "
                f"activation_memory_budget={memory_budget} covers every compiled layer",
                stacklevel=2,
            )
    if compile:
        _set_recompile_limit(2 * len(items) + 8)  # a graph per distinct layer kind and budget
    for name, (_, layer) in zip(names, items):
        cls = type(layer)
        # torch types Module.__setattr__'s value as Tensor | Module, but a Module stores any attribute.
        layer._gem_region = _Region(name, cls.forward, policy, compile, planner)  # type: ignore[assignment]
        layer.__class__ = _region_class(cls)
    return {"regions": names, "planner": planner}


def apply_saved_activation_compression(model: nn.Module, fmt: str) -> None:
    """Run ``model``'s forward under gem-precision's ``compress_saved_activations(fmt)`` ("fp8" / "mxfp8")."""
    from gem_precision import compress_saved_activations

    stack: list = []

    def enter(module, args, kwargs):
        ctx = compress_saved_activations(fmt)
        ctx.__enter__()
        stack.append(ctx)

    def leave(module, args, kwargs, output):
        if stack:
            stack.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
