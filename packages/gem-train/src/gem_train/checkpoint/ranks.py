"""The ranks of the process group as the checkpoint code sees them: every helper works with one process and
no process group too."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["all_gather", "barrier", "current_rank", "world_size"]


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_gather(obj: Any) -> list[Any]:
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out
