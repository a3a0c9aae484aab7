"""PyTorch reference of the SwiGLU feed-forward and of its fused backward step (the test oracle)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["swiglu_backward_reference", "swiglu_ffn_reference"]


def swiglu_ffn_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``W2 (silu(W1 x) * W3 x)``: x ``[..., d]``, w13 ``[2H, d]`` (W1 rows then W3 rows), w2 ``[d_out, H]``
    -> ``[..., d_out]``. The composition of ``F.linear``, ``silu`` and ``mul`` (autograd as PyTorch's)."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def swiglu_backward_reference(
    dy: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward step the Triton kernel fuses, in fp32 (fp64 for fp64 inputs), rounded once.

    Args:
        dy: ``[M, d_out]`` gradient of the output.
        w2: ``[d_out, H]`` the down projection's weight.
        gu: ``[M, 2H]`` the forward's ``[W1 x | W3 x]``.

    Returns:
        ``dgu [M, 2H]`` (the gradient of ``gu``: ``[dgate | dup]``) and ``h [M, H] = silu(gate) * up`` (the
        down projection's input, recomputed for its weight gradient), both in gu's dtype.
    """
    acc = torch.float64 if gu.dtype == torch.float64 else torch.float32
    dh = dy.to(acc) @ w2.to(acc)
    gate, up = gu.to(acc).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgate = dh * up * sig * (1 + gate * (1 - sig))
    dup = dh * silu
    return torch.cat([dgate, dup], dim=-1).to(gu.dtype), (silu * up).to(gu.dtype)
