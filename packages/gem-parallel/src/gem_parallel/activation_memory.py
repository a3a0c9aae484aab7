"""Measure the activation memory a forward keeps for backward, two ways.

- :func:`retained_bytes`: what the allocator says: bytes allocated while the forward ran and still held when
  it returns (CPU: the profiler's memory events; CUDA: ``memory_allocated`` before and after). This sees
  everything backward will need, whoever holds it: tensors autograd saved, the inputs
  ``torch.utils.checkpoint`` keeps, selective checkpointing's cached outputs, compiled graphs' saves.
- :func:`saved_tensor_bytes`: what autograd's saved-tensor hooks see (unique storages, parameters left out):
  exact for plain autograd, blind to what checkpointing holds by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["is_activation", "retained_bytes", "saved_tensor_bytes"]


def is_activation(t: torch.Tensor) -> bool:
    """Whether a tensor saved for backward is an activation (not a parameter or another leaf that
    requires grad, which stay alive anyway)."""
    return not (isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad))


def retained_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """Run ``fn()``; return its result and the bytes it allocated that are still allocated at its end."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    # Self usage: each allocation (+) and free (-) counted once, by the op that made it.
    return out, int(sum(e.self_cpu_memory_usage for e in prof.events()))


def saved_tensor_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under counting saved-tensor hooks; return its result and the bytes of the distinct
    storages autograd saved for backward (parameters and other leaves that require grad left out)."""
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if is_activation(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total
