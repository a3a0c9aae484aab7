"""Backward Triton kernels of jagged attention: dQ (and delta) first, then dK/dV; no atomics.

See :mod:`.common` for the layout and the band. Softmax: ``P = exp(S - lse)``,
``dS = P * (dO V^T - delta)``. GDPA: ``dS = out_scale * (dO V^T) * act'(S)``. Then ``dQ = qk_scale dS K``,
``dK = qk_scale dS^T Q``, ``dV = P^T dO`` (``out_scale * act(S)^T dO`` for GDPA).
"""

# fmt: off
# (Kernel argument lists stay packed: one argument per line would triple the length of this file.)

from __future__ import annotations

import triton
import triton.language as tl

from gem_kernels.attention.triton.common import (
    band_ranges,
    load_rows,
    program_seq_head,
    program_tile_start,
    row_stats,
    score_scale,
    seq_bounds,
    store_rows,
)
from gem_kernels.attention.triton.tile_math import dkdv_tile_grads, dq_tile_ds


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, K, V, k_row0, v_row0, stride_kt, stride_vt, offs_m, offs_d, offs_dv,
              len_kv, lo, hi, left, right, s_scale,
              ACT: tl.constexpr, MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """Accumulate ``dS K`` over key tiles ``[lo, hi)`` into ``dq`` ``[BM, BD]`` (unscaled)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = K + k_row0 + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :]  # [BN, BD]
        vt_ptrs = V + v_row0 + offs_n[None, :].to(tl.int64) * stride_vt + offs_dv[:, None]  # [BDV, BN]
        if MASK:
            k = tl.load(k_ptrs, mask=(offs_n[:, None] < len_kv) & (offs_d[None, :] < D), other=0.0)
            vt = tl.load(vt_ptrs, mask=(offs_n[None, :] < len_kv) & (offs_dv[:, None] < DV), other=0.0)
        else:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_dv[:, None] < DV, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * s_scale  # [BM, BN]
        dp = tl.dot(do, vt, input_precision=PRECISION)  # [BM, BN]
        ds = dq_tile_ds(s, dp, lse2, delta, offs_m, offs_n, len_kv, left, right, ACT, MASK, FAST_ACT)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def dq_kernel(Q, K, V, Out, DO, DQ, LSE, DELTA, q_offsets, kv_offsets,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
               n_heads, left, right, qk_scale, out_scale,
               bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
               ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """One program per (sequence x head, query tile): ``DQ``, and for softmax ``DELTA = rowsum(dO * O)``."""
    b, h = program_seq_head(n_heads)
    start_m = program_tile_start(BLOCK_M, True)
    q_start, len_q = seq_bounds(q_offsets, b)
    if start_m < len_q:
        kv_start, len_kv = seq_bounds(kv_offsets, b)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < len_q
        q = load_rows(Q, q_start, offs_m, row_ok, h, stride_qt, stride_qh, offs_d, D)
        do = load_rows(DO, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)
        # Rows with no visible key (lse = -inf) get lse2 = +inf, hence p = 0 instead of inf.
        lse2, delta = row_stats(Out, LSE, do, q_start, offs_m, row_ok, h, n_heads, stride_ot, stride_oh,
                                 offs_dv, DV, ACT, BLOCK_M)
        if ACT == 0:
            tl.store(DELTA + (q_start + offs_m) * n_heads + h, delta, mask=row_ok)
        s_scale = score_scale(qk_scale, ACT)
        k_row0 = kv_start * stride_kt + h * stride_kh
        v_row0 = kv_start * stride_vt + h * stride_vh
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lo, full_lo, full_hi, hi = band_ranges(start_m, len_kv, left, right, BLOCK_M, BLOCK_N)
        dq = _dq_tiles(dq, q, do, lse2, delta, K, V, k_row0, v_row0, stride_kt, stride_vt, offs_m, offs_d,
                       offs_dv, len_kv, lo, full_lo, left, right, s_scale, ACT, True, D, DV, BLOCK_N, BLOCK_D,
                       BLOCK_DV, PRECISION, FAST_ACT)
        dq = _dq_tiles(dq, q, do, lse2, delta, K, V, k_row0, v_row0, stride_kt, stride_vt, offs_m, offs_d,
                       offs_dv, len_kv, full_lo, full_hi, left, right, s_scale, ACT, False, D, DV, BLOCK_N,
                       BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
        dq = _dq_tiles(dq, q, do, lse2, delta, K, V, k_row0, v_row0, stride_kt, stride_vt, offs_m, offs_d,
                       offs_dv, len_kv, full_hi, hi, left, right, s_scale, ACT, True, D, DV, BLOCK_N, BLOCK_D,
                       BLOCK_DV, PRECISION, FAST_ACT)
        if ACT == 0:
            dq = dq * qk_scale
        else:
            dq = dq * (qk_scale * out_scale)
        store_rows(DQ, dq, q_start, offs_m, row_ok, h, n_heads * D, D, offs_d, D)


@triton.jit
def dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, q_start, h, n_heads, stride_qt, stride_qh, stride_ot,
               stride_oh, offs_n, offs_d, offs_dv, len_q, lo, hi, left, right, s_scale,
               ACT: tl.constexpr, MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """Accumulate ``P^T dO`` into ``dv`` and ``dS^T Q`` into ``dk`` over query tiles ``[lo, hi)``."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qt_ptrs = Q + (q_start + offs_m[None, :]) * stride_qt + h * stride_qh + offs_d[:, None]  # [BD, BM]
        do_ptrs = DO + (q_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :]  # [BM, BDV]
        if MASK:
            qt = tl.load(qt_ptrs, mask=(offs_m[None, :] < len_q) & (offs_d[:, None] < D), other=0.0)
            do = tl.load(do_ptrs, mask=(offs_m[:, None] < len_q) & (offs_dv[None, :] < DV), other=0.0)
        else:
            qt = tl.load(qt_ptrs, mask=offs_d[:, None] < D, other=0.0)
            do = tl.load(do_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
        st = tl.dot(k, qt, input_precision=PRECISION) * s_scale  # [BN, BM]: scores transposed
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BN, BM]
        pt, dst = dkdv_tile_grads(st, dpt, LSE, DELTA, q_start, offs_m, offs_n, len_q, h, n_heads, left,
                                  right, ACT, MASK, FAST_ACT)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def dkdv_band(k, v, Q, DO, LSE, DELTA, q_start, h, n_heads, stride_qt, stride_qh, stride_ot, stride_oh,
              offs_n, offs_d, offs_dv, start_n, len_q, left, right, s_scale,
              ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
              FAST_ACT: tl.constexpr):
    """Unscaled fp32 ``dk`` ``[BLOCK_N, BLOCK_D]`` and ``dv`` ``[BLOCK_N, BLOCK_DV]`` of the key tile at
    ``start_n`` over every query tile that sees it: :func:`dkdv_tiles` on the masked tiles at each edge of
    the band and on the full tiles between them."""
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # Query i sees key j iff j - right <= i <= j + left: the band seen from the key side.
    lo, full_lo, full_hi, hi = band_ranges(start_n, len_q, right, left, BLOCK_N, BLOCK_M)
    dk, dv = dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, q_start, h, n_heads, stride_qt, stride_qh,
                        stride_ot, stride_oh, offs_n, offs_d, offs_dv, len_q, lo, full_lo, left, right,
                        s_scale, ACT, True, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
    dk, dv = dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, q_start, h, n_heads, stride_qt, stride_qh,
                        stride_ot, stride_oh, offs_n, offs_d, offs_dv, len_q, full_lo, full_hi, left, right,
                        s_scale, ACT, False, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
    dk, dv = dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, q_start, h, n_heads, stride_qt, stride_qh,
                        stride_ot, stride_oh, offs_n, offs_d, offs_dv, len_q, full_hi, hi, left, right,
                        s_scale, ACT, True, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
    return dk, dv


@triton.jit
def dkdv_kernel(Q, K, V, DO, DK, DV_, LSE, DELTA, q_offsets, kv_offsets,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                 n_heads, left, right, qk_scale, out_scale,
                 bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                 ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """One program per (sequence x head, key tile): ``DK`` and ``DV_``, looping over the query tiles."""
    b, h = program_seq_head(n_heads)
    # Earlier key tiles are seen by more queries under a causal band: they come first anyway.
    start_n = program_tile_start(BLOCK_N, False)
    kv_start, len_kv = seq_bounds(kv_offsets, b)
    if start_n < len_kv:
        q_start, len_q = seq_bounds(q_offsets, b)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        col_ok = offs_n < len_kv
        k = load_rows(K, kv_start, offs_n, col_ok, h, stride_kt, stride_kh, offs_d, D)
        v = load_rows(V, kv_start, offs_n, col_ok, h, stride_vt, stride_vh, offs_dv, DV)
        s_scale = score_scale(qk_scale, ACT)
        dk, dv = dkdv_band(k, v, Q, DO, LSE, DELTA, q_start, h, n_heads, stride_qt, stride_qh, stride_ot,
                           stride_oh, offs_n, offs_d, offs_dv, start_n, len_q, left, right, s_scale, ACT, D,
                           DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
        if ACT == 0:
            dk = dk * qk_scale
        else:
            dk = dk * (qk_scale * out_scale)
            dv = dv * out_scale
        store_rows(DK, dk, kv_start, offs_n, col_ok, h, n_heads * D, D, offs_d, D)
        store_rows(DV_, dv, kv_start, offs_n, col_ok, h, n_heads * DV, DV, offs_dv, DV)
