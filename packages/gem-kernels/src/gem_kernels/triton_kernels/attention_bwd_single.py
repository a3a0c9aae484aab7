"""Single-pass backward of jagged attention: dK, dV and dQ from one loop over each key tile's query tiles.

The two-kernel backward (:mod:`.attention_bwd`) recomputes the scores twice: the dQ kernel (``S = Q K^T``,
``dP = dO V^T``, ``dQ += dS K``: three matrix products per tile pair) and the dK/dV kernel (``S``, ``dP``,
``dV += P^T dO``, ``dK += dS^T Q``: four). Here the dK/dV loop also adds ``dS K`` of each query tile into an
fp32 ``dQ`` accumulator with atomic adds (as FlashAttention-2 and -3 do): five products per tile pair
instead of seven, for atomic traffic of one fp32 ``[BLOCK_M, D]`` tile per pair. Softmax needs ``delta =
rowsum(dO * O)`` before the loop: :func:`delta_kernel`, a pass over O and dO. The summation order of ``dQ``
then depends on the schedule (not bitwise reproducible from run to run, like FlashAttention's).

Layout, band and conventions as in :mod:`.attention_common`; scales as in :func:`.attention_common.bwd_scales`
(dQ is scaled before it is added, so the accumulator holds the final fp32 gradient).
"""

# fmt: off
# (Kernel argument lists stay packed: one argument per line would triple the length of this file.)

from __future__ import annotations

import triton
import triton.language as tl

from gem_kernels.triton_kernels.attention_bwd import dkdv_band
from gem_kernels.triton_kernels.attention_common import (
    bwd_scales,
    load_rows,
    program_seq_head,
    program_tile_start,
    row_stats,
    seq_bounds,
    store_rows,
)


@triton.jit
def delta_kernel(Out, DO, LSE, DELTA, q_offsets, stride_ot, stride_oh, n_heads,
                 DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per (sequence x head, query tile): ``DELTA`` ``[total_q, H]`` fp32 ``= rowsum(dO * O)``
    (softmax only; ``DO`` is addressed with ``Out``'s strides)."""
    b, h = program_seq_head(n_heads)
    start_m = program_tile_start(BLOCK_M, False)
    q_start, len_q = seq_bounds(q_offsets, b)
    if start_m < len_q:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < len_q
        do = load_rows(DO, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)
        _, delta = row_stats(Out, LSE, do, q_start, offs_m, row_ok, h, n_heads, stride_ot, stride_oh, offs_dv,
                             DV, 0, BLOCK_M)
        tl.store(DELTA + (q_start + offs_m) * n_heads + h, delta, mask=row_ok)


@triton.jit
def single_pass_kernel(Q, K, V, DO, DQ, DK, DV_, LSE, DELTA, q_offsets, kv_offsets,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                       n_heads, left, right, qk_scale, out_scale,
                       bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                       ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """One program per (sequence x head, key tile): ``DK`` and ``DV_``, and its share of ``DQ`` (fp32,
    zeroed by the caller, added to atomically), looping over the query tiles that see the key tile."""
    b, h = program_seq_head(n_heads)
    start_n = program_tile_start(BLOCK_N, False)
    kv_start, len_kv = seq_bounds(kv_offsets, b)
    if start_n < len_kv:
        q_start, len_q = seq_bounds(q_offsets, b)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        col_ok = offs_n < len_kv
        # Key rows past the sequence load as 0 (K and V): finite scores, and no share of dQ (dS K = 0 there).
        k = load_rows(K, kv_start, offs_n, col_ok, h, stride_kt, stride_kh, offs_d, D)
        v = load_rows(V, kv_start, offs_n, col_ok, h, stride_vt, stride_vh, offs_dv, DV)
        s_scale, g_scale, v_scale = bwd_scales(qk_scale, out_scale, ACT)
        dk, dv = dkdv_band(k, v, Q, DO, LSE, DELTA, DQ, q_start, h, n_heads, stride_qt, stride_qh, stride_ot,
                           stride_oh, offs_n, offs_d, offs_dv, start_n, len_q, left, right, s_scale, g_scale,
                           ACT, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT, True)
        store_rows(DK, dk * g_scale, kv_start, offs_n, col_ok, h, n_heads * D, D, offs_d, D)
        store_rows(DV_, dv * v_scale, kv_start, offs_n, col_ok, h, n_heads * DV, DV, offs_dv, DV)
