"""Triton kernels of row-wise FP8 quantization (the ``fp8_rowwise`` recipe's casts).

Row-wise (``x [R, C]``, one scale per row): :func:`_rowwise_kernel`, one program per few rows.

Column-wise, stored transposed (``x.T``, one scale per column of ``x``: the operands of the weight-gradient
GEMM, whose K is the token axis): two passes over 2-D tiles. Pass 1 (:func:`_tile_amax_kernel`) reads tiles
coalesced along ``x``'s rows and reduces each column's ``|x|`` over a long strip of rows in registers, one
integer ``atomic_max`` per column per strip (a few hundred per column, not one per 128-row tile). Pass 2
(:func:`_tile_quant_kernel`) reads each tile once more (coalesced), quantizes it, transposes it in
registers (``tl.trans``) and stores rows of the transposed data contiguously; it writes the K padding's
zeros itself, so the store mask is constant over 16 bytes (vector stores) when K is padded to 16. With
``ROW=True`` the same pass also writes the row-wise copy of the tile (one read of ``x`` for both copies of the
output gradient, which the backward quantizes along each of its two GEMMs' K).

The previous column kernels (``_col_amax_kernel`` + ``_col_quant_t_kernel``) stay for the benchmark's
old-against-new comparison (``col_impl="legacy"``, or ``COL_IMPL`` for a whole benchmark run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_precision.dispatch import triton_interpreted
from gem_precision.formats import ElemFormat
from gem_precision.fp8_triton import NATIVE_FP8_CAST, scaled_fp8_bits

_AMAX_EPS = tl.constexpr(1e-12)  # as gem_precision.rowwise.reference.AMAX_EPS


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
        bits = scaled_fp8_bits(x.to(tl.float32), scale[:, None], MBITS, BIAS, MAXV, NATIVE)
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
    bits = scaled_fp8_bits(x.to(tl.float32), scale[None, :], MBITS, BIAS, MAXV, NATIVE)
    tl.store(data_ptr + cols[None, :] * stride_out + rows[:, None], bits.to(tl.uint8), mask=m)


@triton.jit
def _abs_bits(x):
    """``|x|`` as int32 fp32 bits: integer order is float order for non-negative floats, NaN above Inf (so a
    column holding a NaN gets a NaN amax, as in the reference's ``amax``)."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _tile_amax_kernel(
    x_ptr, col_amax_ptr, row_amax_ptr, R, C, stride_r, stride_c,
    STRIP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    """Pass 1 over ``x [R, C]``: program (i, j) reduces rows [i*STRIP, (i+1)*STRIP) of columns
    [j*BC, (j+1)*BC) in tiles of [BR, BC]; ``atomic_max`` of the fp32 bits of each column's ``|x|`` into
    ``col_amax_ptr`` [C] (int32, zeroed) and, with ROW, of each row's over these columns into
    ``row_amax_ptr`` [R]."""
    r0 = tl.program_id(0) * STRIP
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    cmax = tl.zeros((BC,), dtype=tl.int32)
    for i in range(0, STRIP, BR):
        rows = r0 + i + tl.arange(0, BR)
        rmask = rows < R
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0)
        a = _abs_bits(x)
        cmax = tl.maximum(cmax, tl.max(a, axis=0))
        if ROW:
            tl.atomic_max(row_amax_ptr + rows, tl.max(a, axis=1), mask=rmask)
    tl.atomic_max(col_amax_ptr + cols, cmax, mask=cmask)


@triton.jit
def _scale_of(amax_bits, MAXV: tl.constexpr):
    """fp32 scale ``max(amax, eps) / MAXV`` of amax bits (a NaN amax stays NaN: ``where``, not maxnum)."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    return tl.where(amax < _AMAX_EPS, _AMAX_EPS, amax) / MAXV


@triton.jit
def _tile_quant_kernel(
    x_ptr, col_amax_ptr, colt_ptr, col_scale_ptr, row_amax_ptr, row_ptr, row_scale_ptr,
    R, C, stride_r, stride_c, R_OUT, C_OUT,
    BR: tl.constexpr, BC: tl.constexpr,
    MBITS: tl.constexpr, BIAS: tl.constexpr, MAXV: tl.constexpr,
    ROW: tl.constexpr, RMBITS: tl.constexpr, RBIAS: tl.constexpr, RMAXV: tl.constexpr,
    NATIVE: tl.constexpr,
):  # fmt: skip
    """Pass 2: tile [BR, BC] of ``x [R, C]`` (coalesced load) quantized per column and stored transposed
    into ``colt [C, R_OUT]`` (``R_OUT >= R``: the K padding, written as zeros here), scales ``[C]``; with
    ROW also per row into ``row [R, C_OUT]`` (``C_OUT >= C``), scales ``[R]``. The grid covers
    ``[max(R, R_OUT), max(C, C_OUT)]``."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    rmask = rows < R
    cmask = cols < C
    inb = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=inb, other=0.0)
    x = x.to(tl.float32)
    cscale = _scale_of(tl.load(col_amax_ptr + cols, mask=cmask, other=0), MAXV)
    if pid_r == 0:
        tl.store(col_scale_ptr + cols, cscale, mask=cmask)
    # Padding bytes are zeros whatever the scale (a NaN scale would make 0 / scale NaN).
    bits = tl.where(inb, scaled_fp8_bits(x, cscale[None, :], MBITS, BIAS, MAXV, NATIVE), 0).to(tl.uint8)
    bt = tl.trans(bits)  # [BC, BR]: rows of the transposed output are contiguous in registers' order
    tmask = cmask[:, None] & (rows[None, :] < R_OUT)
    tl.store(colt_ptr + cols[:, None] * R_OUT + rows[None, :], bt, mask=tmask)
    if ROW:
        rscale = _scale_of(tl.load(row_amax_ptr + rows, mask=rmask, other=0), RMAXV)
        if pid_c == 0:
            tl.store(row_scale_ptr + rows, rscale, mask=rmask)
        rbits = scaled_fp8_bits(x, rscale[:, None], RMBITS, RBIAS, RMAXV, NATIVE)
        rbits = tl.where(inb, rbits, 0).to(tl.uint8)
        tl.store(
            row_ptr + rows[:, None] * C_OUT + cols[None, :],
            rbits,
            mask=rmask[:, None] & (cols[None, :] < C_OUT),
        )


# "tiled": the two-pass tile kernels above; "legacy": _col_amax_kernel + _col_quant_t_kernel. The default
# of quantize_rowwise_triton's col_impl: a benchmark setting (bench_fp8_quant.py times the layer with each).
COL_IMPL = "tiled"
# GPU tiles: pass 1 strips of STRIP rows in [BR, BC] tiles; pass 2 tiles [BR, BC] (BR bytes per row of the
# transposed output: 128 = a full cache line per stored row segment).
AMAX_TILE = (1024, 32, 128, 4)  # STRIP, BR, BC, num_warps
QUANT_TILE = (128, 64, 4)  # BR, BC, num_warps
_INTERP_AMAX_TILE = (64, 16, 32, 1)
_INTERP_QUANT_TILE = (32, 16, 1)


def _pad(n: int, k_multiple: int) -> int:
    return -(-n // k_multiple) * k_multiple


def _eps_scale(n: int, fmt: ElemFormat, device: torch.device) -> torch.Tensor:
    """The scales of ``n`` empty rows, as the reference gives them (``eps / max``)."""
    return torch.full((n, 1), 1e-12, dtype=torch.float32, device=device) / fmt.max_value


def quantize_tiles_triton(
    x: torch.Tensor,
    col_fmt: ElemFormat,
    *,
    col_k_multiple: int = 1,
    row_fmt: ElemFormat | None = None,
    row_k_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Column-wise FP8 quantization of ``x [R, C]`` stored transposed, and optionally the row-wise copy in the
    same pass (two reads of ``x`` in all: amax, then both quantizations).

    Returns:
        ``(colt [C, R'] col_fmt, col_scale [C, 1] fp32, row [R, C''] row_fmt, row_scale [R, 1])`` (the
        last two None without ``row_fmt``)
        with ``R'`` = R rounded up to ``col_k_multiple`` and ``C''`` = C rounded up to ``row_k_multiple``
        (zero bytes); each copy equals :func:`gem_precision.rowwise.quantize_rowwise` of ``x.T`` / ``x``.
    """
    r, c = x.shape
    dev = x.device
    r_out, c_out = _pad(r, col_k_multiple), _pad(c, row_k_multiple)
    colt = torch.empty((c, r_out), dtype=torch.uint8, device=dev)
    want_row = row_fmt is not None
    row = torch.empty((r, c_out), dtype=torch.uint8, device=dev) if want_row else None
    if x.numel() == 0:  # nothing to read: zero bytes (padding only) and the scales of empty rows
        colt.zero_()
        if row is not None and row_fmt is not None:
            return colt.view(col_fmt.dtype), _eps_scale(c, col_fmt, dev), row.zero_().view(row_fmt.dtype), \
                _eps_scale(r, row_fmt, dev)  # fmt: skip
        return colt.view(col_fmt.dtype), _eps_scale(c, col_fmt, dev), None, None
    interp = triton_interpreted()
    strip, abr, abc, awarps = _INTERP_AMAX_TILE if interp else AMAX_TILE
    qbr, qbc, qwarps = _INTERP_QUANT_TILE if interp else QUANT_TILE
    col_amax = torch.zeros((c,), dtype=torch.int32, device=dev)
    row_amax = torch.zeros((r,), dtype=torch.int32, device=dev) if want_row else col_amax
    _tile_amax_kernel[(triton.cdiv(r, strip), triton.cdiv(c, abc))](
        x, col_amax, row_amax, r, c, x.stride(0), x.stride(1),
        STRIP=strip, BR=abr, BC=abc, ROW=want_row, num_warps=awarps,
    )  # fmt: skip
    col_scale = torch.empty((c, 1), dtype=torch.float32, device=dev)
    row_scale = torch.empty((r, 1), dtype=torch.float32, device=dev) if want_row else col_scale
    rf = row_fmt or col_fmt
    grid = (triton.cdiv(max(r, r_out), qbr), triton.cdiv(max(c, c_out if want_row else c), qbc))
    _tile_quant_kernel[grid](
        x, col_amax, colt, col_scale, row_amax, row if row is not None else colt, row_scale,
        r, c, x.stride(0), x.stride(1), r_out, c_out,
        BR=qbr, BC=qbc, MBITS=col_fmt.mbits, BIAS=col_fmt.bias, MAXV=col_fmt.max_value,
        ROW=want_row, RMBITS=rf.mbits, RBIAS=rf.bias, RMAXV=rf.max_value,
        NATIVE=NATIVE_FP8_CAST, num_warps=qwarps,
    )  # fmt: skip
    if row is None or row_fmt is None:
        return colt.view(col_fmt.dtype), col_scale, None, None
    return colt.view(col_fmt.dtype), col_scale, row.view(row_fmt.dtype), row_scale


def _legacy_col_quant(x: torch.Tensor, fmt: ElemFormat, k_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = x.shape
    interp = triton_interpreted()
    meta = dict(MBITS=fmt.mbits, BIAS=fmt.bias, MAXV=fmt.max_value, NATIVE=NATIVE_FP8_CAST)
    cols_out = _pad(r, k_multiple)
    data = torch.empty((c, cols_out), dtype=torch.uint8, device=x.device)
    if cols_out != r:
        data[:, r:].zero_()
    scale = torch.empty((c, 1), dtype=torch.float32, device=x.device)
    if x.numel():
        amax = torch.zeros((c,), dtype=torch.int32, device=x.device)
        br, bc = (64, 64) if interp else (128, 128)
        grid = (triton.cdiv(r, br), triton.cdiv(c, bc))
        _col_amax_kernel[grid](x, amax, r, c, x.stride(0), x.stride(1), BR=br, BC=bc,
                               num_warps=1 if interp else 8)  # fmt: skip
        _col_quant_t_kernel[grid](x, amax, data, scale, r, c, x.stride(0), x.stride(1), cols_out,
                                  BR=br, BC=bc, **meta, num_warps=1 if interp else 8)  # fmt: skip
    return data.view(fmt.dtype), scale


def quantize_rowwise_triton(
    x: torch.Tensor, fmt: ElemFormat, *, transpose: bool, k_multiple: int = 1, col_impl: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 quantization of ``x [R, C]`` (or of ``x.T`` with ``transpose``) on the GPU.

    Returns ``(data contiguous fmt.dtype, scale [rows, 1] fp32)``; the data's last dimension (the K of the
    GEMM it feeds) is zero-padded to a multiple of ``k_multiple``. ``col_impl``: the column kernels of
    ``transpose`` (``"tiled"`` or ``"legacy"``; default :data:`COL_IMPL`). See
    :func:`gem_precision.rowwise.quantize_rowwise`.
    """
    if transpose:
        if (col_impl or COL_IMPL) == "legacy":
            return _legacy_col_quant(x, fmt, k_multiple)
        colt, scale, _, _ = quantize_tiles_triton(x, fmt, col_k_multiple=k_multiple)
        return colt, scale
    r, c = x.shape
    interp = triton_interpreted()
    meta = dict(MBITS=fmt.mbits, BIAS=fmt.bias, MAXV=fmt.max_value, NATIVE=NATIVE_FP8_CAST)
    cols_out = _pad(c, k_multiple)
    # Only the padding needs zeros: the kernel writes every other byte.
    data = torch.empty((r, cols_out), dtype=torch.uint8, device=x.device)
    if cols_out != c:
        data[:, c:].zero_()
    scale = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    if x.numel():
        br, bc = (16, 64) if interp else (4, 1024)
        _rowwise_kernel[(triton.cdiv(r, br),)](
            x, data, scale, r, c, x.stride(0), x.stride(1), cols_out, BR=br, BC=bc, **meta,
            num_warps=1 if interp else 8,
        )  # fmt: skip
    elif c == 0:
        scale = _eps_scale(r, fmt, x.device)
    return data.view(fmt.dtype), scale
