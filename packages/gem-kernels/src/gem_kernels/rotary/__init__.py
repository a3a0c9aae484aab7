"""Rotary position embeddings (RoPE) on jagged tensors, and the ``Rotary`` spec of block attention.

:mod:`.ops` is the op face; :mod:`.reference` the PyTorch reference (the test oracle, and the one source of
the frequencies); :mod:`.cpu` the CPU path (the reference's arithmetic in fewer passes); :mod:`.triton` the
Triton kernel and the FMA-only sin/cos that block attention's fused rotary shares.
"""

from gem_kernels.rotary.ops import Rotary, apply_rotary

__all__ = ["Rotary", "apply_rotary"]
