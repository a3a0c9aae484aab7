"""Backend choice for every op of gem_precision: the Triton kernel or the PyTorch path.

``auto`` (the default) runs Triton on CUDA tensors and PyTorch elsewhere; ``GEM_PRECISION_BACKEND``,
:func:`use_backend`, or the ``backend=`` argument of an op that takes one, force one. Under
``TRITON_INTERPRET=1`` a forced ``triton`` also runs on CPU tensors (slowly), which is how CI tests the
kernels.

A documented copy: gem-kernels and gem-precision each carry this module, identical but for the package's
name and environment variable. Each package installs alone and neither may import the other
(tools/check_layers.py), and a module this small is no package of its own; tests/test_copied_modules.py at
the workspace root fails when the copies drift.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "GEM_PRECISION_BACKEND"
_backend = os.environ.get(ENV_VAR, "auto")
if _backend not in BACKENDS:
    raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {_backend!r}")

HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend(name: str) -> str:
    """``name`` if it is one of :data:`BACKENDS`; else a ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def get_backend() -> str:
    """The process-wide backend (``GEM_PRECISION_BACKEND``, or the innermost :func:`use_backend`)."""
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``"triton"``, ``"reference"`` or ``"auto"`` inside a ``with`` block."""
    global _backend
    old, _backend = _backend, check_backend(name)
    try:
        yield
    finally:
        _backend = old


def use_triton(t: torch.Tensor, backend: str = "auto") -> bool:
    """Whether an op on ``t`` should run its Triton kernel.

    ``backend`` is the op's own argument; ``"auto"`` defers to :func:`get_backend`.
    """
    name = check_backend(backend)
    if name == "auto":
        name = _backend
    if name == "reference" or not HAS_TRITON:
        return False
    if name == "triton":
        if not (t.device.type == "cuda" or (triton_interpreted() and t.device.type == "cpu")):
            raise RuntimeError(
                f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got {t.device}"
            )
        return True
    return t.device.type == "cuda"
