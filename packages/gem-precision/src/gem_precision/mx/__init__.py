"""MX (OCP Microscaling) quantization: ``to_mx``, the exact block-scaled GEMM ``mx_mm``, ``MXTensor``.

:mod:`.ops` is the op face (checks, dispatch); :mod:`.tensor` the value type; :mod:`.dequantize` its
dispatched dequantization; :mod:`.reference` the PyTorch reference (CPU path and test oracle, tested bit for
bit against a float64 reading of the spec); :mod:`.triton` the Triton kernels.
"""

from gem_precision.mx.ops import BACKENDS, TRITON_BLOCK_SIZES, mx_mm, random_hadamard, to_mx
from gem_precision.mx.tensor import MXTensor

__all__ = ["BACKENDS", "TRITON_BLOCK_SIZES", "MXTensor", "mx_mm", "random_hadamard", "to_mx"]
