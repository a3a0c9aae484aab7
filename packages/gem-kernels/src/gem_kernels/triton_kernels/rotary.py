"""Triton kernel of :func:`gem_kernels.apply_rotary`: one pass over x, rotation in fp32 registers.

Program (token tile, head): loads the two halves of ``BLOCK_T`` rows of one head, their positions, and
writes the rotated halves. The default positions (0..len-1 per sequence) are computed on the device by
index arithmetic before the launch (4 bytes per token, against ``2 * H * D`` bytes of x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.torch_ops.block_reference import inv_frequencies, rotary_positions
from gem_kernels.triton_kernels.block import cos_sin

BLOCK_T = 32


@triton.jit
def _rotary_kernel(
    X, Y, positions_ptr, inv_freq_ptr, total, stride_t, stride_h,
    HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, HALF_P)
    row_ok = rows < total
    mask = row_ok[:, None] & (d < HALF)[None, :]
    pos = tl.load(positions_ptr + rows, mask=row_ok, other=0.0)
    freq = tl.load(inv_freq_ptr + d, mask=d < HALF, other=0.0)
    cos, sin = cos_sin(pos[:, None] * freq[None, :])
    if INVERSE:
        sin = -sin
    off = rows[:, None] * stride_t + h * stride_h + d[None, :]
    x1 = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + off + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = Y.dtype.element_ty
    tl.store(Y + off, (x1 * cos - x2 * sin).to(dt), mask=mask)
    tl.store(Y + off + HALF, (x2 * cos + x1 * sin).to(dt), mask=mask)


def rotary_triton(
    x: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor | None, base: float, inverse: bool
) -> torch.Tensor:
    """x ``[total, H, D]`` contiguous (D even) -> rotated ``[total, H, D]``, same dtype."""
    total, heads, d = x.shape
    y = torch.empty_like(x)
    if total == 0:
        return y
    pos = rotary_positions(offsets, total, positions, torch.float32).contiguous()
    inv_freq = inv_frequencies(d, base, torch.float32, x.device)
    half = d // 2
    grid = (triton.cdiv(total, BLOCK_T), heads)
    _rotary_kernel[grid](
        x, y, pos, inv_freq, total, x.stride(0), x.stride(1),
        HALF=half, HALF_P=max(16, triton.next_power_of_2(half)), BLOCK_T=BLOCK_T, INVERSE=inverse,
    )  # fmt: skip
    return y
