"""Jagged attention: softmax attention (``jagged_flash_attention``) and GDPA (``gdpa``).

- :mod:`.ops`: the op face (checks, custom ops, autograd, FLOP formulas, dispatch).
- :mod:`.reference`: the per-sequence PyTorch oracle; :mod:`.cpu`: the vectorized PyTorch path the ops run
  off CUDA; :mod:`.activations`: GDPA's activations.
- :mod:`.triton`: the Triton kernels, split by job, and their launchers (imported only when a kernel runs).
- :mod:`.variants`: which implementation and which blocks run (the ``auto`` choice, the candidate tables).
- :mod:`.testing`: what tests and benchmarks may force (variant, blocks, split chunk) and read back.
"""

from gem_kernels.attention.ops import GDPA_ACTIVATIONS, gdpa, jagged_flash_attention

__all__ = ["GDPA_ACTIVATIONS", "gdpa", "jagged_flash_attention"]
