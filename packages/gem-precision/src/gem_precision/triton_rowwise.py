"""Triton kernels of row-wise FP8 quantization (the ``fp8_rowwise`` recipe's casts)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_precision.formats import ElemFormat
from gem_precision.triton_fp8 import NATIVE_FP8_CAST, fp8_bits, interpreting

_AMAX_EPS = tl.constexpr(1e-12)  # as in gem_precision.rowwise


@triton.jit
def _rowwise_kernel(
    x_ptr, data_ptr, scale_ptr, R, C, stride_r, stride_c, stride_out,
    BR: tl.constexpr, BC: tl.constexpr,
    MBITS: tl.constexpr, BIAS: tl.constexpr, MAXV: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    """Rows [BR] of x [R, C]: pass 1 finds each row's amax, pass 2 (re-reading from L2) quantizes.

    data rows are ``stride_out >= C`` bytes apart (columns past C, the K padding, are left alone)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    amax = tl.zeros((BR,), dtype=tl.float32)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    scale = tl.maximum(amax, _AMAX_EPS) / MAXV
    tl.store(scale_ptr + rows, scale, mask=rmask)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0)
        v = tl.minimum(tl.maximum(x.to(tl.float32) / scale[:, None], -MAXV), MAXV)
        bits = fp8_bits(v, v, MBITS, BIAS, False, NATIVE)
        tl.store(data_ptr + rows[:, None] * stride_out + cols[None, :], bits.to(tl.uint8), mask=m)


@triton.jit
def _col_amax_kernel(x_ptr, amax_ptr, R, C, stride_r, stride_c, BR: tl.constexpr, BC: tl.constexpr):
    """Column maxima of |x| into int32 ``amax_ptr`` [C] (fp32 bits: integer order = float order)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0)
    a = tl.max(tl.abs(x.to(tl.float32)), axis=0)
    tl.atomic_max(amax_ptr + cols, a.to(tl.int32, bitcast=True), mask=cols < C)


@triton.jit
def _col_quant_t_kernel(
    x_ptr, amax_ptr, data_ptr, scale_ptr, R, C, stride_r, stride_c, stride_out,
    BR: tl.constexpr, BC: tl.constexpr,
    MBITS: tl.constexpr, BIAS: tl.constexpr, MAXV: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    """Tile of x [R, C] quantized per column and stored transposed: data [C, R] (rows ``stride_out >= R``
    bytes apart), scale [C]."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0)
    amax = tl.load(amax_ptr + cols, mask=cols < C, other=0).to(tl.float32, bitcast=True)
    scale = tl.maximum(amax, _AMAX_EPS) / MAXV
    if tl.program_id(0) == 0:
        tl.store(scale_ptr + cols, scale, mask=cols < C)
    v = tl.minimum(tl.maximum(x.to(tl.float32) / scale[None, :], -MAXV), MAXV)
    bits = fp8_bits(v, v, MBITS, BIAS, False, NATIVE)
    tl.store(data_ptr + cols[None, :] * stride_out + rows[:, None], bits.to(tl.uint8), mask=m)


def quantize_rowwise_triton(
    x: torch.Tensor, fmt: ElemFormat, *, transpose: bool, k_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 quantization of ``x [R, C]`` (or of ``x.T`` with ``transpose``) on the GPU.

    Returns ``(data contiguous fmt.dtype, scale [rows, 1] fp32)``; the data's last dimension (the K of the
    GEMM it feeds) is zero-padded to a multiple of ``k_multiple``. See
    :func:`gem_precision.rowwise.quantize_rowwise`.
    """
    r, c = x.shape
    interp = interpreting()
    meta = dict(MBITS=fmt.mbits, BIAS=fmt.bias, MAXV=fmt.max_value, NATIVE=NATIVE_FP8_CAST)
    rows, cols = (c, r) if transpose else (r, c)
    cols_out = -(-cols // k_multiple) * k_multiple
    # Only the padding needs zeros: the kernels write every other byte.
    data = torch.empty((rows, cols_out), dtype=torch.uint8, device=x.device)
    if cols_out != cols:
        data[:, cols:].zero_()
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if not transpose:
        if x.numel():
            br, bc = (16, 64) if interp else (4, 1024)
            _rowwise_kernel[(triton.cdiv(r, br),)](
                x, data, scale, r, c, x.stride(0), x.stride(1), cols_out, BR=br, BC=bc, **meta,
                num_warps=1 if interp else 8,
            )  # fmt: skip
        return data.view(fmt.dtype), scale
    if x.numel():
        amax = torch.zeros((c,), dtype=torch.int32, device=x.device)
        br, bc = (64, 64) if interp else (128, 128)
        grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
        _col_amax_kernel[grid](x, amax, r, c, x.stride(0), x.stride(1), BR=br, BC=bc,
                               num_warps=1 if interp else 8)  # fmt: skip
        _col_quant_t_kernel[grid](x, amax, data, scale, r, c, x.stride(0), x.stride(1), cols_out,
                                  BR=br, BC=bc, **meta, num_warps=1 if interp else 8)  # fmt: skip
    return data.view(fmt.dtype), scale
