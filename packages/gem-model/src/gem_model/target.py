"""Target-aware attention from an item to the user's earlier events, and the autoregressive history objective.

GEM's sequence half summarises the history without looking at the candidate (PMA seeds, the latest events).
A ranking model also needs the history *as seen from the candidate*: how the user acted on items like this
one (DIN's target attention, HSTU's target-aware attention). :class:`TargetAttention` does that with one
causal softmax attention over two interleaved jagged streams of ``n + 1`` rows per user:

- queries ``Q = [item_1, ..., item_n, candidate]``: item embeddings only (no action: that is what is
  predicted), from the one table the history's items and the candidate share;
- keys and values ``K = [NONE, event_1, ..., event_n]``: a learned "no earlier event" token, then the
  history's event tokens (item, action, side features, time), shifted one row to the right.

With causal attention (row ``i`` sees rows ``j <= i``), query ``i`` sees ``NONE`` and events ``1 .. i-1``:
exactly the events before it; the candidate (row ``n + 1``) sees every history event, all strictly earlier
than the request by the data's contract. Rotary positions are the events' temporal positions (the
candidate's is 0, "now"), so a score depends on the time between the query's event and the key's.

Each row's readout ``r`` and its query token ``q`` make ``g = SiLU(W [r || q || r * q])`` (the product is
the candidate x history-aggregate cross). The candidate's ``g`` goes to the task heads; with the auxiliary
objective every history event's ``g`` predicts its own action (``Linear(d, num_actions)``), so the readout
is trained at every position of every history, not only through the candidates (HSTU's training).

Strictly earlier, also for the auxiliary objective: a history event's prefix may hold events of the same
timestamp (users rate several items in one second), which the candidate's history never holds (the data
source keeps only strictly earlier events). :func:`first_of_timestamp` marks the events whose prefix is
strictly earlier, and only those are supervised.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import gem_kernels
from gem_model.attention import _QKNorm, fixed_offsets
from gem_model.layers import RMSNorm, init_linear, init_unless_meta

__all__ = ["TargetAttention", "first_of_timestamp", "history_action_loss"]


def first_of_timestamp(timestamps: Tensor, offsets: Tensor) -> Tensor:
    """``[total]`` bool: event ``i`` is the first of its sequence or later than the event before it.

    Those are the events whose every predecessor in the (time-sorted) sequence is strictly earlier.
    ``timestamps`` ``[total]`` int64, non-decreasing within each sequence; ``offsets`` ``[B+1]``.
    """
    total = timestamps.shape[0]
    first = torch.ones(total, dtype=torch.bool, device=timestamps.device)
    if total > 1:
        first[1:] = timestamps[1:] > timestamps[:-1]
    # Every sequence's first event (offsets[b] < total: empty sequences point past the end or at the next).
    starts = offsets[:-1]
    first[starts[starts < total]] = True
    return first


def history_action_loss(logits: Tensor, actions: Tensor, supervised: Tensor) -> Tensor:
    """Mean cross-entropy of the supervised events' actions (fp32; 0 when none is supervised).

    ``logits`` ``[total, num_actions]``, ``actions`` ``[total]`` int64, ``supervised`` ``[total]`` bool.
    """
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    ce = F.cross_entropy(wide, actions, reduction="none")
    weight = supervised.to(torch.float32)
    return (ce.float() * weight).sum() / weight.sum().clamp(min=1.0)


class TargetAttention(nn.Module):
    """See the module docstring. Shapes: history tokens ``[total, d]``, item embeddings ``[total, E]``,
    candidate embeddings ``[B, E]``; returns the candidate's token ``[B, d]`` and, when asked, the
    history events' action logits ``[total, num_actions]`` (fp32).

    Args:
        d_model: width of the history tokens and of the output token.
        embedding_dim: width of the item embeddings (the queries' input).
        n_heads, head_dim: attention heads.
        num_actions: classes of the auxiliary objective (0: no action head).
        qk_norm: per-head RMSNorm of queries and keys.
        rotary_base: RoPE base of the temporal positions.
        dropout: dropout on the output token (training only).
    """

    def __init__(
        self,
        d_model: int,
        embedding_dim: int,
        n_heads: int,
        head_dim: int,
        *,
        num_actions: int,
        qk_norm: bool,
        rotary_base: float,
        norm_eps: float = 1e-5,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rotary_base = n_heads, head_dim, rotary_base
        a = n_heads * head_dim
        self.none_token = nn.Parameter(torch.empty(d_model, device=device))
        self.query_norm = RMSNorm(embedding_dim, eps=norm_eps, device=device)
        self.key_norm = RMSNorm(d_model, eps=norm_eps, device=device)
        self.item = nn.Linear(embedding_dim, d_model, bias=False, device=device)
        self.q = nn.Linear(d_model, a, bias=False, device=device)
        self.kv = nn.Linear(d_model, 2 * a, bias=False, device=device)
        self.out = nn.Linear(a, d_model, bias=False, device=device)
        self.qk_norm = _QKNorm(head_dim, qk_norm, norm_eps, device)
        self.mix = nn.Linear(3 * d_model, d_model, device=device)
        self.action_head = nn.Linear(d_model, num_actions, device=device) if num_actions else None
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        init_unless_meta(self, self.none_token)

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.none_token, std=0.02)
        self.query_norm.reset_parameters()
        self.key_norm.reset_parameters()
        for linear in (self.item, self.q, self.kv, self.out, self.mix):
            init_linear(linear)
        if self.action_head is not None:
            init_linear(self.action_head, std=0.01)
        self.qk_norm.reset_parameters()

    def forward(
        self,
        tokens: Tensor,
        offsets: Tensor,
        max_len: int,
        positions: Tensor,
        items: Tensor,
        candidate: Tensor,
        history_logits: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """tokens ``[total, d]`` (the history's event tokens), offsets ``[B+1]``, host ``max_len``,
        positions ``[total]`` float (temporal rotary positions, 0 = the request time), items ``[total, E]``
        (the history's item embeddings), candidate ``[B, E]`` -> (candidate token ``[B, d]``, action logits
        ``[total, num_actions]`` in fp32 (fp64 for fp64 inputs) or None)."""
        b, total = candidate.shape[0], tokens.shape[0]
        h, dh = self.n_heads, self.head_dim
        one = fixed_offsets(b, 1, tokens.device)
        # Keys and values [NONE, event_1 .. event_n]: n + 1 rows a user, offsets ``both``.
        none = self.none_token.to(tokens.dtype).expand(b, -1)
        key_in, both = gem_kernels.jagged_concat(none, one, tokens, offsets)
        zeros = positions.new_zeros(b, 1)
        k_pos, _ = gem_kernels.jagged_concat(zeros, one, positions[:, None], offsets)
        if history_logits:
            # Queries [item_1 .. item_n, candidate], causal: row i sees NONE and the events before it.
            query_in, _ = gem_kernels.jagged_concat(items.to(candidate.dtype), offsets, candidate, one)
            q_pos = gem_kernels.jagged_concat(positions[:, None], offsets, zeros, one)[0][:, 0]
            q_offsets, max_q = both, max_len + 1
        else:
            # Only the candidate's row is needed: one query a user over every key (the same scores as
            # the candidate's row of the causal form, which sees every key).
            query_in, q_pos, q_offsets, max_q = candidate, zeros[:, 0], one, 1
        query_tok = self.item(self.query_norm(query_in))
        dtype = query_tok.dtype
        rows = query_tok.shape[0]
        q = self.q(query_tok).view(rows, h, dh)
        k, v = self.kv(self.key_norm(key_in).to(dtype)).view(total + b, 2, h, dh).unbind(1)
        q, k = self.qk_norm(q, k, v.dtype)
        q = gem_kernels.apply_rotary(q, q_offsets, positions=q_pos, base=self.rotary_base)
        k = gem_kernels.apply_rotary(k, both, positions=k_pos[:, 0], base=self.rotary_base)
        if history_logits:
            o = gem_kernels.jagged_flash_attention(q, k, v, both, max_q_len=max_q, causal=True)
        else:
            o = gem_kernels.jagged_flash_attention(
                q, k, v, one, both, max_q_len=max_q, max_kv_len=max_len + 1
            )
        readout = self.out(o.reshape(rows, h * dh))
        query_tok = query_tok.to(readout.dtype)
        g = F.silu(self.mix(torch.cat([readout, query_tok, readout * query_tok], dim=-1)))
        logits = None
        if history_logits:
            if self.action_head is None:
                raise ValueError("TargetAttention: history logits asked for, but num_actions is 0")
            hist_g, cand_g = gem_kernels.jagged_split(g, both, offsets, one, a_total=total)
            logits = self.action_head(hist_g)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
        else:
            cand_g = g
        return self.dropout(cand_g), logits
