"""Jagged helpers: jagged <-> padded dense, per-sequence concat/split, mean and last-k pooling.

:mod:`.ops` is the op face; :mod:`.reference` the PyTorch paths (CPU path, CUDA fallback, test oracle);
:mod:`.triton` the Triton copy and segment-sum kernels, and the ``@triton.jit`` helpers that map a work
item to its sequence (``segment_of_item``, ``segment_bounds``), which block attention and the split
one-tile attention backward share.
"""

from gem_kernels.jagged.ops import (
    jagged_concat,
    jagged_last_k,
    jagged_mean,
    jagged_split,
    jagged_to_padded,
    padded_to_jagged,
)

__all__ = [
    "jagged_concat",
    "jagged_last_k",
    "jagged_mean",
    "jagged_split",
    "jagged_to_padded",
    "padded_to_jagged",
]
