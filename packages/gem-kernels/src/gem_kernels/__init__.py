"""gem_kernels: Triton kernels for recommendation models, with PyTorch references.

See the package README for the public API and the jagged-tensor conventions.
"""

from gem_kernels._checks import set_debug
from gem_kernels._dispatch import get_backend, use_backend
from gem_kernels.attention import gdpa, jagged_flash_attention

__version__ = "0.1.0"

__all__ = [
    "gdpa",
    "get_backend",
    "jagged_flash_attention",
    "set_debug",
    "use_backend",
]
