"""The op face of MX: ``to_mx`` and ``mx_mm`` check their arguments and dispatch
(:mod:`gem_precision.dispatch`) to the Triton kernels (:mod:`.triton`) on CUDA and the PyTorch reference
(:mod:`.reference`) elsewhere. :class:`MXTensor` lives in :mod:`.tensor`.
"""

from __future__ import annotations

import torch

from gem_precision.dispatch import BACKENDS, use_triton
from gem_precision.formats import (
    BLOCK_SIZES,
    ROUNDINGS,
    SCALE_MODES,
    check_block_size,
    check_float_tensor,
    elem_format,
    has_e8m0_dtype,
)
from gem_precision.mx import reference as mx_reference
from gem_precision.mx.tensor import MXTensor

# Block sizes the Triton kernels are compiled for; every path accepts only these.
TRITON_BLOCK_SIZES = BLOCK_SIZES

__all__ = ["BACKENDS", "TRITON_BLOCK_SIZES", "mx_mm", "random_hadamard", "to_mx"]


def random_hadamard(
    block_size: int = 32, *, seed: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """A random Hadamard transform ``diag(s) @ H / sqrt(n)`` with random signs ``s`` drawn from ``seed``.

    Returns:
        ``[block_size, block_size]`` fp32 orthogonal matrix, to pass as ``to_mx(..., hadamard=)``.
    """
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (block_size,), generator=gen).to(torch.float32) * 2 - 1
    return mx_reference.hadamard_matrix(signs).to(device)


def _use_triton(t: torch.Tensor, block_size: int, backend: str) -> bool:
    """:func:`gem_precision.dispatch.use_triton`, limited to the block sizes the kernels are compiled for."""
    if not use_triton(t, backend):
        return False
    if block_size not in TRITON_BLOCK_SIZES:
        if backend == "triton":
            raise ValueError(
                f"the Triton kernels support block_size in {TRITON_BLOCK_SIZES}, got {block_size}"
            )
        return False
    return True


def to_mx(
    x: torch.Tensor,
    *,
    axis: int = -1,
    block_size: int = 32,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_mode: str = "rceil",
    rounding: str = "nearest",
    square: bool = False,
    hadamard: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> MXTensor:
    """Quantize ``x`` to MX (OCP Microscaling v1.0) blocked along ``axis``.

    Args:
        x: fp16 / bf16 / fp32 / fp64 tensor of any shape (values are taken in fp32). The blocked dimension
            may be any length: a last partial block is quantized as if padded with zeros.
        axis: the blocked dimension (K of the GEMM the result feeds).
        block_size: elements per block: 16, 32 (the spec's), 64 or 128 (what the kernels support).
        elem_dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        scale_mode: ``"rceil"`` (nothing saturates) or ``"floor"`` (the spec's; large elements saturate).
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased with ``"rceil"``).
        square: one scale per ``block_size x block_size`` tile of the last two dimensions (``axis`` must be
            one of them); the result is valid blocked along either, so it also feeds transposed GEMMs.
        hadamard: optional ``[block_size, block_size]`` orthogonal matrix (:func:`random_hadamard`) applied
            to each block along ``axis`` before quantization; needs ``x.shape[axis] % block_size == 0``.
        generator: random source of stochastic rounding (on the Triton path it draws the kernel's seed).
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` or ``"reference"``.

    Returns:
        An :class:`MXTensor`. See :mod:`gem_precision.mx.reference` for zeros, NaN, Inf and
        subnormals.
    """
    check_float_tensor("to_mx", "x", x)
    if x.dim() == 0:
        raise ValueError("to_mx needs at least one dimension")
    check_block_size("to_mx", block_size)
    fmt = elem_format(elem_dtype)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a {x.dim()}-D tensor")
    axis = axis % x.dim()
    if square:
        if x.dim() < 2:
            raise ValueError("square=True needs at least two dimensions")
        if axis < x.dim() - 2:
            raise ValueError(f"square tiles cover the last two dimensions; axis {axis} is not one of them")
        if hadamard is not None:
            raise ValueError("a Hadamard transform acts along one axis; it cannot be combined with square")
    if hadamard is not None:
        if hadamard.shape != (block_size, block_size):
            raise ValueError(
                f"hadamard must be [block_size, block_size] = [{block_size}, {block_size}], "
                f"got {tuple(hadamard.shape)}"
            )
        if x.shape[axis] % block_size:
            raise ValueError(
                f"a Hadamard transform needs whole blocks: x.shape[{axis}] = {x.shape[axis]} is not "
                f"divisible by block_size {block_size}"
            )
        hadamard = hadamard.to(device=x.device, dtype=torch.float32)

    if _use_triton(x, block_size, backend):
        from gem_precision.mx import triton as triton_mx

        seed = None
        if rounding == "stochastic":
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
        data, scale = triton_mx.to_mx_triton(
            x, axis=axis, block_size=block_size, fmt=fmt, scale_mode=scale_mode, seed=seed,
            square=square, hadamard=hadamard,
        )  # fmt: skip
    else:
        data, scale = mx_reference.to_mx_reference(
            x, axis=axis, block_size=block_size, fmt=fmt, scale_mode=scale_mode, rounding=rounding,
            square=square, hadamard=hadamard, generator=generator,
        )  # fmt: skip
    return MXTensor(data, scale, block_size, axis, x.dtype, square, hadamard)


def _check_mm_operands(a: MXTensor, b: MXTensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, MXTensor):
            raise TypeError(f"mx_mm: {name} must be an MXTensor, got {type(t).__name__}")
        if t.data.dim() != 2:
            raise ValueError(f"mx_mm: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"mx_mm: {name}.data must be float8_e4m3fn or float8_e5m2, got {t.data.dtype}")
        if t.scale.dtype != torch.uint8 and not (has_e8m0_dtype() and t.scale.dtype == torch.float8_e8m0fnu):
            raise TypeError(f"mx_mm: {name}.scale must be uint8 (E8M0) scales, got {t.scale.dtype}")
        check_block_size("mx_mm", t.block_size)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"mx_mm: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if not a.blocked_along(1):
        raise ValueError("mx_mm: a [M, K] must be blocked along K (axis 1, or square)")
    if not b.blocked_along(0):
        raise ValueError("mx_mm: b [K, N] must be blocked along K (axis 0, or square)")
    if a.block_size != b.block_size:
        raise ValueError(f"mx_mm: block sizes differ: {a.block_size} and {b.block_size}")
    if (a.hadamard is None) != (b.hadamard is None) or (
        a.hadamard is not None
        and b.hadamard is not None
        and not torch.equal(a.hadamard, b.hadamard.to(a.hadamard.device))
    ):
        raise ValueError("mx_mm: both operands need the same Hadamard transform (or none)")
    if a.data.device != b.data.device:
        raise ValueError(f"mx_mm: operands on different devices: {a.data.device} and {b.data.device}")


def mx_mm(
    a: MXTensor, b: MXTensor, *, out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto"
) -> torch.Tensor:
    """Exact block-scaled product ``dequant(a) @ dequant(b)`` with fp32 accumulation.

    Args:
        a: ``[M, K]`` MXTensor blocked along K (axis 1, or square).
        b: ``[K, N]`` MXTensor blocked along K (axis 0, or square); e.g. ``to_mx(w).t()`` for a weight
            ``w [N, K]`` quantized along its last dimension.
        out_dtype: dtype of the result.
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` or ``"reference"``.

    Returns:
        ``[M, N]`` tensor of ``out_dtype``. A Hadamard transform on both operands cancels in the product.
    """
    _check_mm_operands(a, b)
    if _use_triton(a.data, a.block_size, backend):
        from gem_precision.mx import triton as triton_mx

        return triton_mx.mx_mm_triton(a, b, out_dtype=out_dtype)
    return mx_reference.mx_mm_reference(
        a.data, a.scale, b.data, b.scale, block_size=a.block_size, a_square=a.square,
        b_square=b.square, out_dtype=out_dtype,
    )  # fmt: skip
