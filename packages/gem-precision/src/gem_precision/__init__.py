"""gem_precision: MXFP8 / FP8 quantization, low-precision linear layers and precision policies."""

from gem_precision.activations import compress_saved_activations
from gem_precision.convert import convert, default_skip
from gem_precision.dispatch import get_backend, use_backend
from gem_precision.linear import MXFP8Linear
from gem_precision.mx import MXTensor, mx_mm, random_hadamard, to_mx
from gem_precision.recipe import Recipe
from gem_precision.rowwise import (
    fp8_rowwise_dgrad_wgrad,
    fp8_rowwise_mm,
    quantize_rowwise,
    quantize_rowwise_both,
)
from gem_precision.weight_cache import cache_fp8_weights, invalidate_fp8_weights

__version__ = "0.1.0"

__all__ = [
    "MXFP8Linear",
    "MXTensor",
    "Recipe",
    "cache_fp8_weights",
    "compress_saved_activations",
    "convert",
    "default_skip",
    "fp8_rowwise_dgrad_wgrad",
    "fp8_rowwise_mm",
    "get_backend",
    "invalidate_fp8_weights",
    "mx_mm",
    "quantize_rowwise",
    "quantize_rowwise_both",
    "random_hadamard",
    "to_mx",
    "use_backend",
]
