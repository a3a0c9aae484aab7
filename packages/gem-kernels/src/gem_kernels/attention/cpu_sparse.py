"""Jagged attention forward on the CPU as sparse matrix products over the visible (query, key) pairs.

Where one side of every sequence is short (PMA's few queries over a history, a history's cross-attention to a
few context keys), the padded groups of :mod:`gem_kernels.attention.cpu` spend their time gathering, padding
and scattering rows, not on arithmetic. Here the visible pairs of all sequences form one CSR pattern
``[total_q, total_kv]`` (row ``n``: the keys query ``n`` sees), and per head

- the scores are ``torch.sparse.sampled_addmm`` (``q_h k_h^T`` at the pattern only),
- softmax: row max and row sum by ``torch.segment_reduce`` over each row's run of values (the CSR values of a
  row are contiguous), ``exp`` in place; GDPA: the activation of the values,
- the output is the CSR matrix times ``v_h``.

No padding, no gather of q, k or v and no scatter: the work is proportional to the visible pairs. ~2-3x
the padded path at the tiny model's PMA and context cross-attention (B=1024, H=2, D=16, 1 thread;
gem-kernels BENCHMARKS.md). Same contract as :func:`gem_kernels.attention.cpu.attention_fwd`; compute in
fp32 (fp64 for fp64 inputs), the LSE fp32.
"""

from __future__ import annotations

import warnings

import torch

from gem_kernels.attention.activations import act_grad, act_value
from gem_kernels.memo import ValueMemo

# The CSR path runs when the shorter side of the call (the longest query or the longest key run, whichever is
# smaller) is at most this: PMA (2 queries) and context cross-attention (6 keys) at the tiny model's shapes.
# Self-attention over histories (both sides ~64) stays on the padded fused kernel, which was as fast or faster
# there (13.1 ms padded vs 11.6 + 4.0 ms for the pattern, full causal, B=1024).
SHORT_SIDE = 8


def applies(max_q_len: int, max_kv_len: int) -> bool:
    """Whether a call of these longest lengths takes the CSR path."""
    return 0 < min(max_q_len, max_kv_len) <= SHORT_SIDE


Pattern = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# A GEM forward makes three PMA calls over one pair of offsets and two context cross-attention calls over
# another: the pattern is built once for each (about 0.8 ms for the cross-attention at tiny's shapes).
_PATTERNS: ValueMemo[Pattern] = ValueMemo(4)


def pattern(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, left: int, right: int) -> Pattern:
    """The visible pairs as CSR: ``crow`` ``[total_q + 1]``, ``col`` ``[nnz]``, each row's count
    ``[total_q]`` and each pair's row ``[nnz]`` (int64 CPU; memoised by value).

    Query ``i`` of a sequence sees its keys ``j`` with ``j >= i - left`` (``left >= 0``) and
    ``j <= i + right`` (``right >= 0``), positions counted from each sequence's start (the oracle's band),
    and ``j < Lk``."""
    qo = q_offsets.detach().to("cpu", torch.int64)
    ko = kv_offsets.detach().to("cpu", torch.int64)
    return _PATTERNS.get((qo, ko, left, right), lambda: _build_pattern(qo, ko, left, right))


def _build_pattern(qo: torch.Tensor, ko: torch.Tensor, left: int, right: int) -> Pattern:
    lq, lk = qo[1:] - qo[:-1], ko[1:] - ko[:-1]
    total_q = int(qo[-1] - qo[0])
    seq = torch.repeat_interleave(torch.arange(lq.numel()), lq, output_size=total_q)  # each query's sequence
    pos = torch.arange(total_q) - (qo[:-1] - qo[0])[seq]  # its position in the sequence
    n_keys = lk[seq]
    lo = (pos - left).clamp_(min=0) if left >= 0 else torch.zeros_like(pos)
    hi = torch.minimum(pos + right, n_keys - 1) if right >= 0 else n_keys - 1  # inclusive
    count = (hi - lo + 1).clamp_(min=0)
    crow = torch.zeros(total_q + 1, dtype=torch.int64)
    torch.cumsum(count, 0, out=crow[1:])
    nnz = int(crow[-1])
    row = torch.repeat_interleave(torch.arange(total_q), count, output_size=nnz)
    # key = the sequence's first key + the row's first visible key + the offset within the row
    first = (ko[:-1] - ko[0])[seq] + lo - crow[:-1]
    col = first[row] + torch.arange(nnz)
    return crow, col, count, row


TransposedPattern = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# The backward's key-major view of the same patterns: built once per pattern as well.
_TRANSPOSED: ValueMemo[TransposedPattern] = ValueMemo(4)


def transposed(
    q_offsets: torch.Tensor, kv_offsets: torch.Tensor, left: int, right: int, total_kv: int
) -> TransposedPattern:
    """The visible pairs key-major (the CSR pattern of the scores' transpose): ``crow_t`` ``[total_kv + 1]``,
    ``col_t`` ``[nnz]`` (each pair's query) and ``perm`` ``[nnz]``, which reorders the query-major values of
    :func:`pattern` into this order (int64 CPU; memoised by value)."""
    qo = q_offsets.detach().to("cpu", torch.int64)
    ko = kv_offsets.detach().to("cpu", torch.int64)

    def make() -> TransposedPattern:
        _, col, _, row = pattern(qo, ko, left, right)
        perm = torch.argsort(col, stable=True)  # by key, then by query (rows are already ascending)
        crow_t = torch.zeros(total_kv + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(col, minlength=total_kv), 0, out=crow_t[1:])
        return crow_t, row.index_select(0, perm), perm

    return _TRANSPOSED.get((qo, ko, left, right, total_kv), make)


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the three ops used here are not
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size=size, check_invariants=False)


def _exp_rows_(
    s: torch.Tensor, count: torch.Tensor, row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place over one head's scores at the pattern (``s`` ``[nnz]``, rows of ``count`` values each, ``row``
    each value's row): ``e = exp(s - m[row])`` with ``m`` the row max, the row sums ``denom`` and their
    reciprocal ``inv``. A row with no value has ``m = 0``, ``denom = 0`` and ``inv = 1``. Returns
    ``(e, m, denom, inv)``."""
    m = torch.segment_reduce(s, "max", lengths=count, unsafe=True)  # -inf for an empty row
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = s.sub_(m.index_select(0, row)).exp_()
    denom = torch.segment_reduce(e, "sum", lengths=count, unsafe=True)  # 0 for an empty row
    inv = torch.where(denom > 0, denom, torch.ones_like(denom)).reciprocal_()
    return e, m, denom, inv


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
    cdt: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of :func:`gem_kernels.attention.cpu.attention_fwd` (same arguments and results) over the
    CSR pattern of the visible pairs; ``cdt`` is the compute dtype (fp32, or fp64 for fp64 inputs).

    Shapes: q ``[total_q, H, D]``, k ``[total_kv, H, D]``, v ``[total_kv, H, Dv]``. Returns ``out``
    ``[total_q, H, Dv]`` in q's dtype and, for softmax, the LSE ``[total_q, H]`` fp32 (``-inf`` for a row
    that sees no key, whose output is 0); for GDPA an empty fp32 tensor."""
    softmax = activation == "softmax"
    total_q, heads = q.shape[0], q.shape[1]
    total_kv, dv = k.shape[0], v.shape[2]
    crow, col, count, row = pattern(q_offsets, kv_offsets, left, right)
    out = torch.empty(total_q, heads, dv, dtype=cdt)
    lse = torch.full((total_q, heads), float("-inf"), dtype=torch.float32) if softmax else torch.empty(0)
    if col.numel() == 0:
        return out.zero_().to(q.dtype), lse
    qc, kc, vc = (t.to(cdt) for t in (q, k, v))
    zeros = torch.zeros(col.numel(), dtype=cdt)
    for h in range(heads):
        scores = _csr(crow, col, zeros, (total_q, total_kv))
        s = torch.sparse.sampled_addmm(scores, qc[:, h], kc[:, h].t(), beta=0.0, alpha=qk_scale).values()
        if softmax:
            e, m, denom, inv = _exp_rows_(s, count, row)
            lse[:, h] = m + torch.log(denom)
            weights, scale = e, inv[:, None]
        else:
            weights, scale = act_value(activation, s), None
        o = _csr(crow, col, weights, (total_q, total_kv)) @ vc[:, h]  # [total_q, Dv]; 0 for an empty row
        out[:, h] = o.mul_(scale) if scale is not None else o.mul_(out_scale)
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
    cdt: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`attention_fwd` over the same CSR pattern: ``(dq, dk, dv)`` in the dtypes of
    ``(q, k, v)``, contiguous; ``dout`` ``[total_q, H, Dv]``.

    Per head, at the visible pairs only: the scores again (``sampled_addmm``), ``dp = dout v^T`` the same
    way; softmax ``p = exp(s - lse)`` with the row's log-sum-exp recomputed from the scores (not the saved
    fp32 one: fp64 stays fp64) and ``ds = p (dp - rowsum(p dp))`` (the row sum over the pattern is
    ``dout . out`` without needing ``out``); GDPA ``ds = out_scale dp act'(s)``. Then ``dq = ds k``, and
    ``dk = ds^T q``, ``dv = p^T dout`` through the key-major pattern (:func:`transposed`)."""
    softmax = activation == "softmax"
    total_q, heads = q.shape[0], q.shape[1]
    total_kv = k.shape[0]
    crow, col, count, row = pattern(q_offsets, kv_offsets, left, right)
    dq = torch.zeros(total_q, heads, q.shape[2], dtype=cdt)
    dk = torch.zeros(total_kv, heads, k.shape[2], dtype=cdt)
    dv = torch.zeros(total_kv, heads, v.shape[2], dtype=cdt)
    if col.numel() == 0:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    crow_t, col_t, perm = transposed(q_offsets, kv_offsets, left, right, total_kv)
    qc, kc, vc, doc = (t.to(cdt) for t in (q, k, v, dout))
    zeros = torch.zeros(col.numel(), dtype=cdt)
    for h in range(heads):
        scores = _csr(crow, col, zeros, (total_q, total_kv))
        s = torch.sparse.sampled_addmm(scores, qc[:, h], kc[:, h].t(), beta=0.0, alpha=qk_scale).values()
        dp = torch.sparse.sampled_addmm(scores, doc[:, h], vc[:, h].t(), beta=0.0).values()
        if softmax:
            p, _, _, inv = _exp_rows_(s, count, row)
            p.mul_(inv.index_select(0, row))
            delta = torch.segment_reduce(p * dp, "sum", lengths=count, unsafe=True)  # = dout . out per row
            ds = dp.sub_(delta.index_select(0, row)).mul_(p)
            weights = p
        else:
            ds = dp.mul_(act_grad(activation, s)).mul_(out_scale)
            weights = act_value(activation, s).mul_(out_scale)
        dq[:, h] = (_csr(crow, col, ds, (total_q, total_kv)) @ kc[:, h]).mul_(qk_scale)
        ds_t, weights_t = ds.index_select(0, perm), weights.index_select(0, perm)
        dk[:, h] = (_csr(crow_t, col_t, ds_t, (total_kv, total_q)) @ qc[:, h]).mul_(qk_scale)
        dv[:, h] = _csr(crow_t, col_t, weights_t, (total_kv, total_q)) @ doc[:, h]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
