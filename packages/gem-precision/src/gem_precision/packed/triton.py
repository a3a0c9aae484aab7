"""Triton kernels of packed 8-bit rows (:mod:`.reference` describes the layout): one launch quantizes any
number of weight shards (an FSDP unit's whole all-gather round) into their ``uint8 [R, K + s]`` rows, one
launch turns gathered rows back into a weight.

- The pack kernels read a launch table (:func:`_launch_tables`): each program finds its shard and its ``BR``
  rows there (:func:`_shard_rows`). Shards are addressed by their element offset from the first shard, so
  one launch covers tensors anywhere in memory with their own shapes and strides; the packed rows of all
  shards are one buffer. One launch per round, not per weight: at a GEM trunk's shapes a launch's host cost
  (~28 us each on an H100) was the whole of the per-weight time.
- :func:`_pack_rowwise_kernel` ("fp8"): pass 1 finds each row's maximum, pass 2 re-reads the rows (from L2),
  writes the E4M3 bytes and the row's 4 scale bytes. The element rule is the row-wise quantizer's
  (:func:`gem_precision.fp8_triton.scaled_fp8_bits`), so the bytes are the same.
- :func:`_pack_mx_kernel` ("mxfp8"): a ``[BR, BC]`` tile at a time (``BC`` a multiple of 32), each
  32-element block quantized with :func:`gem_precision.fp8_triton.mx_block_quantize` (the MX quantizer's
  block rule), element bytes and the tile's scale bytes written.
- :func:`_unpack_kernel`: element bytes times their scale (read from the row's tail), cast once to the
  output dtype, written with the output's strides (FSDP2's unsharded parameter buffer, in place).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from gem_precision.dispatch import triton_interpreted
from gem_precision.formats import E4M3
from gem_precision.fp8_triton import NATIVE_FP8_CAST, e8m0_to_f32, mx_block_quantize, scaled_fp8_bits

_AMAX_EPS = tl.constexpr(1e-12)  # as gem_precision.rowwise.reference.AMAX_EPS


@triton.jit
def _shard_rows(x0_ptr, out_ptr, meta_ptr, prog_ptr, BR: tl.constexpr):
    """This program's shard and rows: ``meta [n, 8]`` int64 rows ``(x offset in elements from x0, out offset
    in bytes, R, K, stride_r, stride_c, W, first program)``, ``prog [P]`` int32 the shard of each program."""
    pid = tl.program_id(0)
    meta = meta_ptr + tl.load(prog_ptr + pid).to(tl.int64) * 8
    r = tl.load(meta + 2)
    rows = (pid - tl.load(meta + 7)) * BR + tl.arange(0, BR)
    rmask = rows < r
    xrow = x0_ptr + tl.load(meta) + rows.to(tl.int64) * tl.load(meta + 4)
    orow = out_ptr + tl.load(meta + 1) + rows.to(tl.int64) * tl.load(meta + 6)
    return xrow, orow, rmask, tl.load(meta + 3), tl.load(meta + 5)


@triton.jit
def _pack_rowwise_kernel(
    x0_ptr, out_ptr, meta_ptr, prog_ptr,
    BR: tl.constexpr, BC: tl.constexpr,
    MBITS: tl.constexpr, BIAS: tl.constexpr, MAXV: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    """``BR`` rows of one shard ``[R, K]`` -> its packed rows of ``W = K + 4`` bytes: E4M3 bytes, then the
    fp32 scale ``max(amax, eps) / MAXV`` as 4 little-endian bytes. Pass 1 finds each row's maximum, pass 2
    re-reads the rows (from L2) and writes the bytes."""
    xrow, orow, rmask, K, stride_c = _shard_rows(x0_ptr, out_ptr, meta_ptr, prog_ptr, BR)
    amax = tl.zeros((BR,), dtype=tl.float32)
    for c0 in range(0, K, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(xrow[:, None] + cols[None, :] * stride_c, mask=m, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    scale = tl.maximum(amax, _AMAX_EPS) / MAXV
    for c0 in range(0, K, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(xrow[:, None] + cols[None, :] * stride_c, mask=m, other=0.0)
        bits = scaled_fp8_bits(x.to(tl.float32), scale[:, None], MBITS, BIAS, MAXV, NATIVE)
        tl.store(orow[:, None] + cols[None, :], bits.to(tl.uint8), mask=m)
    sbits = scale.to(tl.int32, bitcast=True)
    j = tl.arange(0, 4)
    sbytes = (sbits[:, None] >> (j * 8)[None, :]) & 0xFF
    tl.store(orow[:, None] + K + j[None, :], sbytes.to(tl.uint8), mask=rmask[:, None])


@triton.jit
def _pack_mx_kernel(
    x0_ptr, out_ptr, meta_ptr, prog_ptr,
    BR: tl.constexpr, BC: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAXV: tl.constexpr, NANB: tl.constexpr,
    NATIVE: tl.constexpr,
):  # fmt: skip
    """``BR`` rows of one shard ``[R, K]`` -> its packed rows of ``W = K + ceil(K / 32)`` bytes, a
    ``[BR, BC]`` tile at a time (``BC`` a multiple of 32): E4M3 bytes at columns ``[0, K)``, the E8M0
    ("rceil") scale of block ``b`` at column ``K + b``."""
    NB: tl.constexpr = BC // 32
    xrow, orow, rmask, K, stride_c = _shard_rows(x0_ptr, out_ptr, meta_ptr, prog_ptr, BR)
    for c0 in range(0, K, BC):
        cols = c0 + tl.arange(0, BC)
        m = rmask[:, None] & (cols[None, :] < K)
        # Zeros outside the tensor leave block maxima unchanged (a partial block is a zero-padded one).
        x = tl.load(xrow[:, None] + cols[None, :] * stride_c, mask=m, other=0.0).to(tl.float32)
        a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x| bits: integer order = float order, NaN largest
        a3 = tl.reshape(a, (BR, NB, 32))
        amax = tl.expand_dims(tl.max(a3, axis=2), 2)
        bits, scale = mx_block_quantize(
            tl.reshape(x, (BR, NB, 32)), amax, amax >= 0x7F800000, a3,
            EMAX, MBITS, BIAS, MAXV, NANB, True, False, NATIVE,
        )  # fmt: skip
        tl.store(orow[:, None] + cols[None, :], tl.reshape(bits, (BR, BC)).to(tl.uint8), mask=m)
        blk = c0 // 32 + tl.arange(0, NB)
        smask = rmask[:, None] & (blk[None, :] < tl.cdiv(K, 32))
        tl.store(orow[:, None] + K + blk[None, :], tl.reshape(scale, (BR, NB)).to(tl.uint8), mask=smask)


@triton.jit
def _bf16_rne(v):
    """bf16 of fp32 ``v`` rounded to nearest-even with integer operations (finite ``v``): the interpreter's
    fp32 -> bf16 cast truncates."""
    b = v.to(tl.int32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _unpack_kernel(
    p_ptr, o_ptr, R, K, W, stride_or, stride_oc,
    MX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BF16_BITS: tl.constexpr,
):  # fmt: skip
    """``out [R, K]`` (any strides, its own dtype) = E4M3 bytes of packed rows ``[R, W]`` times their scale:
    the row's fp32 (4 bytes at column K) or the block's E8M0 byte (column ``K + c // 32``) with MX."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rows < R
    m = rmask[:, None] & (cols[None, :] < K)
    prow = p_ptr + rows.to(tl.int64) * W
    d = tl.load(prow[:, None] + cols[None, :], mask=m, other=0)
    v = d.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if MX:
        s = tl.load(prow[:, None] + K + (cols // 32)[None, :], mask=m, other=127)
        out = v * e8m0_to_f32(s.to(tl.int32))
    else:
        b0 = tl.load(prow + K, mask=rmask, other=0).to(tl.int32)
        b1 = tl.load(prow + K + 1, mask=rmask, other=0).to(tl.int32)
        b2 = tl.load(prow + K + 2, mask=rmask, other=0).to(tl.int32)
        b3 = tl.load(prow + K + 3, mask=rmask, other=0).to(tl.int32)
        scale = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
        out = v * scale[:, None]
    optr = o_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :] * stride_oc
    if BF16_BITS:
        tl.store(optr, _bf16_rne(out), mask=m)
    else:
        tl.store(optr, out.to(o_ptr.dtype.element_ty), mask=m)


# GPU launch settings (rows per program and column chunk of the packs; tile of the unpack; num_warps). The
# weights of a GEM trunk have K of 512-4096: one or a few column chunks per row.
PACK_ROWWISE = (4, 1024, 8)  # BR, BC, num_warps
PACK_MX = (16, 128, 4)
UNPACK = (32, 256, 4)
_INTERP = (16, 64, 1)

# Device tables of launches already made, by the shards' addresses, shapes and strides (which fully determine
# them) and the stream (a table is copied, read and, once evicted, freed on one stream, as the caching
# allocator expects): an FSDP round quantizes the same shards every step, so its tables are built once.
_TABLES: OrderedDict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()
_TABLES_KEPT = 256


def _launch_tables(
    xs: Sequence[torch.Tensor], widths: Sequence[int], br: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(meta int64 [n, 8], prog int32 [P], P)`` on the shards' device (see :func:`_shard_rows`)."""
    x0 = xs[0]
    stream = torch.cuda.current_stream(x0.device).cuda_stream if x0.is_cuda else 0
    key = (
        x0.device, x0.dtype, stream, br,
        *((x.data_ptr(), *x.shape, *x.stride(), w) for x, w in zip(xs, widths)),
    )  # fmt: skip
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    size, base = x0.element_size(), x0.data_ptr()
    rows, counts, out_off, first = [], [], 0, 0
    for x, w in zip(xs, widths):
        r, k = x.shape
        gap = x.data_ptr() - base
        if gap % size:  # pragma: no cover - torch's allocations and views are element-aligned
            raise ValueError("quantize_packed_many: a shard's address is not element-aligned to the first's")
        programs = -(-r // br)
        rows.append([gap // size, out_off, r, k, x.stride(0), x.stride(1), w, first])
        counts.append(programs)
        out_off += r * w
        first += programs
    meta = torch.tensor(rows, dtype=torch.int64).to(x0.device)
    shard_of = torch.repeat_interleave(torch.arange(len(xs), dtype=torch.int32), torch.tensor(counts))
    prog = shard_of.to(x0.device)
    _TABLES[key] = entry = (meta, prog, first)
    if len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return entry


def quantize_packed_many_triton(
    xs: Sequence[torch.Tensor], fmt: str, widths: Sequence[int]
) -> list[torch.Tensor]:
    """Packed rows ``uint8 [R_i, widths[i]]`` of every shard ``xs[i] [R_i, K_i]`` (any strides; one dtype and
    device for all) in one launch; the results are contiguous views of one buffer."""
    sizes = [x.shape[0] * w for x, w in zip(xs, widths)]
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=xs[0].device)
    views = [part.view(x.shape[0], w) for part, x, w in zip(torch.split(out, sizes), xs, widths)]
    interp = triton_interpreted()
    br, bc, warps = _INTERP if interp else (PACK_ROWWISE if fmt == "fp8" else PACK_MX)
    meta, prog, programs = _launch_tables(xs, widths, br)
    if programs == 0:
        return views
    if fmt == "fp8":
        _pack_rowwise_kernel[(programs,)](
            xs[0], out, meta, prog, BR=br, BC=bc,
            MBITS=E4M3.mbits, BIAS=E4M3.bias, MAXV=E4M3.max_value, NATIVE=NATIVE_FP8_CAST, num_warps=warps,
        )  # fmt: skip
    else:
        _pack_mx_kernel[(programs,)](
            xs[0], out, meta, prog, BR=br, BC=bc,
            EMAX=E4M3.emax, MBITS=E4M3.mbits, BIAS=E4M3.bias, MAXV=E4M3.max_value, NANB=E4M3.nan_bits,
            NATIVE=NATIVE_FP8_CAST, num_warps=warps,
        )  # fmt: skip
    return views


def quantize_packed_triton(x: torch.Tensor, fmt: str, width: int) -> torch.Tensor:
    """Packed rows ``uint8 [R, width]`` of ``x [R, K]`` (any strides; fp32/bf16/fp16) in one launch."""
    return quantize_packed_many_triton([x], fmt, [width])[0]


def dequantize_packed_triton(packed: torch.Tensor, k: int, fmt: str, out: torch.Tensor) -> torch.Tensor:
    """Writes the weight of packed rows ``packed [R, W]`` (contiguous) into ``out [R, k]``; returns it."""
    r = packed.shape[0]
    if r == 0 or k == 0:
        return out
    br, bc, warps = _INTERP if triton_interpreted() else UNPACK
    _unpack_kernel[(triton.cdiv(r, br), triton.cdiv(k, bc))](
        packed, out, r, k, packed.shape[1], out.stride(0), out.stride(1),
        MX=fmt == "mxfp8", BR=br, BC=bc, BF16_BITS=out.dtype == torch.bfloat16 and not NATIVE_FP8_CAST,
        num_warps=warps,
    )  # fmt: skip
    return out
