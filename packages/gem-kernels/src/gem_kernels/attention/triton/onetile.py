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
applied on every tile. Layout and conventions as in :mod:`.common`.

Split backward (``*_split_kernel``): the same two backward kernels with the long side cut into chunks of
``chunk`` rows (a whole number of streamed tiles), one program per (chunk, head), so that a long sequence no
longer makes one long serial program. Sequence ``b`` owns ``max(1, ceil(len_b / chunk))`` chunks, numbered
globally by ``chunk_starts`` ``[B+1]`` (an exclusive prefix sum of those counts, computed on the device);
program ``p`` finds its sequence by a binary search of it (``jagged.segment_of_item``, as the block kernels
do), and programs past ``chunk_starts[B]`` (the grid is an upper bound, no host sync) exit at once. The
streamed side's gradients are complete per tile, as before. The resident side's gradient (dK/dV of the keys
for ``short_kv``, dQ of the queries for ``few_q``) is written directly when the sequence is one chunk;
otherwise each chunk writes its fp32 partial to a workspace ``[chunks, H, BLOCK, D]`` (row ``p`` of chunk
``p``), and ``sum_chunk_partials_kernel`` (one program per sequence and head) adds a sequence's partials in
chunk order and rounds once: deterministic, no atomics.

Both forms share their body: ``bwd_short_kv_stream`` and ``bwd_few_q_stream`` run the backward over the long
side's rows ``[lo, hi)`` (the whole-stream kernels pass ``0`` and the length) and return the resident side's
unscaled gradient; the kernels around them only find their rows and store that gradient.
"""

# fmt: off
# (Kernel argument lists stay packed: one argument per line would triple the length of this file.)

from __future__ import annotations

import triton
import triton.language as tl

from gem_kernels.attention.triton.common import (
    LN2,
    act_and_grad,
    bwd_scales,
    gdpa_act,
    load_rows,
    program_seq_head,
    row_stats,
    score_scale,
    seq_bounds,
    seq_pair_bounds,
    store_rows,
    visible_mask,
)
from gem_kernels.jagged.triton import segment_of_item


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
def bwd_short_kv_stream(Q, K, V, Out, DO, DQ, LSE, q_start, kv_start, len_kv, lo, hi, h, n_heads,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                        stride_oh, left, right, qk_scale, out_scale,
                        ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """The body of the ``short_kv`` backward over query rows ``[lo, hi)`` of one sequence and head ``h``
    (``hi`` serves as the rows' end: ``row_ok`` and the mask): the sequence's ``len_kv <= BLOCK_N`` keys and
    values stay in registers, the query tiles stream past them, and each tile's dQ ``[BM, BD]`` is written.
    Returns the sums over those rows of dK ``[BN, BD]`` and dV ``[BN, BDV]``, fp32 and not yet scaled (by
    ``g_scale`` and ``v_scale`` of :func:`bwd_scales`; the whole-stream kernel scales each as it stores it,
    which keeps its generated code as it was before this helper)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < len_kv
    k = load_rows(K, kv_start, offs_n, col_ok, h, stride_kt, stride_kh, offs_d, D)
    v = load_rows(V, kv_start, offs_n, col_ok, h, stride_vt, stride_vh, offs_dv, DV)
    s_scale, g_scale, _ = bwd_scales(qk_scale, out_scale, ACT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < hi
        q = load_rows(Q, q_start, offs_m, row_ok, h, stride_qt, stride_qh, offs_d, D)
        do = load_rows(DO, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)
        lse2, delta = row_stats(Out, LSE, do, q_start, offs_m, row_ok, h, n_heads, stride_ot, stride_oh,
                                 offs_dv, DV, ACT, BLOCK_M)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * s_scale  # [BM, BN]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BM, BN]
        visible = visible_mask(offs_m, offs_n, hi, len_kv, left, right)
        p, ds = _probs_and_dscores(s, dp, lse2, delta, visible, ACT, FAST_ACT)
        dq = tl.dot(ds.to(k.dtype), k, input_precision=PRECISION) * g_scale
        store_rows(DQ, dq, q_start, offs_m, row_ok, h, n_heads * D, D, offs_d, D)
        dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=PRECISION)
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


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
    dk, dv = bwd_short_kv_stream(Q, K, V, Out, DO, DQ, LSE, q_start, kv_start, len_kv, 0, len_q, h, n_heads,
                                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                                 stride_oh, left, right, qk_scale, out_scale,
                                 ACT, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
    _, g_scale, v_scale = bwd_scales(qk_scale, out_scale, ACT)
    offs_n = tl.arange(0, BLOCK_N)
    col_ok = offs_n < len_kv
    store_rows(DK, dk * g_scale, kv_start, offs_n, col_ok, h, n_heads * D, D, tl.arange(0, BLOCK_D), D)
    store_rows(DV_, dv * v_scale, kv_start, offs_n, col_ok, h, n_heads * DV, DV, tl.arange(0, BLOCK_DV), DV)


@triton.jit
def bwd_few_q_stream(Q, K, V, Out, DO, DK, DV_, LSE, q_start, len_q, kv_start, lo, hi, h, n_heads,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                     left, right, qk_scale, out_scale,
                     ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """The body of the ``few_q`` backward over key rows ``[lo, hi)`` of one sequence and head ``h`` (``hi``
    serves as the keys' end: ``col_ok`` and the mask): the sequence's ``len_q <= BLOCK_M`` queries (with
    dO and the row statistics) stay in registers, the key tiles stream past them, and each tile's dK
    ``[BN, BD]`` and dV ``[BN, BDV]`` are written. Returns the sum over those keys of dQ ``[BM, BD]``, fp32
    and not yet scaled (by ``g_scale`` of :func:`bwd_scales`)."""
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
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        k = load_rows(K, kv_start, offs_n, col_ok, h, stride_kt, stride_kh, offs_d, D)
        v = load_rows(V, kv_start, offs_n, col_ok, h, stride_vt, stride_vh, offs_dv, DV)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * s_scale  # [BM, BN]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BM, BN]
        visible = visible_mask(offs_m, offs_n, len_q, hi, left, right)
        p, ds = _probs_and_dscores(s, dp, lse2, delta, visible, ACT, FAST_ACT)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION) * v_scale  # [BN, BDV]
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION) * g_scale  # [BN, BD]
        store_rows(DK, dk, kv_start, offs_n, col_ok, h, n_heads * D, D, offs_d, D)
        store_rows(DV_, dv, kv_start, offs_n, col_ok, h, n_heads * DV, DV, offs_dv, DV)
    return dq


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
    dq = bwd_few_q_stream(Q, K, V, Out, DO, DK, DV_, LSE, q_start, len_q, kv_start, 0, len_kv, h, n_heads,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                          stride_oh, left, right, qk_scale, out_scale,
                          ACT, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
    _, g_scale, _ = bwd_scales(qk_scale, out_scale, ACT)
    offs_m = tl.arange(0, BLOCK_M)
    store_rows(DQ, dq * g_scale, q_start, offs_m, offs_m < len_q, h, n_heads * D, D, tl.arange(0, BLOCK_D), D)


@triton.jit
def program_chunk(chunk_starts, n_seqs, chunk, LOG_B: tl.constexpr):
    """``(sequence b, head h, global chunk p, chunks of b, first long-side row of the chunk)`` of this
    program of a split kernel (grid ``(chunks upper bound, H)``); ``p`` is past the last chunk for spare
    programs (the caller returns first)."""
    p = tl.program_id(0)
    b = segment_of_item(chunk_starts, p, n_seqs, LOG_B)  # every sequence owns a chunk
    first = tl.load(chunk_starts + b)
    n_chunks = tl.load(chunk_starts + b + 1) - first
    return b, tl.program_id(1), p, n_chunks, (p - first) * chunk


@triton.jit
def bwd_short_kv_split_kernel(Q, K, V, Out, DO, DQ, DK, DV_, LSE, q_offsets, kv_offsets, chunk_starts,
                               DK_part, DV_part,
                               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                               stride_oh,
                               n_heads, left, right, qk_scale, out_scale, n_seqs, chunk,
                               bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                               ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr,
                               LOG_B: tl.constexpr):
    """:func:`bwd_short_kv_kernel` over query rows ``[lo, lo + chunk)`` of one sequence (see the module
    docstring): dQ of those rows, and dK/dV of the sequence (one chunk) or their partial (several)."""
    if tl.program_id(0) >= tl.load(chunk_starts + n_seqs):
        return
    b, h, p, n_chunks, lo = program_chunk(chunk_starts, n_seqs, chunk, LOG_B)
    q_start, len_q, kv_start, len_kv = seq_pair_bounds(q_offsets, kv_offsets, b)
    hi = tl.minimum(lo + chunk, len_q)  # the chunk's rows end here
    dk, dv = bwd_short_kv_stream(Q, K, V, Out, DO, DQ, LSE, q_start, kv_start, len_kv, lo, hi, h, n_heads,
                                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                                 stride_oh, left, right, qk_scale, out_scale,
                                 ACT, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
    # One chunk: dK/dV; several: the partial, to the workspace [chunks, H, BLOCK_N, D] fp32. Both stores are
    # issued and masked (no traffic for the masked one): an if/else spilled ~400 more bytes on sm_90.
    _, g_scale, v_scale = bwd_scales(qk_scale, out_scale, ACT)
    dk = dk * g_scale
    dv = dv * v_scale
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < len_kv
    whole, partial = col_ok & (n_chunks == 1), col_ok & (n_chunks > 1)
    store_rows(DK, dk, kv_start, offs_n, whole, h, n_heads * D, D, offs_d, D)
    store_rows(DV_, dv, kv_start, offs_n, whole, h, n_heads * DV, DV, offs_dv, DV)
    part = p.to(tl.int64) * n_heads * BLOCK_N
    store_rows(DK_part, dk, part, offs_n, partial, h, D, BLOCK_N * D, offs_d, D)
    store_rows(DV_part, dv, part, offs_n, partial, h, DV, BLOCK_N * DV, offs_dv, DV)


@triton.jit
def bwd_few_q_split_kernel(Q, K, V, Out, DO, DQ, DK, DV_, LSE, q_offsets, kv_offsets, chunk_starts, DQ_part,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                            stride_oh,
                            n_heads, left, right, qk_scale, out_scale, n_seqs, chunk,
                            bucket_b, bucket_q, bucket_kv, band_kind,  # autotune keys only
                            ACT: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr,
                            LOG_B: tl.constexpr):
    """:func:`bwd_few_q_kernel` over key rows ``[lo, lo + chunk)`` of one sequence (see the module
    docstring): dK/dV of those keys, and dQ of the sequence (one chunk) or its partial (several)."""
    if tl.program_id(0) >= tl.load(chunk_starts + n_seqs):
        return
    b, h, p, n_chunks, lo = program_chunk(chunk_starts, n_seqs, chunk, LOG_B)
    q_start, len_q, kv_start, len_kv = seq_pair_bounds(q_offsets, kv_offsets, b)
    hi = tl.minimum(lo + chunk, len_kv)  # the chunk's keys end here
    dq = bwd_few_q_stream(Q, K, V, Out, DO, DK, DV_, LSE, q_start, len_q, kv_start, lo, hi, h, n_heads,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                          stride_oh, left, right, qk_scale, out_scale,
                          ACT, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, FAST_ACT)
    # One chunk: dQ; several: the partial, to the workspace [chunks, H, BLOCK_M, D] fp32 (masked stores, as
    # in bwd_short_kv_split_kernel).
    _, g_scale, _ = bwd_scales(qk_scale, out_scale, ACT)
    dq = dq * g_scale
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < len_q
    offs_d = tl.arange(0, BLOCK_D)
    store_rows(DQ, dq, q_start, offs_m, row_ok & (n_chunks == 1), h, n_heads * D, D, offs_d, D)
    part = p.to(tl.int64) * n_heads * BLOCK_M
    store_rows(DQ_part, dq, part, offs_m, row_ok & (n_chunks > 1), h, D, BLOCK_M * D, offs_d, D)


@triton.jit
def sum_chunk_partials_kernel(Part, X, chunk_starts, offsets, n_heads,
                               D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows of sequence ``program_id(0)``, head ``program_id(1)`` of ``X`` ``[T, H, D]`` (contiguous) =
    the sum of the sequence's chunk partials in ``Part`` ``[chunks, H, BLOCK_R, D]`` fp32, in chunk order
    (deterministic), rounded once. Sequences of one chunk were written by the split kernel: skipped."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.load(chunk_starts + b)
    n_chunks = tl.load(chunk_starts + b + 1) - first
    if n_chunks <= 1:
        return
    start, length = seq_bounds(offsets, b)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    ok = offs_r < length
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for i in range(n_chunks):
        part = (first + i).to(tl.int64) * n_heads * BLOCK_R
        acc += load_rows(Part, part, offs_r, ok, h, D, BLOCK_R * D, offs_d, D)
    store_rows(X, acc, start, offs_r, ok, h, n_heads * D, D, offs_d, D)
