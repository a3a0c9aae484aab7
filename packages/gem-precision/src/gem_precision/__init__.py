"""gem_precision: MXFP8 / FP8 quantization, low-precision linear layers and precision policies."""

from gem_precision.mx import MXTensor, mx_mm, random_hadamard, to_mx

__version__ = "0.1.0"

__all__ = ["MXTensor", "mx_mm", "random_hadamard", "to_mx"]
