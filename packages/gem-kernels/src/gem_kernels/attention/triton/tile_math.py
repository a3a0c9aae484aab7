"""The per-tile mathematics of the jagged attention kernels, shared by the tiled kernels
(:mod:`.fwd`, :mod:`.bwd`) and the persistent ones (:mod:`.persistent`).

Each kernel family loads its tiles its own way (pointers or TMA descriptors, one layout or its transpose)
and computes the tile's scores; what it does with them is here, once: the forward's online-softmax (or
GDPA activation) step and its final normalization, the dS of a key tile for dQ, and the (P^T, dS^T) of a
query tile for dK/dV. Triton inlines these functions, so the kernels' generated code is what it was when
they were written out in each kernel (``benchmarks/compile_sm90.py --ptx-dir`` compares the PTX).

Conventions as in :mod:`.common`: scores in base 2 for softmax, ``lse`` natural-log and ``-inf``
for a row without a visible key; ``MASK`` (the masked phases of a loop) zeroes keys past the sequence's end
or outside the band.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gem_kernels.attention.triton.common import LN2, LOG2E, act_and_grad, gdpa_act, visible_keys


@triton.jit
def fwd_tile(
    acc,
    m_i,
    l_i,
    s,
    v,
    offs_m,
    offs_n,
    len_kv,
    left,
    right,
    ACT: tl.constexpr,
    MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST_ACT: tl.constexpr,
):
    """Fold one key tile into the forward's accumulators.

    ``s`` ``[BM, BN]`` fp32: the tile's scaled scores; ``v`` ``[BN, BDV]``: its values; ``acc`` ``[BM, BDV]``
    fp32. Softmax: the online update of the running row max ``m_i`` and sum ``l_i`` (``[BM]`` fp32) and the
    rescaling of ``acc``; GDPA: ``act(s)`` (``m_i``, ``l_i`` pass through). Returns ``(acc, m_i, l_i)``.
    """
    if MASK:
        visible = visible_keys(offs_m, offs_n, len_kv, left, right)
    if ACT == 0:
        if MASK:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key in a masked tile (and none before it): keep exp2 away from inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    else:
        p = gdpa_act(s, ACT, FAST_ACT)
        if MASK:
            p = tl.where(visible, p, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def fwd_finish(acc, m_i, l_i, LSE, q_start, offs_m, row_ok, h, n_heads, out_scale, ACT: tl.constexpr):
    """The output tile ``[BM, BDV]`` fp32 from the accumulators: softmax divides by the row sums and stores
    the rows' log-sum-exp in ``LSE`` ``[total_q, H]``; GDPA multiplies by ``out_scale``."""
    if ACT == 0:
        empty = l_i == 0.0
        acc = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        tl.store(LSE + (q_start + offs_m) * n_heads + h, lse, mask=row_ok)
    else:
        acc = acc * out_scale
    return acc


@triton.jit
def dq_tile_ds(
    s,
    dp,
    lse2,
    delta,
    offs_m,
    offs_n,
    len_kv,
    left,
    right,
    ACT: tl.constexpr,
    MASK: tl.constexpr,
    FAST_ACT: tl.constexpr,
):
    """dS ``[BM, BN]`` fp32 of one key tile, for dQ: softmax ``P (dP - delta)`` with ``P = exp2(S - lse2)``
    (``lse2`` ``[BM]``: base 2, ``+inf`` for a row without keys); GDPA ``dP act'(S)``."""
    if ACT == 0:
        p = tl.math.exp2(s - lse2[:, None])
        ds = p * (dp - delta[:, None])
    else:
        _, da = act_and_grad(s, ACT, FAST_ACT)
        ds = dp * da
    if MASK:
        ds = tl.where(visible_keys(offs_m, offs_n, len_kv, left, right), ds, 0.0)
    return ds


@triton.jit
def dkdv_tile_grads(
    st,
    dpt,
    LSE,
    DELTA,
    q_start,
    offs_m,
    offs_n,
    len_q,
    h,
    n_heads,
    left,
    right,
    ACT: tl.constexpr,
    MASK: tl.constexpr,
    FAST_ACT: tl.constexpr,
):
    """``(P^T, dS^T)`` ``[BN, BM]`` fp32 of one query tile, for dK and dV, from the transposed scores ``st``
    and ``dpt = V dO^T``; softmax reads the query rows' ``LSE`` and ``DELTA`` ``[total_q, H]``."""
    if ACT == 0:
        row_ok = offs_m < len_q
        lse = tl.load(LSE + (q_start + offs_m) * n_heads + h, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + (q_start + offs_m) * n_heads + h, mask=row_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        pt = tl.math.exp2(st - lse2[None, :])
        dst = pt * (dpt - delta[None, :])
    else:
        pt, da = act_and_grad(st, ACT, FAST_ACT)
        dst = dpt * da
    if MASK:
        visible = (
            (offs_m[None, :] < len_q)
            & (offs_n[:, None] >= offs_m[None, :] - left)
            & (offs_n[:, None] <= offs_m[None, :] + right)
        )
        pt = tl.where(visible, pt, 0.0)
        dst = tl.where(visible, dst, 0.0)
    return pt, dst
