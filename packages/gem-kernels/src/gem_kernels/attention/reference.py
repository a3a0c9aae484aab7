"""Per-sequence PyTorch references for jagged softmax attention and GDPA, forward and backward.

They loop over the batch and build each sequence's dense ``[H, Lq, Lkv]`` score matrix, in fp32 (fp64 for
fp64 inputs). They are the CPU path of :func:`gem_kernels.jagged_flash_attention` and
:func:`gem_kernels.gdpa` and the oracle of every kernel test. The backward is written out by hand (not
via autograd) so that it can run inside a custom op and so that ``gradcheck`` checks it.

Conventions shared with the Triton kernels:

- ``activation`` is ``"softmax"`` or a GDPA activation from :mod:`gem_kernels.attention.activations`.
- ``left``/``right`` bound the band of visible keys, in tokens: key ``j`` is visible from query ``i`` iff
  ``i - left <= j <= i + right``; ``-1`` means unbounded. Causal attention is ``right=0``.
- A query row with no visible key outputs 0 and gets zero gradients; its log-sum-exp is ``-inf``.
"""

from __future__ import annotations

import torch

from gem_kernels.attention.activations import act_grad, act_value

SOFTMAX = "softmax"


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def band_mask(lq: int, lk: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """Bool ``[lq, lk]``: True where key ``j`` is visible from query ``i``."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def _probs(s: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax over the last dim of ``s`` ``[H, Lq, Lk]``; rows with no visible key give 0.

    Returns the probabilities and the log-sum-exp ``[H, Lq]`` (``-inf`` for empty rows)."""
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(denom)).squeeze(-1)
    p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    return p, lse


def _segments(q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> list[tuple[int, int, int, int]]:
    qo = q_offsets.detach().to("cpu", torch.int64).tolist()
    ko = kv_offsets.detach().to("cpu", torch.int64).tolist()
    return [(qo[b], qo[b + 1], ko[b], ko[b + 1]) for b in range(len(qo) - 1)]


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
    """Reference forward.

    Args:
        q: ``[total_q, H, D]``; k: ``[total_kv, H, D]``; v: ``[total_kv, H, Dv]``; one floating dtype.
        q_offsets, kv_offsets: ``[B+1]`` int32/int64.
        activation: ``"softmax"`` or a GDPA activation name.
        left, right: the visible band (``-1`` = unbounded).
        qk_scale: multiplies ``q.k`` before the softmax/activation.
        out_scale: multiplies the GDPA output (ignored for softmax).

    Returns:
        ``out`` ``[total_q, H, Dv]`` in q's dtype, and for softmax the log-sum-exp ``[total_q, H]`` fp32
        (of the scaled scores, natural log); for GDPA an empty fp32 tensor.
    """
    cdt = compute_dtype(q)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=cdt, device=q.device)
    softmax = activation == SOFTMAX
    lse = torch.full((q.shape[0], q.shape[1]) if softmax else (0,), float("-inf"), device=q.device)
    for qs, qe, ks, ke in _segments(q_offsets, kv_offsets):
        if qe == qs or ke == ks:
            continue
        qb = q[qs:qe].to(cdt).transpose(0, 1)  # [H, Lq, D]
        kb = k[ks:ke].to(cdt).transpose(0, 1)  # [H, Lk, D]
        vb = v[ks:ke].to(cdt).transpose(0, 1)  # [H, Lk, Dv]
        s = qk_scale * (qb @ kb.transpose(1, 2))
        mask = band_mask(qe - qs, ke - ks, left, right, q.device)
        if softmax:
            p, lse_b = _probs(s, mask)
            lse[qs:qe] = lse_b.transpose(0, 1).float()
            ob = p @ vb
        else:
            a = torch.where(mask, act_value(activation, s), torch.zeros_like(s))
            ob = out_scale * (a @ vb)
        out[qs:qe] = ob.transpose(0, 1)
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
    """Reference backward: ``(dq, dk, dv)`` in the dtypes of ``(q, k, v)``, recomputing the scores.

    ``dout`` is ``[total_q, H, Dv]``; the other arguments are those of :func:`attention_fwd`.
    """
    cdt = compute_dtype(q)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    softmax = activation == SOFTMAX
    for qs, qe, ks, ke in _segments(q_offsets, kv_offsets):
        if qe == qs or ke == ks:
            continue
        qb = q[qs:qe].to(cdt).transpose(0, 1)
        kb = k[ks:ke].to(cdt).transpose(0, 1)
        vb = v[ks:ke].to(cdt).transpose(0, 1)
        dob = dout[qs:qe].to(cdt).transpose(0, 1)  # [H, Lq, Dv]
        s = qk_scale * (qb @ kb.transpose(1, 2))
        mask = band_mask(qe - qs, ke - ks, left, right, q.device)
        dp = dob @ vb.transpose(1, 2)  # [H, Lq, Lk]
        if softmax:
            p, _ = _probs(s, mask)
            dvb = p.transpose(1, 2) @ dob
            ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        else:
            zero = torch.zeros_like(s)
            a = torch.where(mask, act_value(activation, s), zero)
            dvb = out_scale * (a.transpose(1, 2) @ dob)
            ds = torch.where(mask, out_scale * dp * act_grad(activation, s), zero)
        dq[qs:qe] = (qk_scale * (ds @ kb)).transpose(0, 1)
        dk[ks:ke] = (qk_scale * (ds.transpose(1, 2) @ qb)).transpose(0, 1)
        dv[ks:ke] = dvb.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def count_valid_pairs(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, left: int, right: int) -> int:
    """Number of (query, key) pairs that attend, summed over the batch (heads not counted).

    Used by the FLOP formulas and the benchmarks ("useful" FLOPs count only these pairs)."""
    qo = q_offsets.detach().to("cpu", torch.int64)
    ko = kv_offsets.detach().to("cpu", torch.int64)
    lq = qo[1:] - qo[:-1]
    lk = ko[1:] - ko[:-1]
    if lq.numel() == 0 or int(qo[-1]) == 0:
        return 0
    seq = torch.repeat_interleave(torch.arange(lq.numel()), lq)
    pos = torch.arange(int(qo[-1])) - qo[:-1][seq]
    lk_tok = lk[seq]
    hi = lk_tok - 1 if right < 0 else torch.minimum(lk_tok - 1, pos + right)
    lo = torch.zeros_like(pos) if left < 0 else torch.clamp(pos - left, min=0)
    return int(torch.clamp(hi - lo + 1, min=0).sum())
