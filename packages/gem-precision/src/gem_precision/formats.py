"""Element formats of MXFP8 and the E8M0 scale encoding (OCP Microscaling Formats v1.0).

An MX block holds ``block_size`` (32) elements and one shared scale ``X = 2**e`` stored as E8M0: an unsigned
byte ``b`` meaning ``2**(b - 127)``; ``b = 255`` is NaN. Elements are FP8 E4M3 (OCP "fn": no infinities,
max 448) or E5M2 (IEEE-like, max 57344).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E8M0_BIAS = 127
E8M0_NAN = 255
# Scale exponents are clamped to what E8M0 can encode (byte 0..254).
SCALE_EXP_MIN = -127
SCALE_EXP_MAX = 127

SCALE_MODES = ("floor", "rceil")
ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class ElemFormat:
    """Bit layout of an FP8 element format.

    Attributes:
        dtype: the torch dtype.
        mbits: explicit mantissa bits.
        bias: exponent bias.
        emax: exponent of the largest power of two that is representable (8 for E4M3, 15 for E5M2).
        max_value: largest finite magnitude (448 or 57344; both are 1.75 * 2**emax).
        nan_bits: the canonical positive NaN encoding written for non-finite blocks.
    """

    dtype: torch.dtype
    mbits: int
    bias: int
    emax: int
    max_value: float
    nan_bits: int

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias


E4M3 = ElemFormat(torch.float8_e4m3fn, mbits=3, bias=7, emax=8, max_value=448.0, nan_bits=0x7F)
E5M2 = ElemFormat(torch.float8_e5m2, mbits=2, bias=15, emax=15, max_value=57344.0, nan_bits=0x7F)

_FORMATS = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}


def elem_format(dtype: torch.dtype) -> ElemFormat:
    """The :class:`ElemFormat` of an FP8 element dtype; raises ``ValueError`` for any other dtype."""
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(
            f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        ) from None


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Block sizes every MX path supports: the Triton kernels are compiled for these (tl.dot needs K tiles of at
# least 16), and the CPU reference accepts the same ones so a config behaves alike on both.
BLOCK_SIZES = (16, 32, 64, 128)


def check_float_tensor(fn: str, name: str, t: object) -> None:
    """``t`` must be a torch tensor of fp16/bf16/fp32/fp64 (integer, bool, complex and FP8 inputs are
    refused); ``fn`` and ``name`` name the function and the argument in the error."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{fn}: {name} must be a floating-point tensor (fp16, bf16, fp32, fp64), got {t.dtype}"
        )


def check_block_size(fn: str, block_size: object) -> int:
    """``block_size`` must be one of :data:`BLOCK_SIZES`."""
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise ValueError(f"{fn}: block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    return int(block_size)


def has_e8m0_dtype() -> bool:
    """Whether this torch has ``torch.float8_e8m0fnu`` (2.7+)."""
    return hasattr(torch, "float8_e8m0fnu")


def e8m0_to_exponent(scale: torch.Tensor) -> torch.Tensor:
    """Unbiased int32 exponents of E8M0 scales (uint8 or float8_e8m0fnu); NaN (255) maps to 128."""
    if scale.dtype != torch.uint8:
        scale = scale.view(torch.uint8)
    return scale.to(torch.int32) - E8M0_BIAS


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32 values ``2**(b-127)`` of E8M0 bytes, NaN for byte 255. Exact: built from the exponent bits.

    Byte 0 (2**-127) is an fp32 subnormal; it is built as 2**-126 * 0.5, which is exact.
    """
    b = scale.view(torch.uint8).to(torch.int32) if scale.dtype != torch.uint8 else scale.to(torch.int32)
    # fp32 bits of 2**(b-127) for b >= 1 are just the exponent field b; byte 0 is the subnormal 0x00400000.
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    out = bits.view(torch.float32).clone()
    return out.masked_fill_(b == E8M0_NAN, float("nan"))
