"""Persistent-grid Triton kernels of jagged attention (forward, dQ, dK/dV), optionally with TMA loads.

Same mathematics, layout, band and three-phase loops as :mod:`.fwd` / :mod:`.bwd` (see
:mod:`.common`); what differs is the grid. Instead of one program per (sequence x head, tile of
the longest sequence), most of which return at once on a log-normal batch, a few programs per SM loop over
the work items of a :class:`~.schedule.TileSchedule` (real tiles only, heaviest first), taking the
next item from a global atomic counter: greedy longest-processing-time-first list scheduling, so that a
program that drew a long causal tile does not hold up the end of the kernel.

``USE_TMA`` (Hopper and newer, head dims that are powers of two, heads packed in rows: ``[T, H*D]`` with
16-byte aligned rows) loads the Q/K/V/dO tiles through device-side tensor descriptors
(``tl.make_tensor_descriptor`` over the whole ``[total_rows, H*D]`` tensor, the tile at row ``start`` and
column ``h*D``). A descriptor cannot stop at a sequence's end, so a tile's rows past its sequence hold the
next sequence's rows (or zeros past the tensor): every such row or column is already excluded by the
existing masks (``tl.where`` on the scores and probabilities, masked stores and row-statistic loads),
which are kept exactly as in the pointer kernels. Outputs are stored through masked pointers.
"""

# fmt: off
# (Kernel argument lists stay packed: one argument per line would triple the length of this file.)

from __future__ import annotations

import triton
import triton.language as tl

from gem_kernels.attention.triton.common import (
    band_ranges,
    bwd_scales,
    persistent_item,
    row_stats,
    score_scale,
    seq_pair_bounds,
    store_rows,
)
from gem_kernels.attention.triton.tile_math import dkdv_tile_grads, dq_tile_ds, fwd_finish, fwd_tile


@triton.jit
def _descriptor(X, total_rows, stride_t, n_heads, D: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr, USE_TMA: tl.constexpr):
    """A ``[BLOCK_R, BLOCK_C]`` tensor descriptor over ``X`` seen as ``[total_rows, n_heads * D]`` (TMA),
    else ``X`` itself."""
    if USE_TMA:
        return tl.make_tensor_descriptor(X, shape=[total_rows, n_heads * D], strides=[stride_t, 1],
                                         block_shape=[BLOCK_R, BLOCK_C])
    else:
        return X


@triton.jit
def _tile(X, desc, seq_start, first, length, h, stride_t, stride_h, D: tl.constexpr, BLOCK_R: tl.constexpr,
          BLOCK_C: tl.constexpr, MASK: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``first + [0, BLOCK_R)`` of head ``h`` of the sequence starting at row ``seq_start``:
    ``[BLOCK_R, BLOCK_C]``. Pointer loads give 0 past ``length`` (when MASK) and past column D; TMA loads
    give whatever rows follow (the callers mask them)."""
    if USE_TMA:
        x = desc.load([(seq_start + first).to(tl.int32), h * D])
    else:
        offs = first + tl.arange(0, BLOCK_R)
        offs_c = tl.arange(0, BLOCK_C)
        ptrs = X + (seq_start + offs[:, None]) * stride_t + h * stride_h + offs_c[None, :]
        if MASK:
            x = tl.load(ptrs, mask=(offs[:, None] < length) & (offs_c[None, :] < D), other=0.0)
        else:
            x = tl.load(ptrs, mask=offs_c[None, :] < D, other=0.0)
    return x


@triton.jit
def _next_item(counter):
    """The next unclaimed work item (>= the item count when none is left)."""
    return tl.atomic_add(counter, 1)


# ------------------------------------------------------------------------------------------ forward


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, K, V, kd, vd, kv_start, h, stride_kt, stride_kh, stride_vt, stride_vh,
               offs_m, len_kv, lo, hi, left, right, qk_scale,
               ACT: tl.constexpr, MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               PRECISION: tl.constexpr, FAST_ACT: tl.constexpr, USE_TMA: tl.constexpr):
    """Key tiles ``[lo, hi)`` into ``acc`` ``[BM, BDV]`` (as :func:`.fwd._fwd_tiles`)."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(K, kd, kv_start, start_n, len_kv, h, stride_kt, stride_kh, D, BLOCK_N, BLOCK_D, MASK,
                  USE_TMA)
        v = _tile(V, vd, kv_start, start_n, len_kv, h, stride_vt, stride_vh, DV, BLOCK_N, BLOCK_DV, MASK,
                  USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BM, BN] fp32
        acc, m_i, l_i = fwd_tile(acc, m_i, l_i, s, v, offs_m, offs_n, len_kv, left, right, ACT, MASK,
                                 PRECISION, FAST_ACT)
    return acc, m_i, l_i


@triton.jit
def fwd_persistent_kernel(Q, K, V, Out, LSE, q_offsets, kv_offsets, tiles, count, counter,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                           stride_oh, n_heads, n_tiles, total_q, total_kv, left, right, qk_scale, out_scale,
                           bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                           ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr,
                           USE_TMA: tl.constexpr):
    """Programs loop over the (query tile, head) items of ``tiles``: ``Out`` ``[total_q, H, DV]``, ``LSE``."""
    qd = _descriptor(Q, total_q, stride_qt, n_heads, D, BLOCK_M, BLOCK_D, USE_TMA)
    kd = _descriptor(K, total_kv, stride_kt, n_heads, D, BLOCK_N, BLOCK_D, USE_TMA)
    vd = _descriptor(V, total_kv, stride_vt, n_heads, DV, BLOCK_N, BLOCK_DV, USE_TMA)
    n_items = tl.load(count)
    s_scale = score_scale(qk_scale, ACT)
    offs_dv = tl.arange(0, BLOCK_DV)
    w = _next_item(counter)
    while w < n_items:
        b, h, start_m = persistent_item(tiles, w, n_heads, n_tiles, BLOCK_M)
        q_start, len_q, kv_start, len_kv = seq_pair_bounds(q_offsets, kv_offsets, b)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < len_q
        q = _tile(Q, qd, q_start, start_m, len_q, h, stride_qt, stride_qh, D, BLOCK_M, BLOCK_D, True, USE_TMA)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        lo, full_lo, full_hi, hi = band_ranges(start_m, len_kv, left, right, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, kd, vd, kv_start, h, stride_kt, stride_kh,
                                   stride_vt, stride_vh, offs_m, len_kv, lo, full_lo, left, right, s_scale,
                                   ACT, True, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT, USE_TMA)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, kd, vd, kv_start, h, stride_kt, stride_kh,
                                   stride_vt, stride_vh, offs_m, len_kv, full_lo, full_hi, left, right,
                                   s_scale, ACT, False, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION,
                                   FAST_ACT, USE_TMA)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, kd, vd, kv_start, h, stride_kt, stride_kh,
                                   stride_vt, stride_vh, offs_m, len_kv, full_hi, hi, left, right, s_scale,
                                   ACT, True, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT, USE_TMA)
        acc = fwd_finish(acc, m_i, l_i, LSE, q_start, offs_m, row_ok, h, n_heads, out_scale, ACT)
        store_rows(Out, acc, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)
        w = _next_item(counter)


# ------------------------------------------------------------------------------------------ dQ


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K, V, kd, vd, kv_start, h, stride_kt, stride_kh, stride_vt, stride_vh,
              offs_m, len_kv, lo, hi, left, right, s_scale,
              ACT: tl.constexpr, MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              PRECISION: tl.constexpr, FAST_ACT: tl.constexpr, USE_TMA: tl.constexpr):
    """``dS K`` over key tiles ``[lo, hi)`` into ``dq`` ``[BM, BD]`` (as :func:`.bwd._dq_tiles`)."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(K, kd, kv_start, start_n, len_kv, h, stride_kt, stride_kh, D, BLOCK_N, BLOCK_D, MASK,
                  USE_TMA)
        v = _tile(V, vd, kv_start, start_n, len_kv, h, stride_vt, stride_vh, DV, BLOCK_N, BLOCK_DV, MASK,
                  USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * s_scale  # [BM, BN]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BM, BN]
        ds = dq_tile_ds(s, dp, lse2, delta, offs_m, offs_n, len_kv, left, right, ACT, MASK, FAST_ACT)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def dq_persistent_kernel(Q, K, V, Out, DO, DQ, LSE, DELTA, q_offsets, kv_offsets, tiles, count, counter,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                          stride_oh, n_heads, n_tiles, total_q, total_kv, left, right, qk_scale, out_scale,
                          bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                          ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr,
                          USE_TMA: tl.constexpr):
    """Programs loop over (query tile, head) items: ``DQ``, and for softmax ``DELTA = rowsum(dO * O)``."""
    qd = _descriptor(Q, total_q, stride_qt, n_heads, D, BLOCK_M, BLOCK_D, USE_TMA)
    dod = _descriptor(DO, total_q, stride_ot, n_heads, DV, BLOCK_M, BLOCK_DV, USE_TMA)
    kd = _descriptor(K, total_kv, stride_kt, n_heads, D, BLOCK_N, BLOCK_D, USE_TMA)
    vd = _descriptor(V, total_kv, stride_vt, n_heads, DV, BLOCK_N, BLOCK_DV, USE_TMA)
    n_items = tl.load(count)
    s_scale, dq_scale, _ = bwd_scales(qk_scale, out_scale, ACT)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    w = _next_item(counter)
    while w < n_items:
        b, h, start_m = persistent_item(tiles, w, n_heads, n_tiles, BLOCK_M)
        q_start, len_q, kv_start, len_kv = seq_pair_bounds(q_offsets, kv_offsets, b)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < len_q
        q = _tile(Q, qd, q_start, start_m, len_q, h, stride_qt, stride_qh, D, BLOCK_M, BLOCK_D, True, USE_TMA)
        do = _tile(DO, dod, q_start, start_m, len_q, h, stride_ot, stride_oh, DV, BLOCK_M, BLOCK_DV, True,
                   USE_TMA)
        # Rows past the sequence (TMA) meet masked O loads: delta 0 there, and they are never stored.
        lse2, delta = row_stats(Out, LSE, do, q_start, offs_m, row_ok, h, n_heads, stride_ot, stride_oh,
                                 offs_dv, DV, ACT, BLOCK_M)
        if ACT == 0:
            tl.store(DELTA + (q_start + offs_m) * n_heads + h, delta, mask=row_ok)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lo, full_lo, full_hi, hi = band_ranges(start_m, len_kv, left, right, BLOCK_M, BLOCK_N)
        dq = _dq_inner(dq, q, do, lse2, delta, K, V, kd, vd, kv_start, h, stride_kt, stride_kh, stride_vt,
                       stride_vh, offs_m, len_kv, lo, full_lo, left, right, s_scale, ACT, True, D, DV,
                       BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT, USE_TMA)
        dq = _dq_inner(dq, q, do, lse2, delta, K, V, kd, vd, kv_start, h, stride_kt, stride_kh, stride_vt,
                       stride_vh, offs_m, len_kv, full_lo, full_hi, left, right, s_scale, ACT, False, D, DV,
                       BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT, USE_TMA)
        dq = _dq_inner(dq, q, do, lse2, delta, K, V, kd, vd, kv_start, h, stride_kt, stride_kh, stride_vt,
                       stride_vh, offs_m, len_kv, full_hi, hi, left, right, s_scale, ACT, True, D, DV,
                       BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT, USE_TMA)
        store_rows(DQ, dq * dq_scale, q_start, offs_m, row_ok, h, n_heads * D, D, offs_d, D)
        w = _next_item(counter)


# ------------------------------------------------------------------------------------------ dK/dV


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, qd, dod, LSE, DELTA, q_start, h, n_heads, stride_qt, stride_qh,
                stride_ot, stride_oh, offs_n, len_q, lo, hi, left, right, s_scale,
                ACT: tl.constexpr, MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                PRECISION: tl.constexpr, FAST_ACT: tl.constexpr, USE_TMA: tl.constexpr):
    """``P^T dO`` into ``dv``, ``dS^T Q`` into ``dk`` over query tiles ``[lo, hi)`` (as
    :func:`.bwd.dkdv_tiles`)."""
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _tile(Q, qd, q_start, start_m, len_q, h, stride_qt, stride_qh, D, BLOCK_M, BLOCK_D, MASK, USE_TMA)
        do = _tile(DO, dod, q_start, start_m, len_q, h, stride_ot, stride_oh, DV, BLOCK_M, BLOCK_DV, MASK,
                   USE_TMA)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * s_scale  # [BN, BM]: scores transposed
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BN, BM]
        pt, dst = dkdv_tile_grads(st, dpt, LSE, DELTA, q_start, offs_m, offs_n, len_q, h, n_heads, left,
                                  right, ACT, MASK, FAST_ACT)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def dkdv_persistent_kernel(Q, K, V, DO, DK, DV_, LSE, DELTA, q_offsets, kv_offsets, tiles, count, counter,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                            stride_oh, n_heads, n_tiles, total_q, total_kv, left, right, qk_scale, out_scale,
                            bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                            ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr,
                            USE_TMA: tl.constexpr):
    """Programs loop over (key tile, head) items: ``DK`` and ``DV_``, each looping over its query tiles."""
    qd = _descriptor(Q, total_q, stride_qt, n_heads, D, BLOCK_M, BLOCK_D, USE_TMA)
    dod = _descriptor(DO, total_q, stride_ot, n_heads, DV, BLOCK_M, BLOCK_DV, USE_TMA)
    kd = _descriptor(K, total_kv, stride_kt, n_heads, D, BLOCK_N, BLOCK_D, USE_TMA)
    vd = _descriptor(V, total_kv, stride_vt, n_heads, DV, BLOCK_N, BLOCK_DV, USE_TMA)
    n_items = tl.load(count)
    s_scale, dk_scale, dv_scale = bwd_scales(qk_scale, out_scale, ACT)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    w = _next_item(counter)
    while w < n_items:
        b, h, start_n = persistent_item(tiles, w, n_heads, n_tiles, BLOCK_N)
        q_start, len_q, kv_start, len_kv = seq_pair_bounds(q_offsets, kv_offsets, b)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < len_kv
        # Key rows past the sequence (TMA) only reach rows of dK/dV that are never stored.
        k = _tile(K, kd, kv_start, start_n, len_kv, h, stride_kt, stride_kh, D, BLOCK_N, BLOCK_D, True,
                  USE_TMA)
        v = _tile(V, vd, kv_start, start_n, len_kv, h, stride_vt, stride_vh, DV, BLOCK_N, BLOCK_DV, True,
                  USE_TMA)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        lo, full_lo, full_hi, hi = band_ranges(start_n, len_q, right, left, BLOCK_N, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, qd, dod, LSE, DELTA, q_start, h, n_heads, stride_qt,
                             stride_qh, stride_ot, stride_oh, offs_n, len_q, lo, full_lo, left, right,
                             s_scale, ACT, True, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT,
                             USE_TMA)
        dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, qd, dod, LSE, DELTA, q_start, h, n_heads, stride_qt,
                             stride_qh, stride_ot, stride_oh, offs_n, len_q, full_lo, full_hi, left, right,
                             s_scale, ACT, False, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT,
                             USE_TMA)
        dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, qd, dod, LSE, DELTA, q_start, h, n_heads, stride_qt,
                             stride_qh, stride_ot, stride_oh, offs_n, len_q, full_hi, hi, left, right,
                             s_scale, ACT, True, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT,
                             USE_TMA)
        store_rows(DK, dk * dk_scale, kv_start, offs_n, col_ok, h, n_heads * D, D, offs_d, D)
        store_rows(DV_, dv * dv_scale, kv_start, offs_n, col_ok, h, n_heads * DV, DV, offs_dv, DV)
        w = _next_item(counter)
