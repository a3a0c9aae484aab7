"""The SwiGLU feed-forward ``W2 (silu(W1 x) * W3 x)`` with its backward's first GEMM and activation fused.

:mod:`.ops` is the op face (the autograd function, the custom op, dispatch); :mod:`.reference` the PyTorch
reference (the test oracle and the CPU path); :mod:`.triton` the fused backward kernel.
"""

from gem_kernels.swiglu.ops import swiglu_ffn

__all__ = ["swiglu_ffn"]
