"""The op face of rotary position embeddings (RoPE) on jagged tensors, and the ``Rotary`` spec of block
attention.

Convention ("rotate_half", as in GPT-NeoX and Llama's Hugging Face port): the head dimension ``D`` is
split in halves, pair ``i`` is ``(x[..., i], x[..., i + D/2])`` and is rotated by
``angle_i = position * base ** (-2i / D)``::

    out[..., :D/2] = x1 * cos - x2 * sin
    out[..., D/2:] = x2 * cos + x1 * sin

Positions are 0..len-1 within each sequence by default, or any per-token tensor ``[total]`` (integer
or real-valued, e.g. log time gaps for rotary temporal embeddings). Positions get no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gem_kernels.checks import check_offsets, check_values
from gem_kernels.dispatch import use_triton
from gem_kernels.rotary.cpu import rotary_cpu

__all__ = ["Rotary", "apply_rotary"]


@dataclass(frozen=True)
class Rotary:
    """Rotary embeddings that :func:`gem_kernels.block_attention` applies to q and k inside its kernel.

    Args:
        positions: per-token positions ``[total]`` (any integer or floating dtype, same device as q),
            or ``None`` for 0..len-1 within each sequence.
        base: the frequency base (``angle_i = position * base ** (-2i / D)``), > 0.
    """

    positions: torch.Tensor | None = None
    base: float = 10000.0


def check_rotary_args(name: str, positions: torch.Tensor | None, base: float, x: torch.Tensor) -> None:
    """Validate positions ``[total]`` and base for rotating ``x`` ``[total, H, D]``."""
    if x.shape[-1] % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {name} with D={x.shape[-1]}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base must be a positive number, got {base!r}")
    if positions is None:
        return
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor or None, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must have an integer or floating dtype, got {positions.dtype}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions must have shape [total] = [{x.shape[0]}], got {tuple(positions.shape)}")
    if positions.device != x.device:
        raise ValueError(f"positions is on {positions.device} but {name} is on {x.device}")


@torch.library.custom_op("gem_kernels::apply_rotary", mutates_args=())
def _apply_rotary_op(
    x: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor | None, base: float, inverse: bool
) -> torch.Tensor:
    if x.dtype != torch.float64 and use_triton(x):
        from gem_kernels.rotary.triton import rotary_triton

        return rotary_triton(x, offsets, positions, base, inverse)
    return rotary_cpu(x, offsets, positions, base, inverse)


@_apply_rotary_op.register_fake
def _apply_rotary_fake(
    x: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor | None, base: float, inverse: bool
) -> torch.Tensor:
    return torch.empty_like(x)


def _apply_rotary_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, offsets, positions, base, inverse = inputs
    ctx.save_for_backward(offsets, positions)
    ctx.base, ctx.inverse = base, inverse


def _apply_rotary_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    offsets, positions = ctx.saved_tensors
    # A rotation's transpose is the rotation by the opposite angle.
    dx = _apply_rotary_op(grad.contiguous(), offsets, positions, ctx.base, not ctx.inverse)
    return dx, None, None, None, None


_apply_rotary_op.register_autograd(_apply_rotary_backward, setup_context=_apply_rotary_setup)


def apply_rotary(
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    base: float = 10000.0,
) -> torch.Tensor:
    """Rotate ``x`` ``[total, H, D]`` (fp32/fp16/bf16/fp64, D even) by rotary embeddings.

    Args:
        x: jagged values ``[total, H, D]``.
        offsets: ``[B+1]`` int32/int64 sequence offsets.
        positions: ``None`` (0..len-1 within each sequence) or a per-token tensor ``[total]``, integer
            or floating (real-valued positions such as log time gaps work as they are).
        base: frequency base, ``angle_i = position * base ** (-2i / D)``.

    Returns:
        ``[total, H, D]`` in x's dtype, computed in fp32 and rounded once. Differentiable in ``x``.
    """
    check_values("x", x, ndim=3)
    check_offsets("offsets", offsets, total=x.shape[0], device=x.device)
    check_rotary_args("x", positions, base, x)
    out: torch.Tensor = _apply_rotary_op(x.contiguous(), offsets, positions, float(base), False)
    return out
