"""gem_kernels: Triton kernels for recommendation models, with PyTorch references.

See the package README for the public API and the jagged-tensor conventions.
"""

from gem_kernels.attention import gdpa, jagged_flash_attention
from gem_kernels.block import block_attention
from gem_kernels.checks import set_debug
from gem_kernels.dispatch import get_backend, use_backend
from gem_kernels.jagged import (
    jagged_concat,
    jagged_last_k,
    jagged_mean,
    jagged_split,
    jagged_to_padded,
    padded_to_jagged,
)
from gem_kernels.prewarm import prewarm_triton
from gem_kernels.rotary import Rotary, apply_rotary
from gem_kernels.swiglu import swiglu_ffn

__version__ = "0.1.0"

__all__ = [
    "Rotary",
    "apply_rotary",
    "block_attention",
    "gdpa",
    "get_backend",
    "jagged_concat",
    "jagged_flash_attention",
    "jagged_last_k",
    "jagged_mean",
    "jagged_split",
    "jagged_to_padded",
    "padded_to_jagged",
    "prewarm_triton",
    "set_debug",
    "swiglu_ffn",
    "use_backend",
]
