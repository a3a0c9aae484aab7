"""Small dense building blocks shared by the interaction and sequence halves.

Every module here has ``reset_parameters()`` so :meth:`GemModel.init_weights` can initialise a model that
was built on the meta device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import gem_kernels

__all__ = ["Gating", "RMSNorm", "SwiGLU", "TokenLinear", "init_linear", "init_unless_meta"]


def init_linear(linear: nn.Linear, std: float | None = None) -> None:
    """Truncated-normal weights (std ``1/sqrt(fan_in)`` unless given) and zero bias."""
    std = 1.0 / math.sqrt(linear.in_features) if std is None else std
    nn.init.trunc_normal_(linear.weight, std=std, a=-3 * std, b=3 * std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def init_unless_meta(module: nn.Module, own: Tensor) -> None:
    """Calls ``module.reset_parameters()`` unless ``own`` (a tensor of the module's own, which tells where it
    was built: the parameter it made with ``torch.empty``, or a buffer) lives on the meta device.

    As ``nn.Linear`` does: a module built on a real device is usable at once (a piece lifted into another
    stack has no :meth:`GemModel.init_weights` to fill its uninitialised memory); one built on meta waits
    for ``to_empty`` and ``init_weights``.
    """
    if own.device.type != "meta":
        module.reset_parameters()  # type: ignore[operator]


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose weight follows the input dtype.

    With a bf16 input (autocast) and an fp32 weight, ``torch.rms_norm`` falls back to its unfused
    composite form (about ten elementwise passes over the tensor, forward and backward: measured as the
    largest share of a base-config step on the H200). Casting the weight keeps the fused kernel, which
    accumulates in fp32 anyway. Parameter names are those of ``nn.RMSNorm``.
    """

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        if x.device.type == "cpu" and len(self.normalized_shape) == 1:
            return _rms_norm_cpu(x, weight, self.eps)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def _rms_norm_cpu(x: Tensor, weight: Tensor | None, eps: float | None) -> Tensor:
    """``F.rms_norm`` over the last dimension on the CPU, in three passes instead of six.

    On the CPU ``rms_norm`` is a composite (``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, ``mul``, each a
    pass over a new tensor); here one reduction (``vector_norm``) and two multiplications: ~1.25-1.6x at the
    tiny model's ``[22k, 32]`` and ``[44k, 16]``, ~1.1x for its whole forward. The mean square is the norm
    squared (one rounding of the accumulation dtype from the sum of squares). Without autograd the two
    multiplications run in place, with the same arithmetic, so the values do not depend on the grad mode."""
    x = x.contiguous()  # a strided reduction runs far slower than a copy and a contiguous one
    dim = x.shape[-1]
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # as F.rms_norm accumulates
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc)
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        inv = (norm.square() / dim + eps).rsqrt().to(x.dtype)
        out = x * inv
        return out * weight if weight is not None else out
    inv = norm.square_().div_(dim).add_(eps).rsqrt_().to(x.dtype)
    out = torch.mul(x, inv)
    return out.mul_(weight) if weight is not None else out


class TokenLinear(nn.Module):
    """A linear map over the token axis: ``[B, n_in, d] -> [B, n_out, d]`` (``Y[b] = W X[b]``).

    Recombines whole tokens (Wukong's linear compression block, InterFormer's n -> n_sum summary).
    """

    def __init__(self, n_in: int, n_out: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_out, n_in, device=device))
        init_unless_meta(self, self.weight)

    def reset_parameters(self) -> None:
        std = 1.0 / math.sqrt(self.n_in)
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, n_in, d]`` -> ``[B, n_out, d]``."""
        return torch.einsum("mn,bnd->bmd", self.weight, x)


class Gating(nn.Module):
    """Self-gating of tokens: ``x * sigmoid(W x + b)`` over the feature axis (InterFormer's Gating).

    Shapes: ``[..., d] -> [..., d]``.
    """

    def __init__(self, d: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, device=device)

    def reset_parameters(self) -> None:
        init_linear(self.proj)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.proj(x))


class SwiGLU(nn.Module):
    """Feed-forward ``W2 (silu(W1 x) * W3 x)`` on ``[..., d]`` with hidden width ``hidden``.

    ``fused``: through :func:`gem_kernels.swiglu_ffn` (one kernel for the backward's ``dh`` GEMM and the
    activation's backward on CUDA; the same composition on the CPU) while both projections are plain
    ``nn.Linear``; a projection another module replaced (an FP8 linear) is called as a module.
    """

    def __init__(
        self, d: int, hidden: int, device: torch.device | str | None = None, fused: bool = False
    ) -> None:
        super().__init__()
        self.w13 = nn.Linear(d, 2 * hidden, bias=False, device=device)
        self.w2 = nn.Linear(hidden, d, bias=False, device=device)
        self.fused = fused

    def reset_parameters(self) -> None:
        init_linear(self.w13)
        init_linear(self.w2)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and type(self.w13) is nn.Linear and type(self.w2) is nn.Linear:
            return gem_kernels.swiglu_ffn(x, self.w13.weight, self.w2.weight)
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
