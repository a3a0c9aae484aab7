"""Global gradient norm and clipping of the dense parameters, for plain tensors and FSDP2 DTensors alike.

``torch.nn.utils.clip_grad_norm_`` cannot take DTensors on several meshes at once (under expert
parallelism the experts live on their own mesh), and it would count only this rank's experts. Here each
rank sums the squares of its *local* gradient shards, one all-reduce adds them over the world, and the
result is divided by the number of ranks holding each shard: a DTensor's local shard is held by the
``dp_replicate`` replicas (FSDP shards over the rest; experts differ across EP ranks), a plain tensor (one
process, DDP) by every rank. The clip coefficient is torch's: ``max_norm / (norm + 1e-6)``, at most 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm"]


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def clip_grad_norm(
    grads: Sequence[Tensor], max_norm: float, *, world_size: int = 1, dp_replicate: int = 1
) -> Tensor:
    """Clip ``grads`` in place to a total L2 norm of ``max_norm`` (``inf``: no clipping) and return the norm
    before clipping (a 0-d float32 tensor, the same on every rank; collective with several ranks)."""
    if not grads:
        return torch.zeros(())
    device = _local(grads[0]).device
    # Multi-tensor kernels per (kind, device, dtype) group, as torch's clip_grad_norm_: a per-gradient loop
    # launched ~5 kernels for each of base's hundreds of dense gradients.
    groups: dict[tuple[int, torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        loc = _local(g).detach()
        groups.setdefault((0 if isinstance(g, DTensor) else 1, loc.device, loc.dtype), []).append(loc)
    sums = torch.zeros(2, dtype=torch.float32, device=device)  # [DTensor shards, plain tensors]
    for (kind, _, _), ts in groups.items():
        norms = torch._foreach_norm(ts, 2)
        sums[kind] += torch.stack(norms).to(device=device, dtype=torch.float32).pow(2).sum()
    if world_size > 1 and dist.is_initialized():
        dist.all_reduce(sums)
        total = sums[0] / dp_replicate + sums[1] / world_size
    else:
        total = sums.sum()
    norm = total.sqrt()
    if max_norm != float("inf"):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for (_, dev, dtype), ts in groups.items():
            torch._foreach_mul_(ts, coef.to(device=dev, dtype=dtype))
    return norm
