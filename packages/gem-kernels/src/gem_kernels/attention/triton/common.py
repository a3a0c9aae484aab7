"""Shared Triton helpers of the jagged attention kernels: activations, the band of visible tiles and keys,
sequence bounds, loads and stores of per-head row tiles, and the softmax row statistics of the backward.

Layout: q/o/do/dq ``[total_q, H, *]``, k/v/dk/dv ``[total_kv, H, *]``, rows of one head ``stride_t`` apart;
``lse``/``delta`` ``[total_q, H]`` fp32. Inputs may be strided views (unit stride in the last dim); outputs
and gradients are allocated contiguous, so their row stride is ``H * D``. Grids are ``(B*H, tiles of the
longest sequence)``: a program whose tile starts past its sequence's end does nothing, and the loop over the
other side only visits tiles inside the causal/window band. Each loop runs in three phases, ``[lo,
full_lo)`` masked, ``[full_lo, full_hi)`` unmasked (tiles wholly inside the sequence and the band),
``[full_hi, hi)`` masked, so that only edge tiles pay for masking.

Band: key ``j`` is visible from query ``i`` iff ``i - left <= j <= i + right``; the launcher passes a large
number for an unbounded side. Softmax works in base 2 (``qk_scale`` is pre-multiplied by log2(e)); the
saved ``lse`` is natural-log, ``-inf`` for a row with no visible key.

Backward, no atomics: ``dq_kernel`` (one program per query tile, also writes ``delta = rowsum(dO * O)`` for
softmax) runs first, then ``dkdv_kernel`` (one program per key tile, looping over query tiles).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# 2 * sqrt(2 / pi): gelu_tanh(x) = x * sigmoid((x + 0.044715 x^3) * GELU_K). Globals used in kernels must be
# constexpr; keep them on the right of a product (the interpreter mishandles constexpr * tensor).
GELU_K: tl.constexpr = tl.constexpr(1.5957691216057308)


@triton.jit
def _tanh_approx(x):
    # One MUFU instruction (max relative error ~2^-11), instead of the exp and the reciprocal of a sigmoid.
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    """sigmoid(x); with FAST (CUDA, 16-bit inputs) as 0.5 + 0.5 tanh(x / 2) on the hardware tanh."""
    if FAST:
        y = 0.5 + 0.5 * _tanh_approx(0.5 * x)
    else:
        y = tl.sigmoid(x)
    return y


@triton.jit
def gdpa_act(s, ACT: tl.constexpr, FAST: tl.constexpr):
    """GDPA activation (ACT: 1 silu, 2 gelu-tanh, 3 relu, 4 relu2, 5 identity)."""
    if ACT == 1:
        y = s * _sigmoid(s, FAST)
    elif ACT == 2:
        y = s * _sigmoid((s + 0.044715 * s * s * s) * GELU_K, FAST)
    elif ACT == 3:
        y = tl.maximum(s, 0.0)
    elif ACT == 4:
        r = tl.maximum(s, 0.0)
        y = r * r
    else:
        y = s
    return y


@triton.jit
def act_and_grad(s, ACT: tl.constexpr, FAST: tl.constexpr):
    """(act(s), act'(s)) sharing the sigmoid."""
    if ACT == 1:
        sg = _sigmoid(s, FAST)
        y = s * sg
        dy = sg * (1.0 + s * (1.0 - sg))
    elif ACT == 2:
        sg = _sigmoid((s + 0.044715 * s * s * s) * GELU_K, FAST)
        y = s * sg
        dy = sg + s * sg * (1.0 - sg) * GELU_K * (1.0 + 3 * 0.044715 * s * s)
    elif ACT == 3:
        y = tl.maximum(s, 0.0)
        dy = tl.where(s > 0.0, 1.0, 0.0)
    elif ACT == 4:
        r = tl.maximum(s, 0.0)
        y = r * r
        dy = 2.0 * r
    else:
        y = s
        dy = tl.full(s.shape, 1.0, tl.float32)
    return y, dy


@triton.jit
def band_ranges(start, len_inner, lo_dist, hi_dist, BLOCK_OUTER: tl.constexpr, BLOCK_INNER: tl.constexpr):
    """Inner tiles seen by outer rows ``[start, start+BLOCK_OUTER)`` where inner ``c`` is visible from
    outer ``r`` iff ``r - lo_dist <= c <= r + hi_dist`` and ``c < len_inner``.

    Returns ``lo <= full_lo <= full_hi <= hi`` (multiples of BLOCK_INNER except ``hi``): tiles in
    ``[full_lo, full_hi)`` need no mask."""
    lo = tl.maximum(start - lo_dist, 0) // BLOCK_INNER * BLOCK_INNER
    first_full = tl.maximum(start + BLOCK_OUTER - 1 - lo_dist, 0)
    full_lo = tl.maximum((first_full + BLOCK_INNER - 1) // BLOCK_INNER * BLOCK_INNER, lo)
    hi = tl.minimum(len_inner, start + BLOCK_OUTER + hi_dist)
    full_end = tl.minimum(len_inner, start + hi_dist + 1)
    full_lo = tl.minimum(full_lo, tl.maximum(hi, lo))
    full_hi = tl.maximum(full_end // BLOCK_INNER * BLOCK_INNER, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def program_seq_head(n_heads):
    """(sequence ``b``, head ``h``) of this program: axis 0 of the grid runs over ``B * n_heads``."""
    pid_bh = tl.program_id(0)
    return pid_bh // n_heads, pid_bh % n_heads


@triton.jit
def program_tile_start(BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """First row of this program's tile along axis 1 of the grid; ``REVERSE`` gives the last tile to the
    first program (under a causal band later query tiles see more keys: start them first)."""
    if REVERSE:
        t = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        t = tl.program_id(1)
    return t * BLOCK


@triton.jit
def persistent_item(tiles, w, n_heads, n_tiles, BLOCK: tl.constexpr):
    """(sequence, head, first row of the tile) of work item ``w`` of a persistent kernel: ``tiles`` lists
    ``b * n_tiles + tile`` in schedule order, each one ``n_heads`` items."""
    item = tl.load(tiles + w // n_heads)
    return item // n_tiles, w % n_heads, (item % n_tiles) * BLOCK


@triton.jit
def score_scale(qk_scale, ACT: tl.constexpr):
    """Scale of the scores: in base 2 for softmax (the kernels use ``exp2``), as given for GDPA."""
    if ACT == 0:
        s_scale = qk_scale * LOG2E
    else:
        s_scale = qk_scale
    return s_scale


@triton.jit
def bwd_scales(qk_scale, out_scale, ACT: tl.constexpr):
    """Scales of the scores (base 2 for softmax), of dQ and dK, and of dV."""
    if ACT == 0:
        s_scale = qk_scale * LOG2E
        g_scale = qk_scale
        v_scale = 1.0
    else:
        s_scale = qk_scale
        g_scale = qk_scale * out_scale
        v_scale = out_scale
    return s_scale, g_scale, v_scale


@triton.jit
def seq_bounds(offsets, b):
    """(first row int64, length int32) of sequence ``b`` of ``offsets`` ``[B+1]``."""
    start = tl.load(offsets + b).to(tl.int64)
    return start, (tl.load(offsets + b + 1) - start).to(tl.int32)


@triton.jit
def seq_pair_bounds(q_offsets, kv_offsets, b):
    """``(q_start, len_q, kv_start, len_kv)`` of sequence ``b``: :func:`seq_bounds` of both sides."""
    q_start, len_q = seq_bounds(q_offsets, b)
    kv_start, len_kv = seq_bounds(kv_offsets, b)
    return q_start, len_q, kv_start, len_kv


@triton.jit
def load_rows(X, start, offs, ok, h, stride_t, stride_h, offs_d, D: tl.constexpr):
    """Tile ``[len(offs), len(offs_d)]`` of head ``h``, rows ``start + offs`` of ``X``; 0 where ``ok`` is
    false or the column is ``>= D``."""
    rows = (start + offs[:, None]) * stride_t + h * stride_h
    return tl.load(X + rows + offs_d[None, :], mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def store_rows(X, x, start, offs, ok, h, stride_t, stride_h, offs_d, D: tl.constexpr):
    """Stores the tile ``x`` (rounded to X's dtype) where :func:`load_rows` would read it."""
    ptrs = X + (start + offs[:, None]) * stride_t + h * stride_h + offs_d[None, :]
    tl.store(ptrs, x.to(X.dtype.element_ty), mask=ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def visible_keys(offs_m, offs_n, len_kv, left, right):
    """Bool ``[BM, BN]``: key ``offs_n`` exists and lies in the band of query ``offs_m``."""
    return (
        (offs_n[None, :] < len_kv)
        & (offs_n[None, :] >= offs_m[:, None] - left)
        & (offs_n[None, :] <= offs_m[:, None] + right)
    )


@triton.jit
def visible_mask(offs_m, offs_n, len_q, len_kv, left, right):
    """Bool ``[BM, BN]``: query ``offs_m`` exists and sees key ``offs_n``."""
    return (offs_m[:, None] < len_q) & visible_keys(offs_m, offs_n, len_kv, left, right)


@triton.jit
def row_stats(
    Out,
    LSE,
    do,
    q_start,
    offs_m,
    row_ok,
    h,
    n_heads,
    stride_ot,
    stride_oh,
    offs_dv,
    DV: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Softmax: (lse in base 2, +inf for rows without keys; delta = rowsum(dO * O)). GDPA: zeros."""
    if ACT == 0:
        o = load_rows(Out, q_start, offs_m, row_ok, h, stride_ot, stride_oh, offs_dv, DV)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        lse = tl.load(LSE + (q_start + offs_m) * n_heads + h, mask=row_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    else:
        delta = tl.zeros([BLOCK_M], dtype=tl.float32)
        lse2 = delta
    return lse2, delta
