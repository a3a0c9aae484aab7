"""Forward Triton kernel of jagged attention (softmax and GDPA); see :mod:`.common`."""

# fmt: off
# (Kernel argument lists stay packed: one argument per line would triple the length of these files.)

from __future__ import annotations

import triton
import triton.language as tl

from gem_kernels.attention.triton.common import (
    band_ranges,
    load_rows,
    program_seq_head,
    program_tile_start,
    score_scale,
    seq_bounds,
    store_rows,
)
from gem_kernels.attention.triton.tile_math import fwd_finish, fwd_tile


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, K, V, k_row0, v_row0, stride_kt, stride_vt, offs_m, offs_d, offs_dv,
               len_kv, lo, hi, left, right, qk_scale,
               ACT: tl.constexpr, MASK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """Accumulate key tiles ``[lo, hi)`` into ``acc`` ``[BM, BDV]`` (and the running max/sum for softmax)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = K + k_row0 + offs_n[None, :].to(tl.int64) * stride_kt + offs_d[:, None]  # [BD, BN]
        v_ptrs = V + v_row0 + offs_n[:, None].to(tl.int64) * stride_vt + offs_dv[None, :]  # [BN, BDV]
        if MASK:
            kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < len_kv) & (offs_d[:, None] < D), other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < len_kv) & (offs_dv[None, :] < DV), other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < D, other=0.0)
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # [BM, BN] fp32
        acc, m_i, l_i = fwd_tile(acc, m_i, l_i, s, v, offs_m, offs_n, len_kv, left, right, ACT, MASK,
                                 PRECISION, FAST_ACT)
    return acc, m_i, l_i


@triton.jit
def fwd_kernel(Q, K, V, Out, LSE, q_offsets, kv_offsets,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                n_heads, left, right, qk_scale, out_scale,
                bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """One program per (sequence x head, query tile): ``Out`` ``[total_q, H, DV]``; ``LSE`` for softmax."""
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
        k_row0 = kv_start * stride_kt + h * stride_kh
        v_row0 = kv_start * stride_vt + h * stride_vh
        qk_scale = score_scale(qk_scale, ACT)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        lo, full_lo, full_hi, hi = band_ranges(start_m, len_kv, left, right, BLOCK_M, BLOCK_N)
        # Masked left edge of the band, unmasked interior, masked right edge (and sequence end).
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K, V, k_row0, v_row0, stride_kt, stride_vt, offs_m,
                                   offs_d, offs_dv, len_kv, lo, full_lo, left, right, qk_scale, ACT, True, D,
                                   DV, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K, V, k_row0, v_row0, stride_kt, stride_vt, offs_m,
                                   offs_d, offs_dv, len_kv, full_lo, full_hi, left, right, qk_scale, ACT,
                                   False, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K, V, k_row0, v_row0, stride_kt, stride_vt, offs_m,
                                   offs_d, offs_dv, len_kv, full_hi, hi, left, right, qk_scale, ACT, True, D,
                                   DV, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
        acc = fwd_finish(acc, m_i, l_i, LSE, q_start, offs_m, row_ok, h, n_heads, out_scale, ACT)
        store_rows(Out, acc, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)
