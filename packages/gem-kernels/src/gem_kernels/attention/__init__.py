"""Jagged attention: softmax (flash) attention and GDPA over variable-length sequences.

Public entry points are :func:`jagged_flash_attention` and :func:`gdpa` (re-exported by
:mod:`gem_kernels`); :mod:`.reference` holds the per-sequence PyTorch references.
"""

from gem_kernels.attention.activations import GDPA_ACTIVATIONS
from gem_kernels.attention.ops import gdpa, jagged_flash_attention

__all__ = ["GDPA_ACTIVATIONS", "gdpa", "jagged_flash_attention"]
