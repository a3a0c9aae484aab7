"""Block attention: softmax attention within fixed-size blocks of each jagged sequence, rotary fused.

:mod:`.ops` is the op face (checks, custom ops, autograd, FLOP formula, dispatch); :mod:`.reference` the
PyTorch reference (CPU path and test oracle); :mod:`.triton` the Triton kernels and their launch.
"""

from gem_kernels.block.ops import block_attention

__all__ = ["block_attention"]
