"""Input validation shared by every jagged op.

Checks that need device values (offsets monotone, last offset equal to the token count, the longest
sequence within ``max_len``) force a GPU sync, so on CUDA they run only in debug mode
(``GEM_KERNELS_DEBUG=1`` or :func:`gem_kernels.set_debug`). On the CPU they always run.
"""

from __future__ import annotations

import os

import torch

_DEBUG = os.environ.get("GEM_KERNELS_DEBUG", "0") not in ("", "0", "false", "False")

OFFSET_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def set_debug(enabled: bool) -> None:
    """Turn on checks that synchronise with the GPU (monotone offsets, lengths within ``max_len``)."""
    global _DEBUG
    _DEBUG = bool(enabled)


def debug_enabled() -> bool:
    return _DEBUG


def _value_checks_wanted(t: torch.Tensor) -> bool:
    # Value checks are free on the CPU; on other devices they cost a sync, so only in debug mode.
    # While torch.compile traces, values are symbolic: reading them would break the graph.
    if torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or _DEBUG


def check_values(
    name: str, t: torch.Tensor, *, ndim: int, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> None:
    """Check a jagged values tensor: a tensor of ``ndim`` dimensions and a floating dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def check_same(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], what: str) -> None:
    """Check that tensors agree on ``what`` ("dtype" or "device")."""
    first = getattr(tensors[0], what)
    for n, t in zip(names[1:], tensors[1:]):
        if getattr(t, what) != first:
            raise ValueError(f"{n} has {what} {getattr(t, what)} but {names[0]} has {first}")


def check_offsets(
    name: str,
    offsets: torch.Tensor,
    *,
    total: int,
    device: torch.device,
    batch: int | None = None,
    max_len: int | None = None,
    max_len_name: str = "max_len",
) -> None:
    """Check an offsets tensor ``[B+1]``: int32/int64, on ``device``, starting at 0, non-decreasing,
    ending at ``total``; and, where given, ``B == batch`` and every length ``<= max_len``."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in OFFSET_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be 1-D with B+1 >= 1 entries, got shape {tuple(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the values are on {device}")
    if batch is not None and offsets.numel() != batch + 1:
        raise ValueError(f"{name} has {offsets.numel()} entries but the batch needs {batch + 1}")
    if max_len is not None and (not isinstance(max_len, int) or max_len < 0):
        raise ValueError(f"{max_len_name} must be a non-negative int, got {max_len!r}")
    if not _value_checks_wanted(offsets):
        return
    o = offsets.detach().to("cpu", torch.int64)
    if int(o[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(o[0])}")
    if int(o[-1]) != total:
        raise ValueError(f"{name}[-1] must equal the token count {total}, got {int(o[-1])}")
    lengths = o[1:] - o[:-1]
    if lengths.numel() and bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(f"{name} must be non-decreasing, but {name}[{bad + 1}] < {name}[{bad}]")
    if max_len is not None and lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(
            f"{max_len_name}={max_len} is smaller than the longest sequence in {name} ({int(lengths.max())})"
        )
