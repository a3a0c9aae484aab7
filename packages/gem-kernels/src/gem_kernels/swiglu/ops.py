"""The op face of the SwiGLU feed-forward ``W2 (silu(W1 x) * W3 x)``: checks, the autograd function whose
backward runs the fused kernel, the custom op around the kernel, dispatch.

The forward is the composition of ``F.linear``, ``silu`` and ``mul`` (under ``torch.compile`` inductor fuses
the activation as before); it saves ``x`` and ``gu = [W1 x | W3 x]``, as autograd would. The backward runs
one fused kernel for ``dh = dy @ W2`` and the activation's backward (:mod:`gem_kernels.swiglu.triton`), then
the three remaining GEMMs (``dW2 = dy^T h``, ``dW13 = dgu^T x``, ``dx = dgu W13``) on cuBLAS. On the CPU the
default is the plain composition, autograd as PyTorch's (the values the model always had).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from gem_kernels.checks import FLOAT_DTYPES, check_same
from gem_kernels.dispatch import use_triton
from gem_kernels.swiglu.reference import swiglu_backward_reference, swiglu_ffn_reference

__all__ = ["swiglu_ffn"]


@torch.library.custom_op("gem_kernels::swiglu_backward", mutates_args=())
def _swiglu_backward_op(
    dy: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, use_kernel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernel:
        from gem_kernels.swiglu.triton import swiglu_backward_triton

        return swiglu_backward_triton(dy, w2, gu)
    return swiglu_backward_reference(dy, w2, gu)


@_swiglu_backward_op.register_fake
def _swiglu_backward_fake(
    dy: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, use_kernel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gu), gu.new_empty(gu.shape[0], w2.shape[1])


class _SwiGLUFFN(torch.autograd.Function):
    """x ``[M, d]``, w13 ``[2H, d]``, w2 ``[d_out, H]`` (one dtype) -> ``[M, d_out]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, use_kernel: bool) -> Any:
        gu = F.linear(x, w13)
        gate, up = gu.chunk(2, dim=-1)
        # gu is saved, not returned: an extra output would get a materialised zero gradient (a memset of
        # [M, 2H]) in every backward.
        ctx.save_for_backward(x, w13, w2, gu)
        ctx.use_kernel = use_kernel
        return F.linear(F.silu(gate) * up, w2)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w13, w2, gu = ctx.saved_tensors
        dgu, h = _swiglu_backward_op(dy.contiguous(), w2, gu, ctx.use_kernel)
        dx = dgu @ w13 if ctx.needs_input_grad[0] else None
        dw13 = dgu.t() @ x if ctx.needs_input_grad[1] else None
        dw2 = dy.t() @ h if ctx.needs_input_grad[2] else None
        return dx, dw13, dw2, None


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a dtype in {[str(d) for d in FLOAT_DTYPES]}, got {t.dtype}")
    check_same(("x", "w13", "w2"), (x, w13, w2), "device")
    if w13.dim() != 2 or w2.dim() != 2 or x.dim() < 1:
        raise ValueError(
            f"need x [..., d], w13 [2H, d] and w2 [d_out, H], got {tuple(x.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}"
        )
    if w13.shape[1] != x.shape[-1] or w13.shape[0] != 2 * w2.shape[1]:
        raise ValueError(
            f"shapes do not chain: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (want [2H, d] = "
            f"[{2 * w2.shape[1]}, {x.shape[-1]}]), w2 {tuple(w2.shape)}"
        )


def swiglu_ffn(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """The SwiGLU feed-forward ``W2 (silu(W1 x) * W3 x)``, its backward fused on CUDA.

    Args:
        x: ``[..., d]`` (fp32/fp16/bf16/fp64).
        w13: ``[2H, d]``: W1's rows, then W3's (one ``nn.Linear(d, 2H)``'s weight).
        w2: ``[d_out, H]`` (``nn.Linear(H, d_out)``'s weight).
        backend: ``"auto"`` (the fused backward on CUDA tensors, the plain composition elsewhere),
            ``"triton"`` (the fused backward; on the CPU only under ``TRITON_INTERPRET=1``) or
            ``"reference"`` (the plain composition).

    Returns:
        ``[..., d_out]``. Under autocast the three operands are cast to the autocast dtype first and the
        result is in it, as ``F.linear`` does. Gradients flow to all three.
    """
    _check(x, w13, w2)
    if not use_triton(x, backend) or x.dtype == torch.float64:
        return swiglu_ffn_reference(x, w13, w2)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    else:
        check_same(("x", "w13", "w2"), (x, w13, w2), "dtype")
    lead = x.shape[:-1]
    with torch.autocast(device_type, enabled=False):
        y: torch.Tensor = _SwiGLUFFN.apply(x.reshape(-1, x.shape[-1]), w13, w2, True)  # type: ignore[no-untyped-call]
    return y.reshape(*lead, w2.shape[0])
