"""Packed 8-bit rows: a weight's rows quantized to E4M3, each followed by its scale bytes, in one ``uint8``
tensor (the payload of gem-parallel's 8-bit FSDP all-gather).

:mod:`.ops` is the op face (checks, dispatch); :mod:`.reference` the PyTorch reference (CPU path, test
oracle, the layout); :mod:`.triton` the kernels (one launch to quantize any number of shards, one to
dequantize).
"""

from gem_precision.packed.ops import (
    PACKED_FORMATS,
    dequantize_packed,
    packed_width,
    quantize_packed,
    quantize_packed_many,
)

__all__ = ["PACKED_FORMATS", "dequantize_packed", "packed_width", "quantize_packed", "quantize_packed_many"]
