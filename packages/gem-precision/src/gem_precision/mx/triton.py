"""Triton kernels of MX quantization (``to_mx``) and the exact block-scaled GEMM (``mx_mm``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from gem_precision.dispatch import triton_interpreted
from gem_precision.formats import ElemFormat
from gem_precision.fp8_triton import NATIVE_FP8_CAST, e8m0_to_f32, mx_block_quantize
from gem_precision.mx import reference as mx_reference

if TYPE_CHECKING:  # only the type: importing mx.tensor here at run time would make a cycle with it
    from gem_precision.mx.tensor import MXTensor

# Block layouts of the quantization kernel.
_ALONG_COLS, _ALONG_ROWS, _SQUARE = 0, 1, 2


@triton.jit
def _to_mx_kernel(
    x_ptr, q_ptr, data_ptr, scale_ptr,
    R, C, stride_xr, stride_xc, stride_sr, stride_sc, seed,
    LAYOUT: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAXV: tl.constexpr, NANB: tl.constexpr,
    RCEIL: tl.constexpr, STOCHASTIC: tl.constexpr, HADAMARD: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    """One [BR, BC] tile of x [R, C] -> FP8 bits data [R, C] (row-major) and E8M0 scales.

    LAYOUT 0: blocks of BLOCK along columns, scale [R, cdiv(C, BLOCK)]; 1: along rows, scale
    [cdiv(R, BLOCK), C]; 2: BLOCK x BLOCK tiles, scale [cdiv(R, BLOCK), cdiv(C, BLOCK)].
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    # Zeros outside the tensor leave block maxima unchanged (a partial block is a zero-padded one).
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HADAMARD:
        # q: [BLOCK, BLOCK] fp32. Along columns a row block v becomes v @ q; along rows a column block
        # c becomes q.T @ c (the same map on the vector along the blocked axis).
        qi = tl.arange(0, BLOCK)
        if LAYOUT == 0:
            q = tl.load(q_ptr + qi[:, None] * BLOCK + qi[None, :])
            x = tl.dot(x, q, input_precision="ieee")
        else:
            qt = tl.load(q_ptr + qi[None, :] * BLOCK + qi[:, None])
            x = tl.dot(qt, x, input_precision="ieee")
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x| bits: integer order = float order, NaN largest
    if STOCHASTIC:
        r = tl.randint(seed, rows[:, None] * C + cols[None, :])
    else:
        r = a  # unused
    if LAYOUT == 0:
        NB: tl.constexpr = BC // BLOCK
        a3 = tl.reshape(a, (BR, NB, BLOCK))
        amax = tl.expand_dims(tl.max(a3, axis=2), 2)
        bits, scale = mx_block_quantize(
            tl.reshape(x, (BR, NB, BLOCK)), amax, amax >= 0x7F800000, tl.reshape(r, (BR, NB, BLOCK)),
            EMAX, MBITS, BIAS, MAXV, NANB, RCEIL, STOCHASTIC, NATIVE,
        )  # fmt: skip
        bits = tl.reshape(bits, (BR, BC))
        sr = rows
        sc = pid_c * NB + tl.arange(0, NB)
        smask = (sr[:, None] < R) & (sc[None, :] < tl.cdiv(C, BLOCK))
        tl.store(
            scale_ptr + sr[:, None] * stride_sr + sc[None, :] * stride_sc,
            tl.reshape(scale, (BR, NB)).to(tl.uint8),
            mask=smask,
        )
    elif LAYOUT == 1:
        NB: tl.constexpr = BR // BLOCK  # type: ignore[no-redef]  # one Triton constexpr per layout branch
        a3 = tl.reshape(a, (NB, BLOCK, BC))
        amax = tl.expand_dims(tl.max(a3, axis=1), 1)
        bits, scale = mx_block_quantize(
            tl.reshape(x, (NB, BLOCK, BC)), amax, amax >= 0x7F800000, tl.reshape(r, (NB, BLOCK, BC)),
            EMAX, MBITS, BIAS, MAXV, NANB, RCEIL, STOCHASTIC, NATIVE,
        )  # fmt: skip
        bits = tl.reshape(bits, (BR, BC))
        sr = pid_r * NB + tl.arange(0, NB)
        sc = cols
        smask = (sr[:, None] < tl.cdiv(R, BLOCK)) & (sc[None, :] < C)
        tl.store(
            scale_ptr + sr[:, None] * stride_sr + sc[None, :] * stride_sc,
            tl.reshape(scale, (NB, BC)).to(tl.uint8),
            mask=smask,
        )
    else:
        NBR: tl.constexpr = BR // BLOCK
        NBC: tl.constexpr = BC // BLOCK
        a4 = tl.reshape(a, (NBR, BLOCK, NBC, BLOCK))
        amax = tl.max(tl.max(a4, axis=3), axis=1)
        amax = tl.expand_dims(tl.expand_dims(amax, 2), 1)
        bits, scale = mx_block_quantize(
            tl.reshape(x, (NBR, BLOCK, NBC, BLOCK)), amax, amax >= 0x7F800000,
            tl.reshape(r, (NBR, BLOCK, NBC, BLOCK)), EMAX, MBITS, BIAS, MAXV, NANB, RCEIL, STOCHASTIC, NATIVE,
        )  # fmt: skip
        bits = tl.reshape(bits, (BR, BC))
        sr = pid_r * NBR + tl.arange(0, NBR)
        sc = pid_c * NBC + tl.arange(0, NBC)
        smask = (sr[:, None] < tl.cdiv(R, BLOCK)) & (sc[None, :] < tl.cdiv(C, BLOCK))
        tl.store(
            scale_ptr + sr[:, None] * stride_sr + sc[None, :] * stride_sc,
            tl.reshape(scale, (NBR, NBC)).to(tl.uint8),
            mask=smask,
        )
    tl.store(data_ptr + rows[:, None] * C + cols[None, :], bits.to(tl.uint8), mask=mask)


# Tile (BR, BC, num_warps) per layout; the benchmark may override these after measuring.
TILES: dict[int, tuple[int, int, int]] = {
    _ALONG_COLS: (32, 128, 4),
    _ALONG_ROWS: (64, 64, 4),
    _SQUARE: (64, 64, 4),
}


def _tile(layout: int, block: int, hadamard: bool) -> tuple[int, int, int]:
    """(BR, BC, num_warps) of the quantization kernel: the blocked side a multiple of ``block``; with
    the Hadamard transform exactly ``block`` (one tl.dot with the [block, block] matrix per tile)."""
    # Under the interpreter: few large programs (each launch step costs milliseconds).
    br, bc, warps = (64, 64, 1) if triton_interpreted() else TILES[layout]
    if layout == _ALONG_COLS:
        return (max(br, 16), block, warps) if hadamard else (br, max(bc, block) // block * block, warps)
    if layout == _ALONG_ROWS:
        return (block, max(bc, 16), warps) if hadamard else (max(br, block) // block * block, bc, warps)
    return (max(br, block) // block * block, max(bc, block) // block * block, warps)


def _to_mx_2d(
    x: torch.Tensor, layout: int, block: int, fmt: ElemFormat, scale_mode: str, seed: int | None,
    hadamard: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    r, c = x.shape
    data = torch.empty((r, c), dtype=torch.uint8, device=x.device)
    nbr, nbc = triton.cdiv(r, block), triton.cdiv(c, block)
    sshape = {_ALONG_COLS: (r, nbc), _ALONG_ROWS: (nbr, c), _SQUARE: (nbr, nbc)}[layout]
    scale = torch.empty(sshape, dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return data.view(fmt.dtype), scale
    br, bc, warps = _tile(layout, block, hadamard is not None)
    grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
    _to_mx_kernel[grid](
        x, hadamard if hadamard is not None else x, data, scale,
        r, c, x.stride(0), x.stride(1), scale.stride(0), scale.stride(1), seed or 0,
        LAYOUT=layout, BLOCK=block, BR=br, BC=bc,
        EMAX=fmt.emax, MBITS=fmt.mbits, BIAS=fmt.bias, MAXV=fmt.max_value, NANB=fmt.nan_bits,
        RCEIL=scale_mode == "rceil", STOCHASTIC=seed is not None, HADAMARD=hadamard is not None,
        NATIVE=NATIVE_FP8_CAST,
        num_warps=warps,
    )  # fmt: skip
    return data.view(fmt.dtype), scale


def to_mx_triton(
    x: torch.Tensor,
    *,
    axis: int,
    block_size: int,
    fmt: ElemFormat,
    scale_mode: str,
    seed: int | None,
    square: bool,
    hadamard: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``to_mx`` (arguments validated by :func:`gem_precision.to_mx`); same results as the
    reference, bit for bit with ``"nearest"`` rounding and no Hadamard transform."""
    nd = x.dim()
    if square:
        if nd == 2:
            return _to_mx_2d(x, _SQUARE, block_size, fmt, scale_mode, seed, None)
        lead = x.shape[:-2]
        if math.prod(lead) == 0:
            return mx_reference.to_mx_reference(
                x,
                axis=axis,
                block_size=block_size,
                fmt=fmt,
                scale_mode=scale_mode,
                rounding="nearest",
                square=True,
            )  # nothing to compute: the reference gives the empty shapes
        flat = x.reshape(-1, *x.shape[-2:])
        outs = [_to_mx_2d(t, _SQUARE, block_size, fmt, scale_mode, seed, None) for t in flat]
        data = torch.stack([o[0].view(torch.uint8) for o in outs]).reshape(x.shape).view(fmt.dtype)
        scale = torch.stack([o[1] for o in outs]).reshape(*lead, *outs[0][1].shape)
        return data, scale
    if nd == 2 and axis == 0:
        return _to_mx_2d(x, _ALONG_ROWS, block_size, fmt, scale_mode, seed, hadamard)
    # Everything else is blocked along the last dim of a (possibly moved) 2-D view.
    xt = x.movedim(axis, -1)
    x2 = xt.reshape(math.prod(xt.shape[:-1]), xt.shape[-1])
    data, scale = _to_mx_2d(x2, _ALONG_COLS, block_size, fmt, scale_mode, seed, hadamard)
    data = data.view(torch.uint8).reshape(xt.shape).movedim(-1, axis).contiguous().view(fmt.dtype)
    scale = scale.reshape(*xt.shape[:-1], scale.shape[-1]).movedim(-1, axis).contiguous()
    return data, scale


@triton.jit
def _mx_mm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    stride_asm, stride_ask, stride_bsk, stride_bsn, stride_cm, stride_cn,
    A_SQ: tl.constexpr, B_SQ: tl.constexpr, BLOCK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, BF16_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """C [M, N] = (A * sa) @ (B * sb): A [M, K] FP8 blocked along K, B [K, N] FP8 blocked along K.

    Scales: sa[m // (BLOCK if A_SQ else 1), k // BLOCK], sb[k // BLOCK, n // (BLOCK if B_SQ else 1)].
    BF16_DOT=False: one FP8 tl.dot per BLOCK-wide K slice, rescaled into the fp32 accumulator.
    BF16_DOT=True: A and B tiles dequantized in registers to bf16 (exact: 3 or 2 mantissa bits times a
    power of two) and multiplied by one bf16 tl.dot per BK, accumulating in fp32 (DOT_F32: an fp32
    dot instead, for the interpreter).
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # Grouped ordering: GROUP_M row tiles share each B column tile while it is in L2.
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    sm = rm // BLOCK if A_SQ else rm
    sn = rn // BLOCK if B_SQ else rn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    NSUB: tl.constexpr = BK // BLOCK
    for k0 in range(0, K, BK):
        for j in tl.static_range(NSUB):
            rk = k0 + j * BLOCK + tl.arange(0, BLOCK)
            a = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # fmt: skip
            b = tl.load(b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)  # fmt: skip
            kb = (k0 + j * BLOCK) // BLOCK
            kin = k0 + j * BLOCK < K
            sa = tl.load(as_ptr + sm * stride_asm + kb * stride_ask, mask=(rm < M) & kin, other=127)
            sb = tl.load(bs_ptr + kb * stride_bsk + sn * stride_bsn, mask=(rn < N) & kin, other=127)
            if BF16_DOT:
                # One scale per row of the A slice and per column of the B slice: a broadcast multiply.
                a32 = a.to(tl.float32) * e8m0_to_f32(sa.to(tl.int32))[:, None]
                b32 = b.to(tl.float32) * e8m0_to_f32(sb.to(tl.int32))[None, :]
                if DOT_F32:  # the interpreter computes bf16 dots wrongly; fp32 holds the same exact values
                    acc = tl.dot(a32, b32, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a32.to(tl.bfloat16), b32.to(tl.bfloat16), acc)
            else:
                p = tl.dot(a, b)
                acc += p * (e8m0_to_f32(sa.to(tl.int32))[:, None] * e8m0_to_f32(sb.to(tl.int32))[None, :])
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c,
             mask=(rm[:, None] < M) & (rn[None, :] < N))  # fmt: skip


@triton.jit
def _dequant_kernel(
    d_ptr, s_ptr, o_ptr, R, C, stride_dr, stride_dc, stride_sr, stride_sc,
    DR: tl.constexpr, DC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """out [R, C] (row-major) = data * 2**(scale[r // DR, c // DC] - 127), exact in bf16 or fp32."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    d = tl.load(d_ptr + rows[:, None] * stride_dr + cols[None, :] * stride_dc, mask=m, other=0.0)
    s = tl.load(
        s_ptr + (rows // DR)[:, None] * stride_sr + (cols // DC)[None, :] * stride_sc, mask=m, other=127
    )
    out = d.to(tl.float32) * e8m0_to_f32(s.to(tl.int32))
    tl.store(o_ptr + rows[:, None] * C + cols[None, :], out.to(o_ptr.dtype.element_ty), mask=m)


def dequantize_triton(x: MXTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A 2-D MXTensor dequantized (a Hadamard transform not undone) into a row-major ``dtype`` tensor.

    bf16 holds every MX value exactly (3 mantissa bits times a power of two within its exponent range).
    """
    r, c = x.shape
    out = torch.empty((r, c), dtype=dtype, device=x.data.device)
    if out.numel() == 0:
        return out
    dr = x.block_size if (x.square or x.axis == 0) else 1
    dc = x.block_size if (x.square or x.axis == 1) else 1
    br, bc = (32, 64) if triton_interpreted() else (32, 256)
    grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
    _dequant_kernel[grid](
        x.data, x.scale, out, r, c, x.data.stride(0), x.data.stride(1), x.scale.stride(0), x.scale.stride(1),
        DR=dr, DC=dc, BR=br, BC=bc, num_warps=1 if triton_interpreted() else 4,
    )  # fmt: skip
    return out


# Path of mx_mm on GPUs, from the H200 measurements in BENCHMARKS.md: "dequant" (both operands
# dequantized exactly to bf16 by a Triton kernel, then a cuBLAS bf16 GEMM with fp32 accumulation; used for
# bf16 outputs), or the fused Triton kernel. MX_MM_BF16_DOT picks the fused kernel's variant and
# MX_MM_CONFIG its (BM, BN, BK, num_warps, num_stages) (None: the variant's default).
MX_MM_PATH = "dequant"
MX_MM_BF16_DOT = True
MX_MM_CONFIG: tuple[int, int, int, int, int] | None = None


def mx_mm_triton(
    a: MXTensor,
    b: MXTensor,
    *,
    out_dtype: torch.dtype,
    bf16_dot: bool | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """Triton ``mx_mm`` (operands validated by :func:`gem_precision.mx_mm`).

    Args:
        path: ``"dequant"`` or ``"fused"`` (default :data:`MX_MM_PATH`; the dequant path serves bf16
            outputs only).
        bf16_dot: fused-kernel variant (default :data:`MX_MM_BF16_DOT`).
        config: (BM, BN, BK, num_warps, num_stages); default chosen by shape.
    """
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block = a.block_size
    if path is None:
        path = MX_MM_PATH
    if path == "dequant" and out_dtype == torch.bfloat16 and not triton_interpreted():
        # Exact too: bf16 holds the MX values exactly and cuBLAS accumulates in fp32. A Hadamard
        # transform on both operands cancels in the product, as in the fused kernel.
        return torch.mm(dequantize_triton(a), dequantize_triton(b))
    bf16_dot = MX_MM_BF16_DOT if bf16_dot is None else bf16_dot
    if config is None:
        if triton_interpreted():
            config = (32, 32, max(block, 64), 1, 1)
        elif MX_MM_CONFIG is not None:
            config = MX_MM_CONFIG
        else:
            config = (128, 128, 64, 8, 4) if bf16_dot else (128, 128, 64, 4, 4)  # H200 best
    bm, bn, bk, warps, stages = config
    bk = max(bk, block) // block * block
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _mx_mm_kernel[grid](
        a.data, b.data, a.scale, b.scale, out,
        m, n, k,
        a.data.stride(0), a.data.stride(1), b.data.stride(0), b.data.stride(1),
        a.scale.stride(0), a.scale.stride(1), b.scale.stride(0), b.scale.stride(1),
        out.stride(0), out.stride(1),
        A_SQ=a.square, B_SQ=b.square, BLOCK=block, BM=bm, BN=bn, BK=bk, GROUP_M=8, BF16_DOT=bf16_dot,
        DOT_F32=triton_interpreted(),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
