"""The interaction half: summaries of both feature groups and the Wukong / DHEN token mixer.

Shapes: non-sequence tokens ``[B, n, d]``; history ``[total, d]`` jagged with offsets ``[B+1]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import gem_kernels
from gem_model.attention import PoolingAttention
from gem_model.layers import Gating, RMSNorm, TokenLinear, init_linear, init_unless_meta

__all__ = ["NonSequenceSummary", "SequenceSummary", "WukongEnsemble", "WukongLayer"]


class NonSequenceSummary(nn.Module):
    """InterFormer's ``X_sum = Gating(MLP(X))``: ``n`` tokens -> ``n_sum`` gated summary tokens."""

    def __init__(
        self, n_tokens: int, n_sum: int, d_model: int, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.mix = TokenLinear(n_tokens, n_sum, device=device)
        self.gate = Gating(d_model, device=device)

    def reset_parameters(self) -> None:
        self.mix.reset_parameters()
        self.gate.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, n, d]`` -> ``[B, n_sum, d]``."""
        return self.gate(self.mix(x))


class SequenceSummary(nn.Module):
    """``S_sum = Gating([PMA(S) || recent_k(S)])``: a few tokens that stand for a long history.

    PMA pools with learned seed queries; the ``n_recent`` latest events are copied (zeros where a user
    has fewer events).
    """

    def __init__(
        self,
        pma: PoolingAttention,
        n_recent: int,
        d_model: int,
        eps: float,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.n_recent = n_recent
        self.norm = RMSNorm(d_model, eps=eps, device=device)
        self.pma = pma
        self.gate = Gating(d_model, device=device)

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        self.pma.reset_parameters()
        self.gate.reset_parameters()

    def forward(self, s: Tensor, offsets: Tensor, max_len: int) -> Tensor:
        """s: ``[total, d]`` -> ``[B, n_pma + n_recent, d]``."""
        s = self.norm(s)
        parts = [self.pma(s, offsets, max_len)]
        if self.n_recent:
            recent, mask = gem_kernels.jagged_last_k(s, offsets, self.n_recent)
            parts.append(recent * mask.unsqueeze(-1).to(recent.dtype))
        tokens = torch.cat([p.to(parts[0].dtype) for p in parts], dim=1)
        return self.gate(tokens)


class WukongLayer(nn.Module):
    """One Wukong layer: ``LN([FMB(X) || LCB(X)] + W_res X)``, ``[B, n_in, d] -> [B, n_out, d]``.

    FMB (factorization-machine block) in the low-rank form: ``Z = X (X^T Y)`` with learned
    ``Y in R^{n_in x k}`` (``O(n k d)`` instead of ``O(n^2 d)``), flattened, LayerNorm, MLP to
    ``n_fm x d``. LCB (linear compression block): ``W_L X`` to the remaining ``n_out - n_fm`` tokens.
    """

    def __init__(
        self,
        n_in: int,
        n_out: int,
        n_fm: int,
        d_model: int,
        rank: int,
        hidden: int,
        eps: float,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= n_fm <= n_out:
            raise ValueError(f"WukongLayer: n_fm must lie in [1, n_out={n_out}], got {n_fm}")
        self.n_in, self.n_out, self.n_fm, self.d_model, self.rank = n_in, n_out, n_fm, d_model, rank
        self.fm_y = nn.Parameter(torch.empty(n_in, rank, device=device))
        self.fm_norm = nn.LayerNorm(n_in * rank, eps=eps, device=device)
        self.fm_up = nn.Linear(n_in * rank, hidden, device=device)
        self.fm_down = nn.Linear(hidden, n_fm * d_model, device=device)
        self.lcb = TokenLinear(n_in, n_out - n_fm, device=device) if n_out > n_fm else None
        self.residual = TokenLinear(n_in, n_out, device=device)
        self.norm = nn.LayerNorm(d_model, eps=eps, device=device)
        init_unless_meta(self, self.fm_y)

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.fm_y, std=self.n_in**-0.5, a=-3 * self.n_in**-0.5, b=3 * self.n_in**-0.5)
        self.fm_norm.reset_parameters()
        init_linear(self.fm_up)
        init_linear(self.fm_down)
        if self.lcb is not None:
            self.lcb.reset_parameters()
        self.residual.reset_parameters()
        self.norm.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        b = x.shape[0]
        # Y^T X as one broadcast matmul ([k, n] @ [B, n, d]), then viewed transposed: the einsum
        # "bnd,nk->bdk" copied X to [B * d, n] and ran a [B * d, n] x [n, k] GEMM: ~5x slower on the CPU.
        xty = torch.matmul(self.fm_y.t(), x).transpose(1, 2)  # X^T Y: [B, d, k]
        z = torch.bmm(x, xty)  # X (X^T Y): [B, n_in, k], all pairwise interactions through rank k
        fm = self.fm_down(F.silu(self.fm_up(self.fm_norm(z.reshape(b, -1)))))
        parts = [fm.view(b, self.n_fm, self.d_model)]
        if self.lcb is not None:
            parts.append(self.lcb(x))
        out = torch.cat([p.to(parts[0].dtype) for p in parts], dim=1)
        return self.norm(out + self.residual(x))


class WukongEnsemble(nn.Module):
    """A DHEN-style gated ensemble (mixture of Wukong experts), ``[B, n_in, d] -> [B, n_out, d]``.

    Every expert sees every sample; a softmax gate on the mean input token weighs them per sample:
    ``forward(x) = expert_sum(x, gate_weights(x))``. Experts live in ``self.experts`` (a ModuleList) and
    the two halves are public, so expert parallelism can place experts on different ranks and sum a
    subset of them without repeating the gate. With one expert the gate is skipped.
    """

    def __init__(
        self,
        n_experts: int,
        make_expert: Callable[[], WukongLayer],
        d_model: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.experts = nn.ModuleList([make_expert() for _ in range(n_experts)])
        self.gate = nn.Linear(d_model, n_experts, device=device) if n_experts > 1 else None

    def reset_parameters(self) -> None:
        for expert in self.experts:
            cast(WukongLayer, expert).reset_parameters()  # a ModuleList yields Modules: these are experts
        if self.gate is not None:
            # Zero gate: the experts start as an even average and specialise as the gate learns.
            nn.init.zeros_(self.gate.weight)
            nn.init.zeros_(self.gate.bias)

    def gate_weights(self, x: Tensor) -> Tensor | None:
        """Per-sample expert weights: x ``[B, n_in, d]`` -> ``[B, n_experts]`` float32 (softmax over
        experts of the gate applied to the mean input token); None with one expert (no gate)."""
        if self.gate is None:
            return None
        return torch.softmax(self.gate(x.mean(dim=1)).float(), dim=-1)

    def expert_sum(
        self, x: Tensor, weights: Tensor, experts: Iterable[tuple[int, nn.Module]] | None = None
    ) -> Tensor:
        """``sum_e weights[:, e] * expert_e(x)`` over ``(e, expert)`` pairs (default: every expert, in
        order), ``[B, n_out, d]``. ``weights`` is ``[B, n_experts]`` from :meth:`gate_weights`; ``e`` is
        the expert's index in the whole ensemble (a subset of experts gives a partial sum)."""
        out = None
        for e, expert in enumerate(self.experts) if experts is None else experts:
            y = expert(x)
            y = y * weights[:, e, None, None].to(y.dtype)
            out = y if out is None else out + y
        if out is None:
            raise ValueError("WukongEnsemble.expert_sum: no experts to sum")
        return out

    def forward(self, x: Tensor) -> Tensor:
        weights = self.gate_weights(x)
        if weights is None:  # one expert, no gate
            out: Tensor = self.experts[0](x)
            return out
        return self.expert_sum(x, weights)
