"""The op face of packed 8-bit rows: :func:`quantize_packed` and :func:`dequantize_packed` check their
arguments and dispatch (:mod:`gem_precision.dispatch`) to one Triton launch each on CUDA (:mod:`.triton`)
or to the PyTorch reference elsewhere (:mod:`.reference`, which also defines the layout).

What they are for: an 8-bit FSDP all-gather (gem-parallel's ``QuantizedAllGatherWeight``) quantizes each
rank's weight shard into one ``uint8`` tensor, rows followed by their scales, and turns the gathered rows
back into the unsharded weight. Quantizing with ``quantize_rowwise`` / ``to_mx`` and concatenating the
scale bytes gives the same bytes, in several launches per weight (plus copies) instead of one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gem_precision.dispatch import use_triton
from gem_precision.formats import check_float_tensor
from gem_precision.packed.reference import (
    PACKED_FORMATS,
    dequantize_packed_reference,
    quantize_packed_reference,
    scale_bytes,
)

__all__ = ["PACKED_FORMATS", "dequantize_packed", "packed_width", "quantize_packed", "quantize_packed_many"]


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


def quantize_packed_many(
    xs: Sequence[torch.Tensor], fmt: str, *, backend: str = "auto"
) -> list[torch.Tensor]:
    """:func:`quantize_packed` of every tensor of ``xs``, in one Triton launch per dtype on CUDA.

    What an FSDP unit's all-gather round needs: every wrapped weight shard of the unit quantized at once
    (the per-launch host cost, not memory traffic, is what a weight at a GEM trunk's shapes costs).

    Args:
        xs: 2-D fp32 / bf16 / fp16 tensors ``[R_i, K_i]`` (any strides, shapes and dtypes), one device.
        fmt: "fp8" or "mxfp8", as :func:`quantize_packed`.
        backend: as :func:`quantize_packed`.

    Returns:
        ``uint8 [R_i, packed_width(K_i, fmt)]`` per tensor, in order: each equal to ``quantize_packed(xs[i],
        fmt)``. On CUDA they are contiguous views of one buffer per dtype.
    """
    _check_fmt("quantize_packed_many", fmt)
    xs = list(xs)
    for i, x in enumerate(xs):
        check_float_tensor("quantize_packed_many", f"xs[{i}]", x)
        if x.dim() != 2:
            raise ValueError(
                f"quantize_packed_many needs 2-D tensors [R, K], xs[{i}] has shape {tuple(x.shape)}"
            )
        if x.device != xs[0].device:
            raise ValueError(f"quantize_packed_many: xs[{i}] is on {x.device}, xs[0] on {xs[0].device}")
    if not xs or not use_triton(xs[0], backend):
        return [quantize_packed_reference(x, fmt) for x in xs]
    from gem_precision.packed.triton import quantize_packed_many_triton

    out: list[torch.Tensor | None] = [None] * len(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs):
        idx = [i for i, x in enumerate(xs) if x.dtype == dtype]
        widths = [packed_width(xs[i].shape[1], fmt) for i in idx]
        for i, packed in zip(idx, quantize_packed_many_triton([xs[i] for i in idx], fmt, widths)):
            out[i] = packed
    return [p for p in out if p is not None]


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
