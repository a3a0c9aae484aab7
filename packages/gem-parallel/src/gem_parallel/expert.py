"""GEM's expert parallelism for gated ensembles in which every sample goes through every expert.

This is not token-routing MoE parallelism: a DHEN / Wukong ensemble weighs *all* its experts per sample
(``y = sum_e w[:, e] * expert_e(x)``, ``w = softmax(gate(x))``). With ``ep`` ranks in an EP group, each rank
holds ``n_experts / ep`` experts, and per ensemble call::

    w = gate_weights(x)                                   [B, E]   local, dense gate parameters
    X, W = all_gather(x), all_gather(w) over the EP group [ep*B, n, d], [ep*B, E]
    Y = sum over this rank's experts e of W[:, e] * expert_e(X)     [ep*B, n_out, d]
    y = reduce_scatter(Y, sum) over the EP group          [B, n_out, d]  = the full ensemble output

through torch's differentiable functional collectives, so backward all-gathers output gradients and
reduce-scatters input gradients (GEM's EP schedule). An expert's gradient then sums the losses of the EP
group's ``ep`` ranks, while FSDP over the experts' own mesh (``world / ep`` ranks) averages over its ranks
only: the gradient flowing into the experts is scaled by ``1/ep`` (and the one leaving them towards the
gathered inputs and gate weights by ``ep``, which leaves those exact), so every expert gradient comes out as
the world average, like a dense parameter's. (FSDP2's own ``set_gradient_divide_factor`` would do the same
on NCCL; over gloo it needs sum reductions, and torch 2.13 then divides twice when the expert shard group
has one rank: ``foreach_reduce``'s single-rank branch divides and the post-division runs again.)

Each collective is waited before the next one is issued, so an EP group never has two in flight. On NCCL
this costs nothing (collectives of one communicator run one after the other on its stream anyway); on gloo
it is required: in torch 2.13 two functional collectives in flight at once on one gloo group corrupted the
heap (SIGSEGV in malloc on a gloo worker thread, about once in two 300-step 4-rank gem-train runs; a 2-rank
loop of two concurrent funcol all-gathers crashed within 20,000 iterations, the same loop waiting each one
before the next ran 3 x 20,000 clean). c10d's own async collectives overlapped the same way did not crash
(2 x 20,000 iterations each of two ``all_gather_into_tensor`` or two ``all_to_all_single`` in flight).

Ranks with different local batch sizes (a last, short batch) are padded to the group's largest batch with
zero rows and zero gate weights, which add nothing to the outputs or gradients; the sizes are exchanged
with one tiny all-gather per ensemble call (a host sync).

The ensemble is found by its public structure (duck typing, no import of gem-model): a module with an
``experts`` ModuleList and the methods ``gate_weights(x) -> [B, E] | None`` and
``expert_sum(x, weights, experts=[(index, module), ...])``. Each rank keeps its experts in a
:class:`LocalExperts` container keyed by their index in the whole ensemble, so parameter names (and
checkpoints) stay those of the unsharded model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["LocalExperts", "apply_expert_parallel", "expert_ensembles", "local_expert_indices"]

# torch >= 2.13 renamed these (and deprecates the old c10d name with a warning per call); 2.11 has only the
# old names.
_all_gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
_reduce_scatter = getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class LocalExperts(nn.ModuleDict):
    """The experts one EP rank holds, keyed by their index in the whole ensemble (``"0"``, ``"3"``, ...).

    Iterating yields the expert modules in order, as the ``ModuleList`` it replaces did, so code that
    loops over ``ensemble.experts`` (e.g. ``reset_parameters``) keeps working.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())

    def indexed(self) -> list[tuple[int, nn.Module]]:
        """``[(global index, expert), ...]`` in index order."""
        return [(int(k), m) for k, m in self.items()]


class _Ensemble(Protocol):
    """The public structure of an expert ensemble (what :func:`expert_ensembles` checks), for typing."""

    experts: nn.ModuleList | LocalExperts
    _gem_ep_mesh: DeviceMesh

    def gate_weights(self, x: Tensor) -> Tensor | None: ...

    def expert_sum(
        self, x: Tensor, weights: Tensor, experts: Iterable[tuple[int, nn.Module]] | None = None
    ) -> Tensor: ...


def expert_ensembles(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every gated expert ensemble in ``model`` (see the module docstring)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "experts", None), nn.ModuleList | LocalExperts)
        and callable(getattr(m, "gate_weights", None))
        and callable(getattr(m, "expert_sum", None))
    ]


def local_expert_indices(n_experts: int, ep: int, ep_rank: int) -> list[int]:
    """The contiguous block of expert indices EP rank ``ep_rank`` holds.

    Raises:
        ValueError: when ``ep`` does not divide ``n_experts``.
    """
    if n_experts % ep:
        raise ValueError(
            f"expert parallelism: ep={ep} does not divide the ensemble's n_experts={n_experts} "
            "(every EP rank must hold the same number of experts)"
        )
    per_rank = n_experts // ep
    return list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """Raises ``ValueError`` (naming the ensemble) when ``ep`` does not divide some ensemble's expert count.
    Collective-free: every rank decides the same from the same model."""
    for name, ens in expert_ensembles(model):
        try:
            local_expert_indices(len(cast(_Ensemble, ens).experts), ep, 0)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def _group_batch_sizes(b: int, mesh: DeviceMesh, device: torch.device) -> list[int]:
    sizes = torch.empty(mesh.size(), dtype=torch.int64, device=device)
    _all_gather_into(sizes, torch.tensor([b], dtype=torch.int64, device=device), group=mesh.get_group())
    return sizes.tolist()


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def expert_parallel_forward(ensemble: nn.Module, x: Tensor, mesh: DeviceMesh) -> Tensor:
    """The ensemble's output for this rank's ``x [B, n_in, d]`` (``[B, n_out, d]``), computed with the EP
    group's experts (see the module docstring)."""
    ens = cast(_Ensemble, ensemble)
    weights = ens.gate_weights(x)  # [B, E] fp32, from the dense gate
    # EP runs with ep > 1, which divides n_experts: the ensemble has several experts, hence a gate.
    assert weights is not None and isinstance(ens.experts, LocalExperts), "not an expert-parallel ensemble"
    b = x.shape[0]
    b_max = max(_group_batch_sizes(b, mesh, x.device))
    # One collective in flight at a time (module docstring): each is waited before the next is issued.
    group_x = fc.wait_tensor(_all_gather(_pad_rows(x, b_max).contiguous(), 0, mesh))  # [ep * b_max, n_in, d]
    group_w = fc.wait_tensor(_all_gather(_pad_rows(weights, b_max).contiguous(), 0, mesh))  # [ep * b_max, E]
    ep = mesh.size()
    # Expert gradients: the EP group's loss sum / ep = its mean; input and gate gradients: unchanged.
    group_x, group_w = _ScaleGrad.apply(group_x, float(ep)), _ScaleGrad.apply(group_w, float(ep))
    partial = ens.expert_sum(group_x, group_w, ens.experts.indexed())  # this rank's experts
    partial = _ScaleGrad.apply(partial, 1.0 / ep)
    out = fc.wait_tensor(_reduce_scatter(partial.contiguous(), "sum", 0, mesh))  # [b_max, n_out, d]
    return out[:b]


_EP_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    """``cls`` with its forward replaced by :func:`expert_parallel_forward` (a dynamic subclass, the way
    FSDP2 adds its hooks: the instance keeps its attributes, parameter names and ``isinstance``)."""
    if cls not in _EP_CLASSES:

        def forward(self: Any, x: Tensor) -> Tensor:
            return expert_parallel_forward(self, x, self._gem_ep_mesh)

        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": forward})
    return _EP_CLASSES[cls]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every expert ensemble of ``model`` over the 1-D EP mesh ``ep_mesh``, in place.

    Each rank keeps experts ``local_expert_indices(n_experts, ep, ep_rank)`` (the others are dropped) and
    the ensembles' forward becomes :func:`expert_parallel_forward`. Call before FSDP: the returned experts
    must be sharded on their own mesh (:func:`gem_parallel.fsdp.apply_fsdp`'s ``experts``).

    Returns:
        The expert modules this rank holds, in model order.

    Raises:
        ValueError: ``ep`` does not divide some ensemble's expert count (before any collective).
    """
    ep = ep_mesh.size()
    check_expert_parallel(model, ep)
    ep_rank = ep_mesh.get_local_rank()
    held: list[nn.Module] = []
    for _, module in expert_ensembles(model):
        ens = cast(_Ensemble, module)
        experts = ens.experts
        local = local_expert_indices(len(experts), ep, ep_rank)
        indexed = experts.indexed() if isinstance(experts, LocalExperts) else list(enumerate(experts))
        ens.experts = LocalExperts({str(i): m for i, m in indexed if i in local})
        ens._gem_ep_mesh = ep_mesh
        ens.__class__ = _expert_parallel_class(type(ens))
        held.extend(ens.experts.values())
    return held
