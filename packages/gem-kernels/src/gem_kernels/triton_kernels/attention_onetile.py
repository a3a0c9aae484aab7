"""Triton kernels for jagged attention whose keys (cross-attention) or queries (PMA) fit in one tile.

One program per (sequence, head) keeps the short side in registers and streams the long side in a
loop, so every tensor is read once and the loop's loads are pipelined:

- ``fwd_short_kv_kernel``: all keys of a sequence in one tile of BLOCK_N; loop over query tiles. The
  softmax needs no online rescaling (the whole row is in the tile).
- ``bwd_short_kv_kernel``: same split; each query tile's dQ is complete in its iteration, dK and dV
  accumulate in registers over the query tiles.
- ``bwd_few_q_kernel``: all queries in one tile of BLOCK_M; loop over key tiles. Each key tile's dK and dV
  are complete in its iteration, dQ accumulates in registers. (The PMA forward is the general forward
  kernel with one query tile per sequence.)

No atomics: a program writes only rows of its own sequence and head. Masks (the band, sequence ends) are
applied on every tile. Layout and conventions as in :mod:`.attention_common`.
"""

# fmt: off
# (Kernel argument lists stay packed: one argument per line would triple the length of this file.)

from __future__ import annotations

import triton
import triton.language as tl

from gem_kernels.triton_kernels.attention_common import (
    LN2,
    act_and_grad,
    bwd_scales,
    gdpa_act,
    load_rows,
    program_seq_head,
    row_stats,
    score_scale,
    seq_pair_bounds,
    store_rows,
    visible_mask,
)


@triton.jit
def fwd_short_kv_kernel(Q, K, V, Out, LSE, q_offsets, kv_offsets,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                         stride_oh,
                         n_heads, left, right, qk_scale, out_scale,
                         bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                         ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    b, h = program_seq_head(n_heads)
    q_start, len_q, kv_start, len_kv = seq_pair_bounds(q_offsets, kv_offsets, b)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < len_kv
    kt = tl.load(K + (kv_start + offs_n[None, :]) * stride_kt + h * stride_kh + offs_d[:, None],
                 mask=col_ok[None, :] & (offs_d[:, None] < D), other=0.0)  # [BD, BN]
    v = load_rows(V, kv_start, offs_n, col_ok, h, stride_vt, stride_vh, offs_dv, DV)  # [BN, BDV]
    s_scale = score_scale(qk_scale, ACT)
    for start_m in range(0, len_q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < len_q
        q = load_rows(Q, q_start, offs_m, row_ok, h, stride_qt, stride_qh, offs_d, D)
        s = tl.dot(q, kt, input_precision=PRECISION) * s_scale  # [BM, BN]
        visible = visible_mask(offs_m, offs_n, len_q, len_kv, left, right)
        if ACT == 0:
            s = tl.where(visible, s, float("-inf"))
            m = tl.max(s, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = tl.sum(p, 1)
            empty = l_i == 0.0
            o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION) / tl.where(empty, 1.0, l_i)[:, None]
            lse = tl.where(empty, float("-inf"), (m_safe + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
            tl.store(LSE + (q_start + offs_m) * n_heads + h, lse, mask=row_ok)
        else:
            p = tl.where(visible, gdpa_act(s, ACT, FAST_ACT), 0.0)
            o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION) * out_scale
        store_rows(Out, o, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)


@triton.jit
def _probs_and_dscores(s, dp, lse2, delta, visible, ACT: tl.constexpr, FAST_ACT: tl.constexpr):
    """(P, dS) of one tile, zero where not visible: softmax from the saved log-sum-exp, or act/act'."""
    if ACT == 0:
        p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
    else:
        a, da = act_and_grad(s, ACT, FAST_ACT)
        p = tl.where(visible, a, 0.0)
        ds = tl.where(visible, dp * da, 0.0)
    return p, ds


@triton.jit
def bwd_short_kv_kernel(Q, K, V, Out, DO, DQ, DK, DV_, LSE, q_offsets, kv_offsets,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                         stride_oh,
                         n_heads, left, right, qk_scale, out_scale,
                         bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                         ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    b, h = program_seq_head(n_heads)
    q_start, len_q, kv_start, len_kv = seq_pair_bounds(q_offsets, kv_offsets, b)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < len_kv
    k = load_rows(K, kv_start, offs_n, col_ok, h, stride_kt, stride_kh, offs_d, D)
    v = load_rows(V, kv_start, offs_n, col_ok, h, stride_vt, stride_vh, offs_dv, DV)
    s_scale, g_scale, v_scale = bwd_scales(qk_scale, out_scale, ACT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for start_m in range(0, len_q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < len_q
        q = load_rows(Q, q_start, offs_m, row_ok, h, stride_qt, stride_qh, offs_d, D)
        do = load_rows(DO, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)
        lse2, delta = row_stats(Out, LSE, do, q_start, offs_m, row_ok, h, n_heads, stride_ot, stride_oh,
                                 offs_dv, DV, ACT, BLOCK_M)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * s_scale  # [BM, BN]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BM, BN]
        visible = visible_mask(offs_m, offs_n, len_q, len_kv, left, right)
        p, ds = _probs_and_dscores(s, dp, lse2, delta, visible, ACT, FAST_ACT)
        dq = tl.dot(ds.to(k.dtype), k, input_precision=PRECISION) * g_scale
        store_rows(DQ, dq, q_start, offs_m, row_ok, h, n_heads * D, D, offs_d, D)
        dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=PRECISION)
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=PRECISION)
    store_rows(DK, dk * g_scale, kv_start, offs_n, col_ok, h, n_heads * D, D, offs_d, D)
    store_rows(DV_, dv * v_scale, kv_start, offs_n, col_ok, h, n_heads * DV, DV, offs_dv, DV)


@triton.jit
def bwd_few_q_kernel(Q, K, V, Out, DO, DQ, DK, DV_, LSE, q_offsets, kv_offsets,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                      n_heads, left, right, qk_scale, out_scale,
                      bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                      ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    b, h = program_seq_head(n_heads)
    q_start, len_q, kv_start, len_kv = seq_pair_bounds(q_offsets, kv_offsets, b)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    q = load_rows(Q, q_start, offs_m, row_ok, h, stride_qt, stride_qh, offs_d, D)
    do = load_rows(DO, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)
    lse2, delta = row_stats(Out, LSE, do, q_start, offs_m, row_ok, h, n_heads, stride_ot, stride_oh,
                             offs_dv, DV, ACT, BLOCK_M)
    s_scale, g_scale, v_scale = bwd_scales(qk_scale, out_scale, ACT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, len_kv, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < len_kv
        k = load_rows(K, kv_start, offs_n, col_ok, h, stride_kt, stride_kh, offs_d, D)
        v = load_rows(V, kv_start, offs_n, col_ok, h, stride_vt, stride_vh, offs_dv, DV)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * s_scale  # [BM, BN]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BM, BN]
        visible = visible_mask(offs_m, offs_n, len_q, len_kv, left, right)
        p, ds = _probs_and_dscores(s, dp, lse2, delta, visible, ACT, FAST_ACT)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION) * v_scale  # [BN, BDV]
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION) * g_scale  # [BN, BD]
        store_rows(DK, dk, kv_start, offs_n, col_ok, h, n_heads * D, D, offs_d, D)
        store_rows(DV_, dv, kv_start, offs_n, col_ok, h, n_heads * DV, DV, offs_dv, DV)
    store_rows(DQ, dq * g_scale, q_start, offs_m, row_ok, h, n_heads * D, D, offs_d, D)
