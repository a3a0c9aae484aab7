"""Launchers of the persistent jagged attention kernels (:mod:`.persistent`), the ``tma`` variant.

A few programs per SM loop over the (tile, head) work items of a jagged tile schedule (:mod:`.schedule`,
built on the device and cached per offsets tensor, so the forward and dQ share one). The kernels load
through TMA descriptors where :func:`..variants.tma_supported` holds (compute capability >= 9 or the
interpreter, which emulates descriptors; head dims that are powers of two >= 16; heads packed in rows;
16-byte aligned rows), else through pointers. ``auto`` runs them where
:func:`..variants.auto_persistent_variant` says they measured faster. (Warp specialization of the inner
loops, the removed ``tma_ws`` variant, built no partition on sm_90: BENCHMARKS.md, "Removed variants".)

Each kernel's outer tile is fixed (:data:`..variants.PERSISTENT_OUTER_TILE` rows; the schedule depends on
it, so it cannot be autotuned with the rest): the autotuner (:mod:`.autotuners`) picks the inner tile,
warps and stages, and its choice persists on disk like the tiled kernels'. The grid is
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

from gem_kernels.attention import variants
from gem_kernels.attention.triton.autotuners import AUTOTUNERS
from gem_kernels.attention.triton.persistent import (
    dkdv_persistent_kernel,
    dq_persistent_kernel,
    fwd_persistent_kernel,
)
from gem_kernels.attention.triton.schedule import cached_schedule
from gem_kernels.launch_triton import persistent_grid, use_descriptor_scratch

Consts = dict[str, Any]
PROGRAMS_PER_SM = int(os.environ.get("GEM_KERNELS_PERSISTENT_PROGRAMS_PER_SM", "2"))
# Launches per (kernel, "tma" | "pointer"): tests read which path ran (gem_kernels.attention.testing).
launches: collections.Counter[tuple[str, str]] = collections.Counter()


def _run(name: str, tuned: Any, raw: Any, outer: torch.Tensor, inner: torch.Tensor, max_outer: int,
         lo_dist: int, hi_dist: int, heads: int, head_args: tuple[Any, ...], tail_args: tuple[Any, ...],
         consts: Consts, outer_is_m: bool) -> None:
    """Build (or reuse) the schedule for the outer block and launch one persistent kernel."""
    blocks = variants.fixed_blocks(tunable_in_interpreter=False)
    block_outer = variants.PERSISTENT_OUTER_TILE if blocks is None else blocks[0 if outer_is_m else 1]
    sched = cached_schedule(outer, inner, max_outer, block_outer, lo_dist, hi_dist, heads)
    counter = torch.zeros(1, dtype=torch.int32, device=outer.device)
    args = (*head_args, sched.tiles, sched.count, counter, *tail_args[:8], heads, sched.n_tiles,
            *tail_args[8:])
    grid = persistent_grid(sched.capacity * heads, outer.device, PROGRAMS_PER_SM)
    if consts["USE_TMA"]:
        use_descriptor_scratch()
    launches[(name, "tma" if consts["USE_TMA"] else "pointer")] += 1
    if blocks is None:
        tuned[grid](*args, **consts)
    else:
        raw[grid](*args, BLOCK_M=blocks[0], BLOCK_N=blocks[1], **consts)


def kernel_consts(consts: Consts, *tensors: torch.Tensor) -> Consts:
    """The launcher's constexprs plus ``USE_TMA``: where :func:`..variants.tma_supported` holds for
    ``tensors``."""
    return {**consts, "USE_TMA": variants.tma_supported(*tensors)}


def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q_len: int, left: int, right: int,
    qk_scale: float, out_scale: float, buckets: tuple[int, int, int, int], consts: Consts,
) -> None:
    """Fills ``out`` ``[total_q, H, Dv]`` (and ``lse`` ``[total_q, H]`` for softmax) in place.

    ``left``/``right`` are the launcher's band distances (``UNBOUNDED`` for an open side); ``buckets`` and
    ``consts`` as the launcher (:mod:`.launch`) computes them."""
    heads = q.shape[1]
    consts = kernel_consts(consts, q, k, v)
    _run("fwd", AUTOTUNERS["persistent_fwd"], fwd_persistent_kernel, q_offsets, kv_offsets, max_q_len, left,
         right, heads,
         (q, k, v, out, lse, q_offsets, kv_offsets),
         (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
          out.stride(1), q.shape[0], k.shape[0], left, right, qk_scale, out_scale, *buckets),
         consts, True)


def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int, left: int, right: int, qk_scale: float,
    out_scale: float, buckets: tuple[int, int, int, int], consts: Consts,
) -> None:
    """Fills ``dq``, ``dk``, ``dv`` (contiguous, shaped as q, k, v) in place: the dQ kernel (and
    ``delta`` for softmax), then the dK/dV kernel. ``dout`` and ``out`` contiguous."""
    heads = q.shape[1]
    consts = kernel_consts(consts, q, k, v, dout)
    delta = torch.empty_like(lse)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
               out.stride(1))
    tail = (*strides, q.shape[0], k.shape[0], left, right, qk_scale, out_scale, *buckets)
    if q.shape[0] > 0:
        _run("dq", AUTOTUNERS["persistent_dq"], dq_persistent_kernel, q_offsets, kv_offsets, max_q_len, left,
             right, heads, (q, k, v, out, dout, dq, lse, delta, q_offsets, kv_offsets), tail, consts, True)
    if k.shape[0] > 0:
        # Query i sees key j iff j - right <= i <= j + left: the band seen from the key side.
        _run("dkdv", AUTOTUNERS["persistent_dkdv"], dkdv_persistent_kernel, kv_offsets, q_offsets, max_kv_len,
             right, left, heads, (q, k, v, dout, dk, dv, lse, delta, q_offsets, kv_offsets), tail, consts,
             False)
