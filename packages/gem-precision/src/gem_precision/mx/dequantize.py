"""``dequantize``: MX data and scales back to floats, dispatched (:mod:`gem_precision.dispatch`) to the
Triton kernel (:func:`.triton.dequantize_triton`: 2-D, no Hadamard transform) or the PyTorch reference.

Its own module below :mod:`.tensor`, so that ``MXTensor.dequantize`` goes through dispatch without the
type and the ops importing each other: this module names ``MXTensor`` for its annotations only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gem_precision.dispatch import use_triton
from gem_precision.mx import reference

if TYPE_CHECKING:
    from gem_precision.mx.tensor import MXTensor


def dequantize(x: MXTensor, dtype: torch.dtype, backend: str = "auto") -> torch.Tensor:
    """The values ``x.data * scale`` (the Hadamard transform undone) in ``dtype``.

    The kernel (2-D data without a Hadamard transform, a floating ``dtype``) gives the same bits as the
    reference: each value is an exact fp32 product, then cast once. ``backend`` as for :func:`.ops.to_mx`.
    """
    kernel_shape = x.data.dim() == 2 and x.hadamard is None and dtype.is_floating_point
    if kernel_shape and use_triton(x.data, backend):
        from gem_precision.mx.triton import dequantize_triton

        return dequantize_triton(x, dtype)
    out = reference.dequantize_reference(
        x.data, x.scale, axis=x.axis, block_size=x.block_size, square=x.square, hadamard=x.hadamard
    )
    return out.to(dtype)
