"""The op face of packed 8-bit rows: :func:`quantize_packed` and :func:`dequantize_packed` check their
arguments and dispatch (:mod:`gem_precision.dispatch`) to one Triton launch each on CUDA (:mod:`.triton`)
or to the PyTorch reference elsewhere (:mod:`.reference`, which also defines the layout).

What they are for: an 8-bit FSDP all-gather (gem-parallel's ``QuantizedAllGatherWeight``) quantizes each
rank's weight shard into one ``uint8`` tensor, rows followed by their scales, and turns the gathered rows
back into the unsharded weight. Quantizing with ``quantize_rowwise`` / ``to_mx`` and concatenating the
scale bytes gives the same bytes, in several launches per weight (plus copies) instead of one.
"""

from __future__ import annotations

import torch

from gem_precision.dispatch import use_triton
from gem_precision.formats import check_float_tensor
from gem_precision.packed.reference import (
    PACKED_FORMATS,
    dequantize_packed_reference,
    quantize_packed_reference,
    scale_bytes,
)

__all__ = ["PACKED_FORMATS", "dequantize_packed", "packed_width", "quantize_packed"]


def _check_fmt(op: str, fmt: str) -> None:
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"{op}: fmt must be one of {PACKED_FORMATS}, got {fmt!r}")


def packed_width(k: int, fmt: str) -> int:
    """Bytes of one packed row of ``k`` elements: ``k + 4`` ("fp8") or ``k + ceil(k / 32)`` ("mxfp8")."""
    _check_fmt("packed_width", fmt)
    if k < 0:
        raise ValueError(f"packed_width: k must be >= 0, got {k}")
    return k + scale_bytes(k, fmt)


def quantize_packed(x: torch.Tensor, fmt: str, *, backend: str = "auto") -> torch.Tensor:
    """Quantize each row of ``x [R, K]`` to E4M3 and pack it with its scales into ``uint8 [R, K + s]``.

    Args:
        x: 2-D fp32 / bf16 / fp16 (any strides), e.g. a rank's shard of a weight ``[N, K]``.
        fmt: "fp8" (one fp32 scale per row, ``s = 4``: the bytes of ``quantize_rowwise``) or "mxfp8" (one
            E8M0 "rceil" scale per 32 elements, ``s = ceil(K / 32)``: the bytes of ``to_mx(x, axis=-1)``).
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` or ``"reference"``.

    Returns:
        ``uint8 [R, packed_width(K, fmt)]``, contiguous.
    """
    check_float_tensor("quantize_packed", "x", x)
    _check_fmt("quantize_packed", fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize_packed needs a 2-D tensor [R, K], got shape {tuple(x.shape)}")
    if use_triton(x, backend):
        from gem_precision.packed.triton import quantize_packed_triton

        return quantize_packed_triton(x, fmt, packed_width(x.shape[1], fmt))
    return quantize_packed_reference(x, fmt)


def dequantize_packed(
    packed: torch.Tensor,
    k: int,
    fmt: str,
    dtype: torch.dtype = torch.bfloat16,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The weight ``[R, k]`` of packed rows ``packed uint8 [R, packed_width(k, fmt)]``.

    Each element is ``fp32(e4m3) * scale`` cast once to ``dtype`` (the values of dequantizing
    ``quantize_rowwise``'s or ``to_mx``'s output). With ``out`` (``[R, k]`` of a floating dtype, any
    strides) the result is written there and ``out`` returned; ``dtype`` is then ``out.dtype``.
    """
    _check_fmt("dequantize_packed", fmt)
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(
            f"dequantize_packed: packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    if packed.shape[1] != packed_width(k, fmt):
        raise ValueError(
            f"dequantize_packed: rows of {packed.shape[1]} bytes do not hold k={k} {fmt} elements "
            f"(expected {packed_width(k, fmt)})"
        )
    if out is not None:
        if tuple(out.shape) != (packed.shape[0], k) or not out.dtype.is_floating_point:
            raise ValueError(
                f"dequantize_packed: out must be a floating [{packed.shape[0]}, {k}] tensor, "
                f"got {out.dtype} {tuple(out.shape)}"
            )
        dtype = out.dtype
    if use_triton(packed, backend):
        from gem_precision.packed.triton import dequantize_packed_triton

        packed = packed.contiguous()
        target = (
            out if out is not None else torch.empty((packed.shape[0], k), dtype=dtype, device=packed.device)
        )
        return dequantize_packed_triton(packed, k, fmt, target)
    weight = dequantize_packed_reference(packed, k, fmt, dtype)
    if out is None:
        return weight
    return out.copy_(weight)
