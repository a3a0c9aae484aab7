"""Launchers of the persistent jagged attention kernels (:mod:`.attention_persistent`).

The one variant, ``tma`` (picked with ``GEM_KERNELS_ATTENTION_VARIANT`` or ``triton_attention.force_variant``;
the ``auto`` default takes it where :func:`.attention.auto_persistent_variant` says so), loads through TMA
descriptors where the device and layout allow, else through pointers. TMA needs compute capability >= 9 (or
the interpreter, which emulates descriptors), head dims that are powers of two (>= 16), heads packed in
rows (``stride(1) == D``) and 16-byte aligned rows. The kernels' ``WS`` flag (automatic warp
specialization of the inner loops) is always off: its variant, ``tma_ws``, built no partition on sm_90 and
was removed (BENCHMARKS.md, "Removed variants").

Each kernel's outer tile is fixed (128 rows; the schedule depends on it, so it cannot be autotuned with
the rest): the autotuner picks the inner tile, warps and stages, from the first
:func:`gem_kernels.tune_cache.tune_candidates` entries of each list (the H200's pick first), and the
choice persists on disk like the tiled kernels' (:mod:`gem_kernels.tune_cache`). The grid is
``PROGRAMS_PER_SM`` programs per SM (``GEM_KERNELS_PERSISTENT_PROGRAMS_PER_SM``, default 2), capped by the
number of items.
"""

# fmt: off
# (Launch argument tuples stay packed: one argument per line would bury the logic.)

from __future__ import annotations

import collections
import os
from typing import Any

import torch
import triton

from gem_kernels import tune_cache
from gem_kernels.dispatch import triton_interpreted
from gem_kernels.triton_kernels.attention_persistent import (
    dkdv_persistent_kernel,
    dq_persistent_kernel,
    fwd_persistent_kernel,
)
from gem_kernels.triton_kernels.attention_schedule import cached_schedule

Consts = dict[str, Any]
VARIANTS = ("tma",)
PROGRAMS_PER_SM = int(os.environ.get("GEM_KERNELS_PERSISTENT_PROGRAMS_PER_SM", "2"))
OUTER_BLOCK = 128  # query tile of the forward and dQ kernels, key tile of the dK/dV kernel
INTERPRETER_PROGRAMS = 3  # a few programs, each looping over several items, under TRITON_INTERPRET
# Launches per (kernel, "tma" | "pointer"): tests check which path ran.
launches: collections.Counter[tuple[str, str]] = collections.Counter()

# (inner block, num_warps, num_stages) per kernel; the inner block is BLOCK_N for fwd/dq, BLOCK_M for dkdv.
# First: the H200's pick for the TMA kernels over all four (2026-12-04, B=64 log-normal, H=4, D=128, bf16:
# fwd 64 for GDPA silu and 128 for causal softmax, dq 64 and dkdv 64 for both, all 8 warps, 3 stages).
_CANDIDATES = {
    "fwd": [(64, 8, 3), (128, 8, 3), (64, 4, 3), (128, 8, 2)],
    "dq": [(64, 8, 3), (32, 4, 4), (64, 4, 3)],
    "dkdv": [(64, 8, 3), (32, 4, 4), (64, 4, 3)],
}
_KEY = ["bucket_b", "bucket_q", "bucket_kv", "band_kind", "ACT", "D", "DV", "PRECISION", "FAST_ACT",
        "USE_TMA", "WS"]


def _first_candidates(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    return configs[: tune_cache.tune_candidates()]


def _tuned(kernel: str, fn: Any) -> Any:
    inner = "BLOCK_M" if kernel == "dkdv" else "BLOCK_N"
    outer = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"
    configs = [triton.Config({outer: OUTER_BLOCK, inner: blk}, num_warps=w, num_stages=st)
               for blk, w, st in _CANDIDATES[kernel]]
    # The work counter is consumed by each run: zero it before every timed run and the final one.
    return tune_cache.autotune(f"persistent_{kernel}", fn, configs, _KEY, prune=_first_candidates,
                               reset_to_zero=["counter"])


_fwd_tuned = _tuned("fwd", fwd_persistent_kernel)
_dq_tuned = _tuned("dq", dq_persistent_kernel)
_dkdv_tuned = _tuned("dkdv", dkdv_persistent_kernel)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch of the device-side tensor descriptors (``triton.set_allocator``)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address every ``[T, H, d]`` tensor as ``[T, H*d]`` rows."""
    if not triton_interpreted():
        dev = tensors[0].device
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9:
            return False
    for t in tensors:
        d, es = t.shape[2], t.element_size()
        if d < 16 or d & (d - 1) or t.stride(2) != 1 or t.stride(1) != d:
            return False
        if (t.stride(0) * es) % 16 or t.data_ptr() % 16:
            return False
    return True


def _blocks(forced: tuple[int, int] | None) -> tuple[int, int] | None:
    """Fixed ``(BLOCK_M, BLOCK_N)`` under the interpreter or when forced, else None (autotune)."""
    if forced is not None:
        return forced
    return (32, 32) if triton_interpreted() else None


def _grid(items: int, device: torch.device) -> tuple[int]:
    if triton_interpreted():
        return (max(1, min(items, INTERPRETER_PROGRAMS)),)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return (max(1, min(items, sms * PROGRAMS_PER_SM)),)


def _run(name: str, tuned: Any, raw: Any, outer: torch.Tensor, inner: torch.Tensor, max_outer: int,
         lo_dist: int, hi_dist: int, heads: int, head_args: tuple[Any, ...], tail_args: tuple[Any, ...],
         consts: Consts, forced: tuple[int, int] | None, outer_is_m: bool) -> None:
    """Build (or reuse) the schedule for the outer block and launch one persistent kernel."""
    blocks = _blocks(forced)
    block_outer = OUTER_BLOCK if blocks is None else blocks[0 if outer_is_m else 1]
    sched = cached_schedule(outer, inner, max_outer, block_outer, lo_dist, hi_dist, heads)
    counter = torch.zeros(1, dtype=torch.int32, device=outer.device)
    args = (*head_args, sched.tiles, sched.count, counter, *tail_args[:8], heads, sched.n_tiles,
            *tail_args[8:])
    grid = _grid(sched.capacity * heads, outer.device)
    if consts["USE_TMA"] and not triton_interpreted():
        # Every launch: triton.set_allocator sets a ContextVar, so a one-time set in the forward's thread
        # does not reach the autograd engine's backward thread (H200: "no allocator was set").
        triton.set_allocator(_scratch)
    launches[(name, "tma" if consts["USE_TMA"] else "pointer")] += 1
    if blocks is None:
        tuned[grid](*args, **consts)
    else:
        raw[grid](*args, BLOCK_M=blocks[0], BLOCK_N=blocks[1], **consts)


def _consts(consts: Consts, variant: str, *tensors: torch.Tensor) -> Consts:
    if variant not in VARIANTS:
        raise ValueError(f"persistent variant must be one of {VARIANTS}, got {variant!r}")
    return {**consts, "USE_TMA": tma_supported(*tensors), "WS": False}


def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q_len: int, left: int, right: int,
    qk_scale: float, out_scale: float, buckets: tuple[int, int, int, int], consts: Consts, variant: str,
    forced: tuple[int, int] | None,
) -> None:
    """Fills ``out`` ``[total_q, H, Dv]`` (and ``lse`` ``[total_q, H]`` for softmax) in place.

    ``left``/``right`` are the launcher's band distances (``UNBOUNDED`` for an open side); ``buckets`` and
    ``consts`` as :func:`.attention._setup` returns them; ``forced`` fixes ``(BLOCK_M, BLOCK_N)``."""
    heads = q.shape[1]
    consts = _consts(consts, variant, q, k, v)
    _run("fwd", _fwd_tuned, fwd_persistent_kernel, q_offsets, kv_offsets, max_q_len, left, right, heads,
         (q, k, v, out, lse, q_offsets, kv_offsets),
         (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
          out.stride(1), q.shape[0], k.shape[0], left, right, qk_scale, out_scale, *buckets),
         consts, forced, True)


def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int, left: int, right: int, qk_scale: float,
    out_scale: float, buckets: tuple[int, int, int, int], consts: Consts, variant: str,
    forced: tuple[int, int] | None,
) -> None:
    """Fills ``dq``, ``dk``, ``dv`` (contiguous, shaped as q, k, v) in place: the dQ kernel (and
    ``delta`` for softmax), then the dK/dV kernel. ``dout`` and ``out`` contiguous."""
    heads = q.shape[1]
    consts = _consts(consts, variant, q, k, v, dout)
    delta = torch.empty_like(lse)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
               out.stride(1))
    tail = (*strides, q.shape[0], k.shape[0], left, right, qk_scale, out_scale, *buckets)
    if q.shape[0] > 0:
        _run("dq", _dq_tuned, dq_persistent_kernel, q_offsets, kv_offsets, max_q_len, left, right, heads,
             (q, k, v, out, dout, dq, lse, delta, q_offsets, kv_offsets), tail, consts, forced, True)
    if k.shape[0] > 0:
        # Query i sees key j iff j - right <= i <= j + left: the band seen from the key side.
        _run("dkdv", _dkdv_tuned, dkdv_persistent_kernel, kv_offsets, q_offsets, max_kv_len, right, left,
             heads, (q, k, v, dout, dk, dv, lse, delta, q_offsets, kv_offsets), tail, consts, forced, False)
