"""Vectorized PyTorch path for jagged softmax attention and GDPA, forward and backward (the CPU path).

Same semantics as the per-sequence loops in :mod:`gem_kernels.attention.reference` (which stay the
oracle), but without a Python loop over the batch. Each call takes one of three ways, the backward as its
forward: a call with a short side (PMA's seeds, a history's few context keys) runs CSR products over the
visible pairs (:mod:`gem_kernels.attention.cpu_sparse`); otherwise the sequences are grouped by their query
and key lengths into padded groups (:mod:`gem_kernels.attention.cpu_groups`, whose padded work stays within
2x of the valid work and whose Python-level iterations do not grow with the batch size), and each group runs
PyTorch's fused CPU flash-attention kernel (softmax with ``D == Dv``; its backward in fp32 from the forward's
``out`` and LSE) or masked batched matmuls on head-major ``[H, G, L, D]`` gathers, scattered back with
``index_copy_``.

Compute is fp32 (fp64 for fp64 inputs); outputs take the input dtypes, the LSE is fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import torch

from gem_kernels.attention import cpu_sparse
from gem_kernels.attention.activations import act_grad, act_value
from gem_kernels.attention.cpu_groups import (
    Group,
    flat,
    gather,
    gather_rows,
    groups,
    head_major,
    scatter,
    segments,
)
from gem_kernels.attention.reference import SOFTMAX, compute_dtype

P = ParamSpec("P")
R = TypeVar("R")


def _without_autocast(
    fn: Callable[Concatenate[torch.Tensor, P], R],
) -> Callable[Concatenate[torch.Tensor, P], R]:
    """Run ``fn`` with autocast off on its first argument's device: this path computes in fp32 (fp64) by
    contract, and an enclosing ``torch.autocast`` would otherwise turn its matmuls into bf16 ones."""

    @functools.wraps(fn)
    def wrapper(first: torch.Tensor, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with torch.autocast(first.device.type, enabled=False):
            return fn(first, *args, **kwargs)

    return wrapper


def _probs_(s: torch.Tensor, masked_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``s`` ``[H, G, Lq, Lk]`` scores -> masked softmax probabilities over the last dim (rows
    with no visible key give 0), plus the log-sum-exp ``[H, G, Lq]`` (``-inf`` for those rows). The
    arithmetic of :func:`gem_kernels.attention.reference._probs`, without temporaries of the scores'
    size."""
    s.masked_fill_(masked_out, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s.sub_(m).exp_()
    denom = s.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(denom)).squeeze(-1)
    s.div_(torch.where(denom == 0, torch.ones_like(denom), denom))
    return s, lse


# PyTorch's fused CPU flash-attention kernel (what ``F.scaled_dot_product_attention`` runs on the CPU), called
# directly because it also returns the log-sum-exp, which the public function does not. It keeps the scores in
# tiles instead of materialising ``[H, G, Lq, Lk]``: ~1.4-1.7x the batched-matmul softmax at the tiny model's
# shapes (B=1024, H=2, D=16, lengths ~lognormal up to 64, 1 thread). Absent from a build -> the matmul path.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Its backward (what autograd runs after the public function): given the forward's output and log-sum-exp it
# recomputes the scores in tiles as well. ~2x the batched-matmul backward at the tiny model's self-attention.
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _flash_applies(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused kernel can take this call: present, on the CPU, and ``D == Dv`` (its contract)."""
    return _FLASH_CPU is not None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _flash_mask(grp: Group, dtype: torch.dtype, device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """The fused kernel's masking of one group: ``(is_causal, attn_mask)``, the mask additive (``0`` /
    ``-inf``, the kernel's contract) ``[G or 1, 1, Lq, Lk]`` in ``dtype`` and as small as the group allows:
    none when the band is causal and every sequence has ``Lq == Lk`` (``is_causal`` then); the band ``[Lq,
    Lk]`` alone when no valid query's band reaches past its sequence's keys (self-attention with ``right =
    0``); else band and key padding."""
    if grp.left < 0 and grp.right == 0 and grp.lq == grp.lk and torch.equal(grp.q_len, grp.k_len):
        return True, None
    excess = int((grp.q_len - grp.k_len).max())  # the most queries a sequence has beyond its keys
    visible = grp.band()  # [Lq, Lk] or None
    reach_past = grp.right < 0 or excess + grp.right > 0
    if reach_past and not bool((grp.k_len == grp.lk).all()):
        k_valid = (torch.arange(grp.lk)[None, :] < grp.k_len[:, None])[:, None, :]  # [G, 1, Lk]
        visible = k_valid if visible is None else visible[None] & k_valid
    if visible is None:  # every key visible to every query
        return False, None
    while visible.dim() < 3:
        visible = visible[None]
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return False, mask[:, None].to(device)


def _flash_softmax(
    qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, grp: Group, qk_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one group with the fused kernel: ``qb`` ``[G, H, Lq, D]``, ``kb`` / ``vb``
    ``[G, H, Lk, D]`` (one float dtype, any strides) -> ``out`` ``[G, H, Lq, D]`` (the kernel lays it out
    as ``[G, Lq, H, D]`` in memory) and ``lse`` ``[G, H, Lq]`` fp32 (memory ``[G, Lq, H]``).

    Masking: :func:`_flash_mask`. Padded query rows produce values that are scattered to the discarded row. A
    valid query with no visible key (possible only when ``Lq - Lk > left >= 0``) gets ``out = 0`` from the
    kernel, as here, but ``lse = 0``: it is set to ``-inf``."""
    assert _FLASH_CPU is not None
    is_causal, mask = _flash_mask(grp, qb.dtype, qb.device)
    out, lse = _FLASH_CPU(qb, kb, vb, is_causal=is_causal, attn_mask=mask, scale=qk_scale)
    lse = lse.float()
    if mask is not None and grp.left >= 0 and int((grp.q_len - grp.k_len).max()) > grp.left:
        no_key = torch.isneginf(mask).all(dim=-1)[:, 0]  # [G or 1, Lq]; padded query rows too (discarded)
        lse = lse.masked_fill(no_key[:, None], float("-inf"))
    return out, lse


def _kernel_rows(
    flat: torch.Tensor, src: torch.Tensor, pad: torch.Tensor, cdt: torch.dtype, size: int
) -> torch.Tensor:
    """A group's rows of ``flat`` ``[N, H, X]`` (:func:`gather_rows`, ``[size * L, H, X]``) as the fused
    kernel takes them: the ``[size, H, L, X]`` view of ``[size, L, H, X]`` memory."""
    rows = gather_rows(flat, src, pad, cdt)
    return rows.view(size, -1, *rows.shape[1:]).transpose(1, 2)


def _flash_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    left: int,
    right: int,
    qk_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax forward through the fused kernel, in the tokens' own layout: each group's rows are gathered
    from q, k and v as ``[G, Lq, H, D]`` (padding rows zero) and handed over as ``[G, H, Lq, D]`` views, and
    the kernel's ``[G, Lq, H, D]`` output is scattered back as it lies: no transposition on the way in or
    out, and no padded copy of q, k and v (3 passes over them a call)."""
    cdt = compute_dtype(q)
    heads, dv = q.shape[1], v.shape[2]
    out = torch.zeros(q.shape[0] + 1, heads, dv, dtype=cdt, device=q.device)
    lse = torch.full((q.shape[0] + 1, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for grp in groups(q_offsets, kv_offsets, heads, q.shape[0], k.shape[0], left, right, q.device):
        qb = _kernel_rows(q, grp.q_src, grp.q_pad, cdt, grp.size)
        kb, vb = (_kernel_rows(t, grp.k_src, grp.k_pad, cdt, grp.size) for t in (k, v))
        ob, lse_b = _flash_softmax(qb, kb, vb, grp, qk_scale)
        out.index_copy_(0, grp.q_idx, ob.transpose(1, 2).reshape(-1, heads, dv))
        lse.index_copy_(0, grp.q_idx, lse_b.transpose(1, 2).reshape(-1, heads))
    return out[:-1].to(q.dtype), lse[:-1]


def _flash_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    left: int,
    right: int,
    qk_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax backward through the fused kernel's backward, group by group as :func:`_flash_fwd` (the same
    groups and masks), from the forward's ``out`` ``[total_q, H, Dv]`` and fp32 ``lse`` ``[total_q, H]``.
    Rows are gathered in the tokens' layout and the gradients scattered back as they lie.

    A valid query with no visible key has ``lse = -inf`` here and ``0`` in the kernel's contract (its scores
    are all ``-inf``, so ``p = 0`` and its gradients vanish either way): it is handed over as ``0``. Padded
    query rows gather zero ``dout`` and ``out``, so they add nothing to ``dk`` and ``dv``."""
    assert _FLASH_CPU_BWD is not None
    cdt = compute_dtype(q)
    heads, d, dv_dim = q.shape[1], q.shape[2], v.shape[2]
    # Rows of sequences in no group (no query or no key) stay 0; the last row takes the padding.
    dq = torch.zeros(q.shape[0] + 1, heads, d, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape[0] + 1, heads, d, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape[0] + 1, heads, dv_dim, dtype=cdt, device=q.device)
    lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    for grp in groups(q_offsets, kv_offsets, heads, q.shape[0], k.shape[0], left, right, q.device):
        qb, dob, ob = (_kernel_rows(t, grp.q_src, grp.q_pad, cdt, grp.size) for t in (q, dout, out))
        kb, vb = (_kernel_rows(t, grp.k_src, grp.k_pad, cdt, grp.size) for t in (k, v))
        lse_b = _kernel_rows(lse[:, :, None], grp.q_src, grp.q_pad, torch.float32, grp.size).squeeze(-1)
        is_causal, mask = _flash_mask(grp, cdt, q.device)
        gq, gk, gv = _FLASH_CPU_BWD(
            dob, qb, kb, vb, ob, lse_b, 0.0, is_causal, attn_mask=mask, scale=qk_scale
        )
        dq.index_copy_(0, grp.q_idx, gq.transpose(1, 2).reshape(-1, heads, d))
        dk.index_copy_(0, grp.k_idx, gk.transpose(1, 2).reshape(-1, heads, d))
        dv.index_copy_(0, grp.k_idx, gv.transpose(1, 2).reshape(-1, heads, dv_dim))
    return dq[:-1].to(q.dtype), dk[:-1].to(k.dtype), dv[:-1].to(v.dtype)


def _short_side(q: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor) -> bool:
    """Whether a call on the CPU takes the CSR path (:func:`gem_kernels.attention.cpu_sparse.applies` of its
    longest query and key runs): the forward and the backward decide alike."""
    _, _, lq, lk = segments(q_offsets, kv_offsets)
    return q.device.type == "cpu" and lq.numel() > 0 and cpu_sparse.applies(int(lq.max()), int(lk.max()))


@_without_autocast
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
    cdt = compute_dtype(q)
    softmax = activation == SOFTMAX
    if _short_side(q, q_offsets, kv_offsets):
        return cpu_sparse.attention_fwd(
            q, k, v, q_offsets, kv_offsets, activation, left, right, qk_scale, out_scale, cdt
        )
    if softmax and _flash_applies(q, v):
        return _flash_fwd(q, k, v, q_offsets, kv_offsets, left, right, qk_scale)
    heads = q.shape[1]
    out = torch.zeros(heads, q.shape[0] + 1, v.shape[2], dtype=cdt, device=q.device)
    lse = torch.full((heads, q.shape[0] + 1), float("-inf"), dtype=torch.float32, device=q.device)
    major: list[torch.Tensor] = []  # q, k, v head-major: converted once, only when some sequence attends
    for grp in groups(q_offsets, kv_offsets, heads, q.shape[0], k.shape[0], left, right, q.device):
        if not major:
            major = [head_major(t, cdt) for t in (q, k, v)]
        qp, kp, vp = major
        qb = gather(qp, grp.q_idx, grp.size)  # [H, G, Lq, D]
        kb, vb = gather(kp, grp.k_idx, grp.size), gather(vp, grp.k_idx, grp.size)  # [H, G, Lk, D/Dv]
        if softmax:
            s = (qb @ kb.transpose(-1, -2)).mul_(qk_scale)  # [H, G, Lq, Lk]
            p, lse_b = _probs_(s, grp.masked_out(q.device))
            scatter(lse, grp.q_idx, lse_b.float())
            ob = p @ vb
        else:
            s = (qb @ kb.transpose(-1, -2)).mul_(qk_scale)
            a = act_value(activation, s)
            if grp.has_band:  # padding needs no mask here: see Group.has_band
                a.masked_fill_(grp.masked_out(q.device), 0.0)
            ob = (a @ vb).mul_(out_scale)
        scatter(out, grp.q_idx, ob)
    lse = flat(lse, torch.float32) if softmax else lse.new_empty(0)
    return flat(out, q.dtype), lse


@_without_autocast
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
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vectorized backward: ``(dq, dk, dv)`` in the dtypes of ``(q, k, v)``, recomputing the scores.

    ``dout`` is ``[total_q, H, Dv]``; the other arguments are those of :func:`attention_fwd`, and ``out`` /
    ``lse`` its results where the caller kept them. Softmax: ``ds = p * (dp - rowsum(p * dp))``; GDPA:
    ``ds = mask * out_scale * dp * act'(s)``. Three ways, as the forward's: calls with a short side take the
    CSR backward (:func:`gem_kernels.attention.cpu_sparse.attention_bwd`); fp32 softmax calls given ``out``
    and ``lse`` the fused kernel's backward (:func:`_flash_bwd`; not fp64, whose forward LSE was rounded to
    fp32); the rest the padded batched matmuls.
    """
    cdt = compute_dtype(q)
    softmax = activation == SOFTMAX
    if _short_side(q, q_offsets, kv_offsets):
        return cpu_sparse.attention_bwd(
            dout, q, k, v, q_offsets, kv_offsets, activation, left, right, qk_scale, out_scale, cdt
        )
    if (
        softmax
        and out is not None
        and lse is not None
        and cdt == torch.float32
        and _FLASH_CPU_BWD is not None
        and _flash_applies(q, v)
    ):
        return _flash_bwd(dout, q, k, v, out, lse, q_offsets, kv_offsets, left, right, qk_scale)
    heads = q.shape[1]
    dq = torch.zeros(heads, q.shape[0] + 1, q.shape[2], dtype=cdt, device=q.device)
    dk = torch.zeros(heads, k.shape[0] + 1, k.shape[2], dtype=cdt, device=q.device)
    dv = torch.zeros(heads, v.shape[0] + 1, v.shape[2], dtype=cdt, device=q.device)
    major: list[torch.Tensor] = []  # q, k, v, dout head-major, converted once as in attention_fwd
    for grp in groups(q_offsets, kv_offsets, heads, q.shape[0], k.shape[0], left, right, q.device):
        if not major:
            major = [head_major(t, cdt) for t in (q, k, v, dout)]
        qp, kp, vp, dop = major
        qb, dob = gather(qp, grp.q_idx, grp.size), gather(dop, grp.q_idx, grp.size)  # [H, G, Lq, D/Dv]
        kb, vb = gather(kp, grp.k_idx, grp.size), gather(vp, grp.k_idx, grp.size)  # [H, G, Lk, D/Dv]
        s = (qb @ kb.transpose(-1, -2)).mul_(qk_scale)  # [H, G, Lq, Lk]
        dp = dob @ vb.transpose(-1, -2)  # [H, G, Lq, Lk]
        if softmax:
            p, _ = _probs_(s, grp.masked_out(q.device))
            dvb = p.transpose(-1, -2) @ dob
            ds = dp.sub_((p * dp).sum(dim=-1, keepdim=True)).mul_(p)
        else:
            a = act_value(activation, s)
            ds = dp.mul_(out_scale).mul_(act_grad(activation, s))
            if grp.has_band:
                masked_out = grp.masked_out(q.device)
                a.masked_fill_(masked_out, 0.0)
                ds.masked_fill_(masked_out, 0.0)
            dvb = (a.transpose(-1, -2) @ dob).mul_(out_scale)
        scatter(dq, grp.q_idx, (ds @ kb).mul_(qk_scale))
        scatter(dk, grp.k_idx, (ds.transpose(-1, -2) @ qb).mul_(qk_scale))
        scatter(dv, grp.k_idx, dvb)
    return flat(dq, q.dtype), flat(dk, k.dtype), flat(dv, v.dtype)
