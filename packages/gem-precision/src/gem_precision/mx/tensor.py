"""``MXTensor``: FP8 elements with E8M0 block scales, the value type of the MX ops (:mod:`.ops`).

Its own module so that the Triton kernels (:mod:`.triton`) and :mod:`.dequantize` can name the type (for
annotations only) without importing the face that dispatches to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem_precision.formats import has_e8m0_dtype
from gem_precision.mx.dequantize import dequantize


@dataclass
class MXTensor:
    """A tensor in an MX format: FP8 elements and one E8M0 scale per block.

    Attributes:
        data: FP8 (``float8_e4m3fn`` or ``float8_e5m2``) tensor of the original shape.
        scale: uint8 E8M0 scales (``2**(b - 127)``, 255 = NaN). Shape: the original shape with the blocked
            dimension divided by ``block_size`` (rounded up); with ``square``, both last two dimensions.
        block_size: elements per block (per tile side with ``square``).
        axis: the blocked dimension (non-negative). Square data is valid blocked along either of the last
            two dimensions; ``axis`` then names the one it was requested for.
        orig_dtype: dtype of the quantized tensor; the default of :meth:`dequantize`.
        square: one scale per ``block_size x block_size`` tile of the last two dimensions.
        hadamard: ``[block_size, block_size]`` fp32 orthogonal matrix applied to each block before
            quantization (see :func:`random_hadamard`), or None.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int
    axis: int
    orig_dtype: torch.dtype
    square: bool = False
    hadamard: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def elem_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def scale_e8m0(self) -> torch.Tensor:
        """The scales viewed as ``torch.float8_e8m0fnu`` (needs torch >= 2.7; else raises)."""
        if not has_e8m0_dtype():
            raise RuntimeError("this torch has no torch.float8_e8m0fnu; use .scale (uint8 E8M0)")
        return self.scale.view(torch.float8_e8m0fnu)

    def blocked_along(self, dim: int) -> bool:
        """Whether the data is valid MX data blocked along ``dim``."""
        dim = dim % self.data.dim()
        if self.square:
            return dim >= self.data.dim() - 2
        return dim == self.axis

    def dequantize(self, dtype: torch.dtype | None = None, *, backend: str = "auto") -> torch.Tensor:
        """The values ``data * scale`` (Hadamard undone) in ``dtype`` (default: ``orig_dtype``), on the
        Triton kernel or the reference per ``backend`` (as for :func:`gem_precision.to_mx`)."""
        return dequantize(self, dtype or self.orig_dtype, backend)

    def t(self) -> MXTensor:
        """The transpose of a 2-D MXTensor (a view: the data stays blocked along the same elements)."""
        if self.data.dim() != 2:
            raise ValueError(f"MXTensor.t() needs 2-D data, got shape {tuple(self.data.shape)}")
        return MXTensor(
            self.data.t(),
            self.scale.t(),
            self.block_size,
            1 - self.axis,
            self.orig_dtype,
            self.square,
            self.hadamard,
        )
