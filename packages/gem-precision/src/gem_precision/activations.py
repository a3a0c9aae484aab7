"""``compress_saved_activations``: store tensors saved for backward in FP8 / MXFP8."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from gem_precision.mx import MXTensor, to_mx
from gem_precision.rowwise import quantize_rowwise

_COMPRESSIBLE = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATION_FORMATS = ("fp8", "mxfp8")


@dataclass
class _Packed:
    """A saved tensor in compressed form: ``fp8`` (data + per-row fp32 scales) or an ``MXTensor``."""

    shape: torch.Size
    dtype: torch.dtype
    data: torch.Tensor | MXTensor
    scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held: the FP8 data and its scales."""
        if isinstance(self.data, MXTensor):
            return self.data.data.numel() + self.data.scale.numel()
        assert self.scale is not None  # fp8 data always carries its row scales
        return self.data.numel() + self.scale.numel() * self.scale.element_size()

    def unpack(self) -> torch.Tensor:
        if isinstance(self.data, MXTensor):
            return self.data.dequantize(self.dtype).reshape(self.shape)
        assert self.scale is not None  # fp8 data always carries its row scales
        return (self.data.to(torch.float32) * self.scale).to(self.dtype).reshape(self.shape)


def _compress(t: torch.Tensor, fmt: str) -> _Packed:
    flat = t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)
    if fmt == "mxfp8":
        return _Packed(t.shape, t.dtype, to_mx(flat, axis=-1, scale_mode="rceil"))
    data, scale = quantize_rowwise(flat, torch.float8_e4m3fn)
    return _Packed(t.shape, t.dtype, data, scale)


@contextlib.contextmanager
def compress_saved_activations(fmt: str = "fp8", *, min_numel: int = 4096) -> Iterator[None]:
    """Inside this context, tensors that autograd saves for backward are stored quantized and restored
    (dequantized to their dtype) when backward needs them.

    Args:
        fmt: ``"fp8"``: E4M3 with one fp32 scale per row of the last dimension (1 byte per element plus
            4 per row); ``"mxfp8"``: MX E4M3 in 32-element blocks along the last dimension (1.03 bytes).
        min_numel: smaller tensors are kept as they are.

    Parameters, tensors that are not fp32/bf16/fp16, non-contiguous tensors and small ones are saved
    unchanged. A tensor saved several times (e.g. an activation's output and the next layer's input) is
    compressed once. Gradients become approximate: backward sees the dequantized values (relative error
    ~2**-4 per element with E4M3), which also moves the masks of ReLU-like ops for values that round to 0.
    """
    if fmt not in ACTIVATION_FORMATS:
        raise ValueError(f"fmt must be one of {ACTIVATION_FORMATS}, got {fmt!r}")
    seen: dict[int, tuple[weakref.ref[torch.Tensor], _Packed]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor | _Packed:
        if (
            isinstance(t, nn.Parameter)
            or t.dtype not in _COMPRESSIBLE
            or t.numel() < min_numel
            or not t.is_contiguous()
            or (t.is_leaf and t.requires_grad)
        ):
            return t
        hit = seen.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        packed = _compress(t.detach(), fmt)
        seen[id(t)] = (weakref.ref(t), packed)
        return packed

    def unpack(p: torch.Tensor | _Packed) -> torch.Tensor:
        return p.unpack() if isinstance(p, _Packed) else p

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        seen.clear()
