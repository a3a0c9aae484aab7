"""PyTorch reference of rotary embeddings on jagged tensors: the CPU path and the test oracle.

It computes in fp32 (fp64 for fp64 inputs) and rounds once to the input dtype at the end, which is what the
Triton kernels (:mod:`.triton`, and block attention's fused rotary) do too. :func:`inv_frequencies` is the
one source of the frequencies: the kernels load the tensor it returns.
"""

from __future__ import annotations

import math

import torch

from gem_kernels.jagged.reference import token_positions


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the references compute in: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def inv_frequencies(
    head_dim: int, base: float, dtype: torch.dtype, device: torch.device | str | None
) -> torch.Tensor:
    """``base ** (-2i / head_dim)`` for ``i < head_dim // 2``: ``[head_dim // 2]`` in ``dtype``.

    Computed in fp64 and rounded once, so the kernels (which load this tensor) and the reference use
    the very same frequencies.
    """
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return torch.exp(-(2.0 * i / head_dim) * math.log(base)).to(dtype)


def rotary_positions(
    offsets: torch.Tensor, total: int, positions: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Per-token positions ``[total]`` in ``dtype``: ``positions`` if given, else 0..len-1 per sequence."""
    if positions is not None:
        return positions.to(dtype)
    return token_positions(offsets, total)[1].to(dtype)


def rotary_reference(
    x: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor | None = None,
    base: float = 10000.0,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[total, H, D]`` (half-split convention), same dtype out.

    Pair ``i`` is ``(x[..., i], x[..., i + D/2])``, rotated by ``angle = position * base**(-2i/D)``:
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``. ``inverse`` rotates by ``-angle`` (the transpose, which
    is the backward).
    """
    ct = compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    pos = rotary_positions(offsets, x.shape[0], positions, ct)
    angle = pos[:, None] * inv_frequencies(x.shape[-1], base, ct, x.device)[None, :]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    if inverse:
        sin = -sin
    x1, x2 = x[..., :half].to(ct), x[..., half:].to(ct)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
