"""Backend choice for every op: the Triton kernel or the PyTorch reference.

``auto`` (the default) runs Triton on CUDA tensors and the reference elsewhere. ``GEM_KERNELS_BACKEND``
or :func:`gem_kernels.use_backend` force one. Under ``TRITON_INTERPRET=1`` the Triton kernels also run
on CPU tensors (slowly), which is how CI tests them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "reference")
_backend = os.environ.get("GEM_KERNELS_BACKEND", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"GEM_KERNELS_BACKEND must be one of {BACKENDS}, got {_backend!r}")

HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``"triton"``, ``"reference"`` or ``"auto"`` inside a ``with`` block."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    old, _backend = _backend, name
    try:
        yield
    finally:
        _backend = old


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` should run its Triton kernel."""
    if _backend == "reference" or not HAS_TRITON:
        return False
    runnable = t.device.type == "cuda" or (triton_interpreted() and t.device.type == "cpu")
    if _backend == "triton":
        if not runnable:
            raise RuntimeError(
                f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got {t.device}"
            )
        return True
    return t.device.type == "cuda"
