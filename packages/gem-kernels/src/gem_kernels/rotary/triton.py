"""Triton kernel of :func:`gem_kernels.apply_rotary` (one pass over x, rotation in fp32 registers), and the
FMA-only sin/cos (:func:`cos_sin`) that block attention's fused rotary shares.

Program (token tile, head): loads the two halves of ``BLOCK_T`` rows of one head, their positions, and
writes the rotated halves. The default positions (0..len-1 per sequence) are computed on the device by
index arithmetic before the launch (4 bytes per token, against ``2 * H * D`` bytes of x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.rotary.reference import inv_frequencies, rotary_positions

BLOCK_T = 32


@triton.jit
def cos_sin(angle):
    """cos and sin of fp32 angles, by FMAs only (no libdevice call, no local memory).

    Reduce to ``r`` in [-pi, pi] with a two-constant Cody-Waite step (angles reach thousands of radians
    for long sequences), evaluate sin and cos of ``r / 2`` (in [-pi/2, pi/2]) by their Taylor series to
    degree 11 and 12 (truncation error < 6e-8), then double the angle. Absolute error ~1e-7, at the
    level of the fp32 rounding of the angle itself. libdevice's precise sinf/cosf carry a Payne-Hanek
    slow path with a local-memory table, which spilled and cost 2-3x the whole kernel on the H200.
    """
    k = tl.floor(angle * 0.15915494309189535 + 0.5)
    # 2*pi = 6.28125 + 0.0019353071795864769; k * 6.28125 is exact for k < 2**15.
    x = ((angle - k * 6.28125) - k * 0.0019353071795864769) * 0.5
    x2 = x * x
    s = -2.505210838544172e-08
    s = s * x2 + 2.7557319223985893e-06
    s = s * x2 - 1.984126984126984e-04
    s = s * x2 + 8.333333333333333e-03
    s = s * x2 - 1.6666666666666666e-01
    s = x + x * x2 * s
    c = 2.08767569878681e-09
    c = c * x2 - 2.755731922398589e-07
    c = c * x2 + 2.48015873015873e-05
    c = c * x2 - 1.388888888888889e-03
    c = c * x2 + 4.1666666666666664e-02
    c = c * x2 - 0.5
    c = 1.0 + x2 * c
    return c * c - s * s, 2.0 * s * c


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
