"""Launch helpers shared by the Triton kernels of every family: the scratch memory of device-side tensor
descriptors, and the grid of persistent kernels."""

from __future__ import annotations

import torch
import triton

from gem_kernels.dispatch import triton_interpreted

__all__ = ["INTERPRETER_PROGRAMS", "persistent_grid", "use_descriptor_scratch"]

INTERPRETER_PROGRAMS = 3  # a few programs, each looping over several items, under TRITON_INTERPRET


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch of the device-side tensor descriptors (``triton.set_allocator``)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def use_descriptor_scratch() -> None:
    """Give device-side tensor descriptors (``tl.make_tensor_descriptor``) their scratch allocator; nothing
    to do in the interpreter. Call it at every launch: ``triton.set_allocator`` sets a ContextVar, so a
    one-time set in the forward's thread does not reach the autograd engine's backward thread (H200: "no
    allocator was set")."""
    if not triton_interpreted():
        triton.set_allocator(_scratch)


def persistent_grid(items: int, device: torch.device, per_sm: int) -> tuple[int]:
    """The grid of a persistent kernel over ``items`` work items: ``per_sm`` programs per SM (in the
    interpreter :data:`INTERPRETER_PROGRAMS`, so that programs loop), at most the items, at least 1."""
    if triton_interpreted():
        return (max(1, min(items, INTERPRETER_PROGRAMS)),)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return (max(1, min(items, sms * per_sm)),)
