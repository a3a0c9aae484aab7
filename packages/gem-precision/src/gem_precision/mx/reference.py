"""PyTorch reference implementation of MX quantization (the oracle of the Triton kernels and the CPU path).

Semantics (OCP Microscaling Formats v1.0, with the choices the spec leaves open made explicit):

* Blocks: ``block_size`` consecutive elements along ``axis`` share one scale; the last block may be partial
  (it is quantized as if padded with zeros). ``square=True``: one scale per ``block_size x block_size``
  tile of the last two dimensions; such data is valid MX data blocked along either of them.
* ``amax`` is the largest magnitude of the block in fp32 (inputs are first cast to fp32).
* Scale exponent ``e`` (the scale is ``2**e``):
    - ``"floor"`` (the spec's suggestion): ``e = floor(log2(amax)) - emax`` (emax 8 for E4M3, 15 for E5M2);
      scaled elements above the element maximum saturate to it.
    - ``"rceil"``: the smallest ``e`` with ``amax <= max_elem * 2**e`` (``ceil(log2(amax / max_elem))``
      computed exactly), so nothing saturates.
  ``e`` is clamped to [-127, 127]. A block whose amax is zero or an fp32 subnormal gets ``e = -127``
  (byte 0); its elements are rounded at that scale (subnormal inputs mostly flush to signed zeros).
* A block that holds a NaN or an infinity is NaN as a whole: scale byte 255 (E8M0 NaN) and every element
  the element format's NaN (0x7F). Dequantizing it gives NaN everywhere in the block.
* Elements ``x / 2**e`` are rounded to nearest-even (``"nearest"``) or stochastically (``"stochastic"``:
  up with probability equal to the distance to the lower neighbour over the spacing, which is unbiased as
  long as nothing saturates, i.e. with ``"rceil"``). Signed zeros keep their sign.
"""

from __future__ import annotations

import math

import torch

from gem_precision.formats import (
    E8M0_BIAS,
    E8M0_NAN,
    SCALE_EXP_MAX,
    SCALE_EXP_MIN,
    ElemFormat,
    e8m0_to_float,
)

# fp32 mantissa of 1.75, the significand of both FP8 maxima (448 = 1.75 * 2**8, 57344 = 1.75 * 2**15).
_MANT_1_75 = 0x600000


def hadamard_matrix(signs: torch.Tensor) -> torch.Tensor:
    """The orthogonal fp32 matrix ``Q = diag(signs) @ H_n / sqrt(n)`` of a random Hadamard transform.

    Args:
        signs: ``[n]`` tensor of +-1 (any float dtype), ``n`` a power of two.

    Returns:
        ``[n, n]`` fp32 on ``signs.device``. A vector ``v`` along the blocked axis is transformed as
        ``v @ Q``; ``Q @ Q.T == I``, so transforming both operands of a GEMM along K leaves the product.
    """
    n = signs.numel()
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    q = signs.detach().to(torch.float64).cpu()[:, None] * h / math.sqrt(n)
    return q.to(device=signs.device, dtype=torch.float32)


def scale_exponent(amax: torch.Tensor, fmt: ElemFormat, scale_mode: str) -> torch.Tensor:
    """Unbiased int32 scale exponents of fp32 block maxima (finite, >= 0), clamped to [-127, 127]."""
    bits = amax.contiguous().view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    e = exp_field - 127 - fmt.emax
    if scale_mode == "rceil":
        e = e + ((bits & 0x7FFFFF) > _MANT_1_75).to(torch.int32)
    elif scale_mode != "floor":
        raise ValueError(f"scale_mode must be 'floor' or 'rceil', got {scale_mode!r}")
    # Zero or subnormal amax: the formula already gives e <= -127 - emax + 1 < -127; the clamp sets -127.
    return e.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX)


def pow2_float(e: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**e`` for int32 ``e`` in [-126, 127], exact (built from the exponent bits)."""
    return ((e + 127) << 23).view(torch.float32)


def _pow2_int(n: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_left_shift(torch.ones_like(n), n)


def round_to_fp8_bits(
    v: torch.Tensor, fmt: ElemFormat, *, stochastic: bool, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round fp32 ``v`` (finite, ``|v| <= fmt.max_value``) to FP8 bit patterns with integer arithmetic.

    The spacing of FP8 values around ``|v|`` is ``2**qe`` with ``qe = max(E, 1 - bias) - mbits`` (E the
    exponent of ``|v|``); ``k = |v| / 2**qe`` is rounded to an integer (to nearest-even, or up with
    probability ``frac(k)``) and encoded as ``(max(E + bias - 1, 0) << mbits) + k``, which also handles the
    carry into the next exponent and the subnormal range. Stochastic rounding draws 32 random bits per
    element, so below ``2**-8`` of the smallest subnormal spacing it rounds to zero (bias below 2**-8 ulp).

    Returns:
        uint8 tensor of ``v.shape`` (the sign bit set for negative values and -0.0).
    """
    bits = v.contiguous().view(torch.int32).to(torch.int64)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    e32 = torch.clamp(a >> 23, min=1)  # fp32 subnormals share exponent 1 with an implicit 0 bit
    mant = (a & 0x7FFFFF) | (((a >> 23) > 0).to(torch.int64) << 23)
    exp = e32 - 127
    qe = torch.clamp(exp, min=fmt.min_normal_exp) - fmt.mbits
    shift = qe + 150 - e32  # >= 23 - mbits
    if stochastic:
        shift_c = torch.clamp(shift, max=32)
        r = torch.randint(0, 2**32, v.shape, dtype=torch.int64, generator=generator, device=v.device)
        k = (mant + (r & (_pow2_int(shift_c) - 1))) >> shift_c
        k = torch.where(shift > 32, torch.zeros_like(k), k)
    else:
        shift_c = torch.clamp(shift, max=25)  # M < 2**24: any shift >= 25 rounds to 0
        k = (mant + _pow2_int(shift_c - 1) - 1 + ((mant >> shift_c) & 1)) >> shift_c
    enc = (torch.clamp(exp + fmt.bias - 1, min=0) << fmt.mbits) + k
    return ((sign << 7) | enc).to(torch.uint8)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    rem = (-x.shape[dim]) % multiple
    if rem == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = rem
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def _apply_hadamard_last(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``v @ q`` for every block of ``q.shape[0]`` elements of the last dim (its length a multiple)."""
    n = q.shape[0]
    shape = x.shape
    return (x.reshape(-1, n) @ q).reshape(shape)


def _quantize_block_values(
    xb: torch.Tensor,
    amax: torch.Tensor,
    fmt: ElemFormat,
    scale_mode: str,
    rounding: str,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 values ``xb`` whose block maxima ``amax`` broadcast against them.

    Returns ``(data uint8 bits like xb, scale uint8 like amax)``.
    """
    nonfinite = ~torch.isfinite(amax)
    amax_f = torch.where(nonfinite, torch.zeros_like(amax), amax)
    e = scale_exponent(amax_f, fmt, scale_mode)
    scale = (e + E8M0_BIAS).to(torch.uint8).masked_fill(nonfinite, E8M0_NAN)
    # x * 2**-e is exact: -e lies in [-120, 127] (e <= 127 - 8 + 1), always a normal fp32 power of two.
    v = xb * pow2_float(-e)
    v = torch.where(nonfinite, torch.zeros_like(v), v)
    v = v.clamp(-fmt.max_value, fmt.max_value)  # saturation (floor mode); keeps the sign of -0.0
    if rounding == "nearest":
        # torch's CPU/CUDA fp32 -> fp8 casts round to nearest-even (checked in the tests).
        data = v.to(fmt.dtype).view(torch.uint8)
    elif rounding == "stochastic":
        data = round_to_fp8_bits(v, fmt, stochastic=True, generator=generator)
    else:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    data = torch.where(nonfinite, torch.full_like(data, fmt.nan_bits), data)
    return data, scale


def to_mx_reference(
    x: torch.Tensor,
    *,
    axis: int,
    block_size: int,
    fmt: ElemFormat,
    scale_mode: str,
    rounding: str,
    square: bool,
    hadamard: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MX. Arguments are validated by :func:`gem_precision.to_mx`.

    Args:
        x: float tensor of any shape (computed in fp32).
        axis: the blocked dimension (non-negative); with ``square`` one of the last two.
        hadamard: optional ``[block_size, block_size]`` fp32 matrix applied to each block along ``axis``.

    Returns:
        ``(data, scale)``: data in ``fmt.dtype`` of ``x.shape``; scale uint8 E8M0 of ``x.shape`` with the
        blocked dimension divided by ``block_size`` (rounded up), or both last two dimensions with ``square``.
    """
    xf = x.to(torch.float32)
    if square:
        r, c = xf.shape[-2], xf.shape[-1]
        xp = _pad_to(_pad_to(xf, -1, block_size), -2, block_size)
        rb, cb = xp.shape[-2] // block_size, xp.shape[-1] // block_size
        tiles = xp.reshape(*xp.shape[:-2], rb, block_size, cb, block_size)
        amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
        data, scale = _quantize_block_values(tiles, amax, fmt, scale_mode, rounding, generator)
        data = data.reshape(xp.shape)[..., :r, :c]
        scale = scale.reshape(*xp.shape[:-2], rb, cb)
        return data.contiguous().view(fmt.dtype), scale

    xt = xf.movedim(axis, -1)
    length = xt.shape[-1]
    xp = _pad_to(xt, -1, block_size)
    if hadamard is not None:
        xp = _apply_hadamard_last(xp, hadamard)
    blocks = xp.reshape(*xp.shape[:-1], xp.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    data, scale = _quantize_block_values(blocks, amax, fmt, scale_mode, rounding, generator)
    data = data.reshape(xp.shape)[..., :length].movedim(-1, axis).contiguous()
    scale = scale.squeeze(-1).movedim(-1, axis).contiguous()
    return data.view(fmt.dtype), scale


def dequantize_reference(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    axis: int,
    block_size: int,
    square: bool,
    hadamard: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 values ``data * 2**e`` of MX data (the inverse Hadamard transform undone if given).

    Args:
        data: FP8 tensor. scale: uint8 E8M0 in the layout :func:`to_mx_reference` returns.
    """
    s = e8m0_to_float(scale)
    if square:
        s = s.repeat_interleave(block_size, -1).repeat_interleave(block_size, -2)
        s = s[..., : data.shape[-2], : data.shape[-1]]
    else:
        s = s.repeat_interleave(block_size, axis).narrow(axis, 0, data.shape[axis])
    out = data.to(torch.float32) * s
    if hadamard is not None:
        out = _apply_hadamard_last(out.movedim(axis, -1), hadamard.t()).movedim(-1, axis)
    return out


def mx_mm_reference(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    block_size: int,
    a_square: bool,
    b_square: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` in fp32, for ``a [M, K]`` blocked along 1 and ``b [K, N]`` along 0.

    A Hadamard transform on both operands cancels in the product, so none is undone here.
    """
    a = dequantize_reference(a_data, a_scale, axis=1, block_size=block_size, square=a_square)
    b = dequantize_reference(b_data, b_scale, axis=0, block_size=block_size, square=b_square)
    return (a @ b).to(out_dtype)
