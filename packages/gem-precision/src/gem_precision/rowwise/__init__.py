"""Row-wise FP8: quantizers with one fp32 scale per row (or per column, transposed) and the GEMMs on them.

:mod:`.ops` is the op face (checks, dispatch, the custom ops ``gem_precision::fp8_rowwise_mm`` and
``gem_precision::fp8_rowwise_dgrad_wgrad``, the shape fallback); :mod:`.reference` the PyTorch reference
(CPU path and test oracle); :mod:`.triton` the quantization kernels.
"""

from gem_precision.rowwise.ops import (
    FP8_ALIGN,
    MIN_FP8_DIM,
    fp8_rowwise_dgrad_wgrad,
    fp8_rowwise_mm,
    quantize_rowwise,
    quantize_rowwise_both,
    rowwise_fallback,
)

__all__ = [
    "FP8_ALIGN",
    "MIN_FP8_DIM",
    "fp8_rowwise_dgrad_wgrad",
    "fp8_rowwise_mm",
    "quantize_rowwise",
    "quantize_rowwise_both",
    "rowwise_fallback",
]
