"""The process group and the device of a run: one process, or many started by ``torchrun``.

Backend: NCCL on CUDA, gloo on the CPU. Every collective helper here is a no-op with one process, so the
single-process path never touches ``torch.distributed``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gem_train.config import ConfigError

__all__ = [
    "DistInfo",
    "all_gather_object",
    "any_rank",
    "init_distributed",
    "peak_memory_gib",
    "resolve_device",
]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the run: rank, world size, local rank and training device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(spec: str, local_rank: int) -> torch.device:
    """``run.device`` -> a device: "auto" is ``cuda:<local_rank>`` when CUDA is there, else the CPU."""
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device = {spec!r} but CUDA is not available; use 'cpu' or 'auto'")
        if dev.index is None:
            dev = torch.device(f"cuda:{local_rank}")
    return dev


def init_distributed(device_spec: str, cpu_threads: int = 0, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1), else run alone.

    On the CPU, ``cpu_threads > 0`` sets torch's intra-op threads. ``timeout_s`` is the collective timeout
    (``parallel.timeout_s``): a collective that a dead or stuck rank never joins fails after that long. A
    process group that already exists (a test harness's) is used as it is.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_spec, local_rank)
    if device.type == "cpu" and cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return DistInfo(rank, world, local_rank, device)


def all_gather_object(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` with one process)."""
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, d: DistInfo) -> bool:
    """Whether ``flag`` is set on any rank (collective: every rank calls it equally often)."""
    t = torch.tensor([1.0 if flag else 0.0])
    if d.world_size > 1:
        t = t.to(d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory: allocated on the GPU (``max_memory_allocated``), else the peak resident
    set size of the process (``ru_maxrss``, which Linux reports in KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
