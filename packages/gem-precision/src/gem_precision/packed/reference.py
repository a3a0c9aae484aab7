"""PyTorch reference of packed 8-bit rows: the CPU path and the oracle of :mod:`.triton`.

A packed row is one row of a weight ``[R, K]`` quantized to FP8 E4M3 and stored as ``uint8``: its K element
bytes followed by the bytes of its scales, so one ``uint8 [R, K + s]`` tensor carries a whole shard through a
collective (FSDP2 all-gathers dim 0, so rows and their scales stay together):

- ``"fp8"``: one fp32 scale per row (:func:`gem_precision.rowwise.reference.quantize_rowwise_reference`),
  its 4 bytes in the machine's (little-endian) order: ``s = 4``;
- ``"mxfp8"``: one E8M0 scale per 32 elements along K (``to_mx`` with ``"rceil"`` scales, rounding to
  nearest), a last partial block zero-padded: ``s = ceil(K / 32)``.

The bytes are exactly those of quantizing with ``quantize_rowwise`` / ``to_mx`` and concatenating the data
and scale bytes, which is what gem-parallel's 8-bit all-gather sent before the fused kernel existed.
"""

from __future__ import annotations

import torch

from gem_precision.formats import E4M3
from gem_precision.mx.reference import dequantize_reference, to_mx_reference
from gem_precision.rowwise.reference import quantize_rowwise_reference

PACKED_FORMATS = ("fp8", "mxfp8")
MX_BLOCK = 32  # elements per E8M0 scale of "mxfp8"
ROW_SCALE_BYTES = 4  # one fp32 scale per row of "fp8"


def scale_bytes(k: int, fmt: str) -> int:
    """Scale bytes at the end of a packed row of ``k`` elements."""
    return ROW_SCALE_BYTES if fmt == "fp8" else -(-k // MX_BLOCK)


def quantize_packed_reference(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``uint8 [R, K + s]``: each row's E4M3 bytes, then its scale bytes (see the module docstring)."""
    r, k = x.shape
    if r == 0:  # (an empty scale tensor's strides cannot be viewed as bytes)
        return torch.empty((0, k + scale_bytes(k, fmt)), dtype=torch.uint8, device=x.device)
    if fmt == "fp8":
        data, scale = quantize_rowwise_reference(x, E4M3.dtype)
    else:
        data, scale = to_mx_reference(
            x, axis=1, block_size=MX_BLOCK, fmt=E4M3, scale_mode="rceil", rounding="nearest", square=False
        )
    scale_u8 = scale.contiguous().view(torch.uint8).reshape(r, -1)
    return torch.cat([data.view(torch.uint8), scale_u8], dim=1)


def split_packed(packed: torch.Tensor, k: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [R, K] float8_e4m3fn, scale)`` of packed rows: scale fp32 ``[R, 1]`` ("fp8") or uint8 E8M0
    ``[R, ceil(K / 32)]`` ("mxfp8"); copies (a view of a row's tail is not aligned for fp32, even when
    it is contiguous)."""
    data = packed.new_empty((packed.shape[0], k)).copy_(packed[:, :k]).view(E4M3.dtype)
    tail = packed[:, k:]
    scale = tail.new_empty(tail.shape).copy_(tail)
    return data, (scale.view(torch.float32) if fmt == "fp8" else scale)


def dequantize_packed_reference(packed: torch.Tensor, k: int, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``[R, K]`` of ``dtype`` from packed rows: each element ``fp32(e4m3) * scale`` (an exact
    product for "mxfp8", one fp32 rounding for "fp8"), then one cast to ``dtype``."""
    data, scale = split_packed(packed, k, fmt)
    if fmt == "fp8":
        return (data.to(torch.float32) * scale).to(dtype)
    return dequantize_reference(data, scale, axis=1, block_size=MX_BLOCK, square=False).to(dtype)
