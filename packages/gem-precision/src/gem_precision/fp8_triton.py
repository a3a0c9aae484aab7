"""Triton FP8 casts shared by the MX and row-wise quantization kernels (:mod:`.mx.triton`,
:mod:`.rowwise.triton`): FP8 rounding with integer bit operations or the hardware cast, E8M0 decoding.

Rounding is done on the fp32 bit pattern instead of with Triton's fp32 -> fp8 casts, because the casts
differ between back ends (the interpreter gets some of them wrong) while these give the same bits
everywhere. The algorithm is the one of :func:`gem_precision.mx.reference.round_to_fp8_bits`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gem_precision.dispatch import triton_interpreted


@triton.jit
def fp8_round_bits(v, r, MBITS: tl.constexpr, BIAS: tl.constexpr, STOCHASTIC: tl.constexpr):
    """FP8 bit patterns (int32, 0..255) of fp32 ``v`` (finite, saturated to the format's max).

    ``r``: uint32 random bits per element (used only if STOCHASTIC). Nearest rounds ties to even;
    stochastic rounds up with probability frac(|v| / spacing).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    e_field = a >> 23
    e32 = tl.maximum(e_field, 1)  # fp32 subnormals: exponent 1 with no implicit bit
    mant = (a & 0x7FFFFF) | tl.where(e_field > 0, 0x800000, 0)
    exp = e32 - 127
    qe = tl.maximum(exp, 1 - BIAS) - MBITS  # log2 of the FP8 spacing at |v|
    shift = qe + 150 - e32  # >= 23 - MBITS
    if STOCHASTIC:
        shift_c = tl.minimum(shift, 32).to(tl.int64)
        r64 = r.to(tl.int64) & 0xFFFFFFFF
        k64 = (mant.to(tl.int64) + (r64 & ((tl.full(shift_c.shape, 1, tl.int64) << shift_c) - 1))) >> shift_c
        k = tl.where(shift > 32, 0, k64.to(tl.int32))
    else:
        shift_c = tl.minimum(shift, 25)  # mant < 2**24: any larger shift rounds to 0
        one = tl.full(shift_c.shape, 1, tl.int32)
        k = (mant + (one << (shift_c - 1)) - 1 + ((mant >> shift_c) & 1)) >> shift_c
    enc = (tl.maximum(exp + BIAS - 1, 0) << MBITS) + k
    return (sign << 7) | enc


# On GPUs (sm89+) the hardware cast cvt.rn.satfinite.{e4m3,e5m2}x2.f32 rounds to nearest-even, one
# instruction per two elements instead of ~25 integer operations per element; the GPU tests check it bit
# for bit against the reference. The interpreter's casts are wrong in some cases, so it uses bit arithmetic.
NATIVE_FP8_CAST = not triton_interpreted()


@triton.jit
def fp8_bits(v, r, MBITS: tl.constexpr, BIAS: tl.constexpr, STOCHASTIC: tl.constexpr, NATIVE: tl.constexpr):
    """FP8 bit patterns (int32) of fp32 ``v`` (finite, saturated): the hardware cast if NATIVE and
    rounding to nearest, else :func:`fp8_round_bits`."""
    if NATIVE and not STOCHASTIC:
        if MBITS == 3:
            out = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            out = v.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        out = fp8_round_bits(v, r, MBITS, BIAS, STOCHASTIC)
    return out


@triton.jit
def scaled_fp8_bits(
    x, scale, MBITS: tl.constexpr, BIAS: tl.constexpr, MAXV: tl.constexpr, NATIVE: tl.constexpr
):
    """FP8 bits (int32, 0..255) of fp32 ``x / scale`` saturated to the format: the element rule of the
    row-wise kernels (:mod:`.rowwise.triton`, :mod:`.packed.triton`) and of their PyTorch reference.
    ``div_rn`` is IEEE division, as PyTorch's; Triton's ``/`` is the approximate ``div.full.f32``, which
    rounded an element to a neighbouring FP8 value on an H100 (2026-12-07)."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -MAXV), MAXV)
    return fp8_bits(v, v, MBITS, BIAS, False, NATIVE)


@triton.jit
def e8m0_to_f32(s):
    """fp32 ``2**(s - 127)`` of E8M0 bytes ``s`` (int32 0..255); 255 is NaN, 0 is the subnormal 2**-127."""
    bits = tl.where(s == 0, 0x400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mx_block_quantize(x3, amax_bits, nonfinite, r, EMAX, MBITS, BIAS, MAXV, NANB, RCEIL, STOCHASTIC, NATIVE):
    """MX-quantize fp32 values ``x3`` with per-block int32 ``amax_bits`` (``|x|`` bits of each block's
    maximum, broadcastable to ``x3``); ``nonfinite`` marks blocks holding a NaN or Inf. Shared by
    :mod:`.mx.triton` and :mod:`.packed.triton`.

    Returns ``(data bits int32 like x3, scale bytes int32 like amax_bits)``.
    """
    e = (amax_bits >> 23) - 127 - EMAX
    if RCEIL:
        e += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # amax > 1.75 * 2**k: one more
    e = tl.minimum(tl.maximum(e, -127), 127)
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact (-e in [-120, 127])
    v = x3 * inv_scale
    v = tl.minimum(tl.maximum(v, -MAXV), MAXV)
    bits = fp8_bits(v, r, MBITS, BIAS, STOCHASTIC, NATIVE)
    bits = tl.where(nonfinite, NANB, bits)
    scale = tl.where(nonfinite, 255, e + 127)
    return bits, scale
