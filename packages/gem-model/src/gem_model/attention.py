"""Attention modules over jagged sequences: thin wrappers that project q/k/v and call gem_kernels.

Jagged convention: values ``[total, d]`` with ``offsets`` ``[B+1]`` int64 and a host ``max_len``.
Fixed-size token sets (summary tokens, PMA seeds) are passed to the kernels as jagged too, with
``offsets = arange(B+1) * n``, so every attention in the model is one kernel launch on ragged data.

Queries and keys are RMS-normalised per head (QK-norm) before any rotary rotation, then everything is
cast to the value dtype (under autocast a norm may return fp32 while the projections return bf16).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import gem_kernels
from gem_model.layers import RMSNorm, init_linear, init_unless_meta
from gem_model.rowwise import rowwise

__all__ = ["ContextCrossAttention", "PoolingAttention", "SequenceSelfAttention", "fixed_offsets"]


def fixed_offsets(batch_size: int, n: int, device: torch.device) -> Tensor:
    """Offsets ``[B+1]`` int64 of B sequences of exactly ``n`` tokens."""
    return torch.arange(batch_size + 1, device=device, dtype=torch.int64) * n


class _QKNorm(nn.Module):
    """Per-head RMSNorm of queries and keys ``[tokens, H, D]`` (identity when disabled)."""

    def __init__(self, head_dim: int, enabled: bool, eps: float, device: torch.device | str | None) -> None:
        super().__init__()
        self.q = RMSNorm(head_dim, eps=eps, device=device) if enabled else nn.Identity()
        self.k = RMSNorm(head_dim, eps=eps, device=device) if enabled else nn.Identity()

    def reset_parameters(self) -> None:
        for norm in (self.q, self.k):
            if isinstance(norm, RMSNorm):
                norm.reset_parameters()

    def forward(self, q: Tensor, k: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # Normalised as [tokens * H, D] rows: on the CPU the 3-D (strided: q and k are views of one
        # projection) form runs ~1.5x slower, the same arithmetic.
        return self.norm_q(q, dtype), self.norm_k(k, dtype)

    def norm_q(self, q: Tensor, dtype: torch.dtype) -> Tensor:
        """The queries ``[tokens, H, D]`` alone, normalised and cast to ``dtype``."""
        return self._norm(self.q, q, dtype)

    def norm_k(self, k: Tensor, dtype: torch.dtype) -> Tensor:
        """The keys ``[tokens, H, D]`` alone, normalised and cast to ``dtype``."""
        return self._norm(self.k, k, dtype)

    @staticmethod
    def _norm(norm: nn.Module, x: Tensor, dtype: torch.dtype) -> Tensor:
        if isinstance(norm, nn.Identity):
            return x.to(dtype)
        out: Tensor = norm(x.reshape(-1, x.shape[-1])).view(x.shape)
        return out.to(dtype)


class SequenceSelfAttention(nn.Module):
    """Self-attention over each user's history with rotary temporal positions.

    Args:
        d_model: token width.
        n_heads, head_dim: attention heads.
        kind: "full" (jagged softmax attention), "window" (sliding window of ``window`` events to the
            left, and to the right unless causal) or "block" (``block_size``-event block-diagonal).
        causal: events attend only to older events (and themselves).
        qk_norm: per-head RMSNorm of q and k.
        rotary_base: RoPE base; positions are given per token in :meth:`forward`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        kind: str,
        window: int,
        block_size: int,
        causal: bool,
        qk_norm: bool,
        rotary_base: float,
        norm_eps: float = 1e-5,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if kind not in ("full", "window", "block"):
            raise ValueError(f"unknown self-attention kind {kind!r}")
        self.n_heads, self.head_dim, self.kind = n_heads, head_dim, kind
        self.window, self.block_size, self.causal, self.rotary_base = window, block_size, causal, rotary_base
        self.qkv = nn.Linear(d_model, 3 * n_heads * head_dim, bias=False, device=device)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=False, device=device)
        self.qk_norm = _QKNorm(head_dim, qk_norm, norm_eps, device)

    def reset_parameters(self) -> None:
        init_linear(self.qkv)
        init_linear(self.out)
        self.qk_norm.reset_parameters()

    def forward(self, x: Tensor, offsets: Tensor, max_len: int, positions: Tensor) -> Tensor:
        """x ``[total, d]``, offsets ``[B+1]``, positions ``[total]`` float (rotary) -> ``[total, d]``."""
        total = x.shape[0]
        q, k, v = rowwise(self._project, x)  # position-wise: chunked in CPU inference (gem_model.rowwise)
        if self.kind == "block":
            # The block kernel fuses the rotation (and its backward) into the attention.
            rotary = gem_kernels.Rotary(positions=positions, base=self.rotary_base)
            o = gem_kernels.block_attention(
                q, k, v, offsets, max_seq_len=max_len, block_size=self.block_size, causal=self.causal,
                rotary=rotary,
            )  # fmt: skip
        else:
            # Rotated whole, not per chunk: per chunk its cos/sin tables would be remade every call.
            q = gem_kernels.apply_rotary(q, offsets, positions=positions, base=self.rotary_base)
            k = gem_kernels.apply_rotary(k, offsets, positions=positions, base=self.rotary_base)
            window = None
            if self.kind == "window":
                window = (self.window, 0 if self.causal else self.window)
            o = gem_kernels.jagged_flash_attention(
                q, k, v, offsets, max_q_len=max_len, causal=self.causal, window=window
            )
        return self.out(o.reshape(total, self.n_heads * self.head_dim))

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` ``[n, d]`` -> q, k, v ``[n, H, D]``, q and k normalised (QK-norm), all in v's dtype."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.n_heads, self.head_dim).unbind(1)
        q, k = self.qk_norm(q, k, v.dtype)
        return q, k, v


class ContextCrossAttention(nn.Module):
    """Context-conditioned cross-attention from every history event to the summary tokens (PFFN).

    InterFormer's PFFN makes a per-user weight from the non-sequence summary; here that is a GDPA
    cross-attention with long queries (the history) over a few keys (``[X_sum || S_sum]``):
    ``out_i = (1/n_ctx) sum_j act(q_i . k_j / sqrt(D)) v_j``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        n_context: int,
        *,
        activation: str,
        qk_norm: bool,
        norm_eps: float = 1e-5,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.n_context, self.activation = (
            n_heads,
            head_dim,
            n_context,
            activation,
        )
        self.q = nn.Linear(d_model, n_heads * head_dim, bias=False, device=device)
        self.kv = nn.Linear(d_model, 2 * n_heads * head_dim, bias=False, device=device)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=False, device=device)
        self.qk_norm = _QKNorm(head_dim, qk_norm, norm_eps, device)

    def reset_parameters(self) -> None:
        for linear in (self.q, self.kv, self.out):
            init_linear(linear)
        self.qk_norm.reset_parameters()

    def forward(self, x: Tensor, offsets: Tensor, max_len: int, context: Tensor) -> Tensor:
        """x: ``[total, d]`` history; context ``[B, n_ctx, d]``. Returns ``[total, d]``."""
        total, (b, n_ctx, _) = x.shape[0], context.shape
        k, v = (
            self.kv(context.reshape(b * n_ctx, -1)).view(b * n_ctx, 2, self.n_heads, self.head_dim).unbind(1)
        )
        k = self.qk_norm.norm_k(k, v.dtype)
        (q,) = rowwise(lambda rows: (self._query(rows, v.dtype),), x)  # chunked in CPU inference
        o = gem_kernels.gdpa(
            q, k, v, offsets, fixed_offsets(b, n_ctx, x.device), max_q_len=max_len, max_kv_len=n_ctx,
            activation=self.activation, out_scale=1.0 / n_ctx,
        )  # fmt: skip
        return self.out(o.reshape(total, self.n_heads * self.head_dim))

    def _query(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """``x`` ``[n, d]`` -> normalised queries ``[n, H, D]`` in ``dtype``."""
        return self.qk_norm.norm_q(self.q(x).view(x.shape[0], self.n_heads, self.head_dim), dtype)


class PoolingAttention(nn.Module):
    """Pooling by multi-head attention (PMA): ``n_seeds`` learned queries over each user's history.

    ``kind="softmax"`` uses jagged flash attention; ``kind="gdpa"`` an activation attention whose output
    is scaled by ``1 / max_history_len`` (a constant of the config, so one user's output never depends on
    the other users of the batch). A user with an empty history gets zeros.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        n_seeds: int,
        *,
        kind: str,
        activation: str,
        max_history_len: int,
        qk_norm: bool,
        norm_eps: float = 1e-5,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if kind not in ("softmax", "gdpa"):
            raise ValueError(f"unknown PMA kind {kind!r}")
        self.n_heads, self.head_dim, self.n_seeds, self.kind = n_heads, head_dim, n_seeds, kind
        self.activation, self.max_history_len = activation, max_history_len
        self.seeds = nn.Parameter(torch.empty(n_seeds, d_model, device=device))
        self.q = nn.Linear(d_model, n_heads * head_dim, bias=False, device=device)
        self.kv = nn.Linear(d_model, 2 * n_heads * head_dim, bias=False, device=device)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=False, device=device)
        self.qk_norm = _QKNorm(head_dim, qk_norm, norm_eps, device)
        init_unless_meta(self, self.seeds)

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.seeds, std=1.0, a=-3.0, b=3.0)
        for linear in (self.q, self.kv, self.out):
            init_linear(linear)
        self.qk_norm.reset_parameters()

    def forward(self, x: Tensor, offsets: Tensor, max_len: int) -> Tensor:
        """x: ``[total, d]`` history. Returns ``[B, n_seeds, d]``."""
        b, h, dh = offsets.numel() - 1, self.n_heads, self.head_dim
        k, v = rowwise(self._keys_values, x)  # chunked in CPU inference (gem_model.rowwise)
        # The seeds' queries normalised once, then repeated per user (a row-wise norm: the same values).
        q = self.qk_norm.norm_q(self.q(self.seeds).view(1, self.n_seeds, h, dh), v.dtype)
        q = q.expand(b, -1, -1, -1).reshape(b * self.n_seeds, h, dh)
        q_offsets = fixed_offsets(b, self.n_seeds, x.device)
        if self.kind == "softmax":
            o = gem_kernels.jagged_flash_attention(
                q, k, v, q_offsets, offsets, max_q_len=self.n_seeds, max_kv_len=max_len
            )
        else:
            o = gem_kernels.gdpa(
                q, k, v, q_offsets, offsets, max_q_len=self.n_seeds, max_kv_len=max_len,
                activation=self.activation, out_scale=1.0 / self.max_history_len,
            )  # fmt: skip
        return self.out(o.reshape(b, self.n_seeds, h * dh))

    def _keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``[n, d]`` -> k (normalised), v ``[n, H, D]`` in v's dtype."""
        k, v = self.kv(x).view(x.shape[0], 2, self.n_heads, self.head_dim).unbind(1)
        return self.qk_norm.norm_k(k, v.dtype), v
