"""Vectorized PyTorch path for jagged softmax attention and GDPA, forward and backward (the CPU path).

Same semantics as the per-sequence loops in :mod:`gem_kernels.attention.reference` (which stay the oracle),
but without a Python loop over the batch: the sequences are grouped into buckets by the powers of two
just above their query and key lengths, each bucket is gathered into padded ``[G, H, Lq_max, D]`` /
``[G, H, Lk_max, D]`` tensors through index tensors, the masked scores are computed by batched matmuls
(mask = query valid & key valid & band), and the results are scattered back. Within a bucket every
sequence is at least half the padded length in each dimension, so the padded work stays within 4x of the
valid work (2x per dimension); a bucket whose score tensor would exceed :data:`SCORE_BUDGET` elements is
split. The number of Python-level iterations is the number of (bucket, chunk) groups: at most
``log2(max_q_len) * log2(max_kv_len)`` buckets, independent of the batch size ``B``.

Compute is fp32 (fp64 for fp64 inputs); outputs take the input dtypes, the LSE is fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gem_kernels.attention.activations import act_grad, act_value
from gem_kernels.attention.reference import SOFTMAX, _compute_dtype, _probs

# Largest G * H * Lq_max * Lk_max of one group's score tensor (2**26 fp32 elements = 256 MiB); several
# such temporaries live at once in the backward, so this bounds its peak memory to about 1 GiB.
SCORE_BUDGET = 2**26


@dataclass
class _Group:
    """One padded group of sequences, all index tensors on the data's device.

    ``q_idx`` ``[G, Lq]`` / ``k_idx`` ``[G, Lk]`` index rows of the flat tensors (padding points at the extra
    zero row appended at the end); ``q_valid`` / ``k_valid`` are the matching bool masks and ``mask``
    ``[G, 1, Lq, Lk]`` is the visibility of every (query, key) pair."""

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    q_valid: torch.Tensor
    k_valid: torch.Tensor
    mask: torch.Tensor


def _ceil_log2(n: torch.Tensor) -> torch.Tensor:
    """Smallest ``e`` with ``2**e >= n`` for int64 ``n >= 1`` (exact, no floating point)."""
    powers = torch.pow(2, torch.arange(63, dtype=torch.int64))
    return torch.searchsorted(powers, n)


def _buckets(lq: torch.Tensor, lk: torch.Tensor, heads: int) -> Iterator[torch.Tensor]:
    """Yield int64 CPU tensors of sequence ids, one per group (sequences with ``Lq == 0`` or ``Lk == 0``
    are left out: their outputs and gradients are 0). Iterates once per (bucket, chunk)."""
    active = torch.nonzero((lq > 0) & (lk > 0)).flatten()
    if active.numel() == 0:
        return
    key = _ceil_log2(lq[active]) * 64 + _ceil_log2(lk[active])
    _, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
    order = active[torch.argsort(inverse, stable=True)]
    members_per_bucket = torch.split(order, counts.tolist())
    for members in members_per_bucket:
        per_seq = heads * int(lq[members].max()) * int(lk[members].max())
        chunk = max(1, SCORE_BUDGET // per_seq)
        yield from torch.split(members, chunk)


def _group(
    members: torch.Tensor,
    q_start: torch.Tensor,
    k_start: torch.Tensor,
    lq: torch.Tensor,
    lk: torch.Tensor,
    pad_q: int,
    pad_k: int,
    left: int,
    right: int,
    device: torch.device,
) -> _Group:
    """Index tensors and masks of the sequences ``members`` (int64 CPU ``[G]``)."""
    lqg, lkg = lq[members], lk[members]
    iq = torch.arange(int(lqg.max()))
    ik = torch.arange(int(lkg.max()))
    q_valid = iq[None, :] < lqg[:, None]  # [G, Lq]
    k_valid = ik[None, :] < lkg[:, None]  # [G, Lk]
    q_idx = torch.where(q_valid, q_start[members][:, None] + iq[None, :], pad_q)
    k_idx = torch.where(k_valid, k_start[members][:, None] + ik[None, :], pad_k)
    band = torch.ones(iq.numel(), ik.numel(), dtype=torch.bool)
    if left >= 0:
        band &= ik[None, :] >= iq[:, None] - left
    if right >= 0:
        band &= ik[None, :] <= iq[:, None] + right
    mask = q_valid[:, :, None] & k_valid[:, None, :] & band  # [G, Lq, Lk]
    return _Group(
        q_idx.to(device),
        k_idx.to(device),
        q_valid.to(device),
        k_valid.to(device),
        mask[:, None].to(device),
    )


def _padded(flat: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """``flat`` ``[N, H, D]`` in ``cdt`` with one zero row appended (the target of padding indices)."""
    out = torch.zeros(flat.shape[0] + 1, *flat.shape[1:], dtype=cdt, device=flat.device)
    out[:-1] = flat
    return out


def _gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``flat`` ``[N+1, H, D]`` and ``idx`` ``[G, L]`` -> ``[G, H, L, D]``."""
    return flat[idx].transpose(1, 2)


def _scatter(dst: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[idx[g, l]] = src[g, :, l]`` for the valid ``(g, l)``; ``src`` is ``[G, H, L, ...]``. Segments
    never overlap, so each destination row is written once."""
    dst[idx[valid]] = src.transpose(1, 2)[valid]


def _segments(q_offsets: torch.Tensor, kv_offsets: torch.Tensor):
    qo = q_offsets.detach().to("cpu", torch.int64)
    ko = kv_offsets.detach().to("cpu", torch.int64)
    return qo[:-1], ko[:-1], qo[1:] - qo[:-1], ko[1:] - ko[:-1]


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    activation: str,
    left: int,
    right: int,
    qk_scale: float,
    out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorized forward; the contract of :func:`gem_kernels.attention.reference.attention_fwd`.

    Args:
        q: ``[total_q, H, D]``; k: ``[total_kv, H, D]``; v: ``[total_kv, H, Dv]``; one floating dtype.
        q_offsets, kv_offsets: ``[B+1]`` int32/int64 (any device).
        activation: ``"softmax"`` or a GDPA activation name.
        left, right: the visible band (``-1`` = unbounded).
        qk_scale: multiplies ``q.k`` before the softmax/activation.
        out_scale: multiplies the GDPA output (ignored for softmax).

    Returns:
        ``out`` ``[total_q, H, Dv]`` in q's dtype, and for softmax the log-sum-exp ``[total_q, H]`` fp32
        (``-inf`` for rows with no visible key); for GDPA an empty fp32 tensor.
    """
    cdt = _compute_dtype(q)
    softmax = activation == SOFTMAX
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=cdt, device=q.device)
    lse_shape = (q.shape[0], q.shape[1]) if softmax else (0,)
    lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    q_start, k_start, lq, lk = _segments(q_offsets, kv_offsets)
    qp, kp, vp = None, None, None
    for members in _buckets(lq, lk, q.shape[1]):
        if qp is None:  # converted once, only when some sequence attends
            qp, kp, vp = _padded(q, cdt), _padded(k, cdt), _padded(v, cdt)
        grp = _group(members, q_start, k_start, lq, lk, q.shape[0], k.shape[0], left, right, q.device)
        qb, kb, vb = _gather(qp, grp.q_idx), _gather(kp, grp.k_idx), _gather(vp, grp.k_idx)
        s = qk_scale * (qb @ kb.transpose(-1, -2))  # [G, H, Lq, Lk]
        if softmax:
            p, lse_b = _probs(s, grp.mask)
            _scatter(lse, grp.q_idx, grp.q_valid, lse_b.float())
            ob = p @ vb
        else:
            a = torch.where(grp.mask, act_value(activation, s), torch.zeros_like(s))
            ob = out_scale * (a @ vb)
        _scatter(out, grp.q_idx, grp.q_valid, ob)
    return out.to(q.dtype), lse


def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    activation: str,
    left: int,
    right: int,
    qk_scale: float,
    out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vectorized backward: ``(dq, dk, dv)`` in the dtypes of ``(q, k, v)``, recomputing the scores.

    ``dout`` is ``[total_q, H, Dv]``; the other arguments are those of :func:`attention_fwd`. Softmax:
    ``ds = p * (dp - rowsum(p * dp))``; GDPA: ``ds = mask * out_scale * dp * act'(s)``.
    """
    cdt = _compute_dtype(q)
    softmax = activation == SOFTMAX
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    q_start, k_start, lq, lk = _segments(q_offsets, kv_offsets)
    qp, kp, vp, dop = None, None, None, None
    for members in _buckets(lq, lk, q.shape[1]):
        if qp is None:
            qp, kp, vp, dop = _padded(q, cdt), _padded(k, cdt), _padded(v, cdt), _padded(dout, cdt)
        grp = _group(members, q_start, k_start, lq, lk, q.shape[0], k.shape[0], left, right, q.device)
        qb, kb, vb = _gather(qp, grp.q_idx), _gather(kp, grp.k_idx), _gather(vp, grp.k_idx)
        dob = _gather(dop, grp.q_idx)  # [G, H, Lq, Dv]
        s = qk_scale * (qb @ kb.transpose(-1, -2))
        dp = dob @ vb.transpose(-1, -2)  # [G, H, Lq, Lk]
        if softmax:
            p, _ = _probs(s, grp.mask)
            dvb = p.transpose(-1, -2) @ dob
            ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        else:
            zero = torch.zeros_like(s)
            a = torch.where(grp.mask, act_value(activation, s), zero)
            dvb = out_scale * (a.transpose(-1, -2) @ dob)
            ds = torch.where(grp.mask, out_scale * dp * act_grad(activation, s), zero)
        _scatter(dq, grp.q_idx, grp.q_valid, qk_scale * (ds @ kb))
        _scatter(dk, grp.k_idx, grp.k_valid, qk_scale * (ds.transpose(-1, -2) @ qb))
        _scatter(dv, grp.k_idx, grp.k_valid, dvb)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
