"""Per-layer ``torch.compile`` with the jagged sizes dynamic and the compile caches on disk: the one compile
path of gem, used by :func:`gem_parallel.parallelize` on one rank and on many.

Recompiles: every jagged batch has a different number of events (``total``) and longest sequence
(``max_len``). Compiled with static shapes, each new value recompiles every layer (a base-h200 warm-up did not
finish in 230 s). So layers are compiled with ``dynamic=True`` (:data:`DYNAMIC`): the activations' sizes and
the host ints start symbolic, parameters stay static (``force_parameter_static_shapes``), and any size that
meets a static one (``d_model`` in a matmul with a weight) is specialised by a guard; only the
batch-dependent sizes stay symbolic, and one graph per layer *kind* serves every batch. Layers of a kind share
the graph (``inline_inbuilt_nn_modules`` makes parameters graph inputs).

Two forms, one set of options:

- :func:`compile_layers`: ``nn.Module.compile`` of each block of ``model.layers`` in place (no
  ``_orig_mod.`` prefix: parameter names and checkpoint keys do not change), or of the whole model when it
  has no blocks. What runs when no activation checkpointing wraps the layers.
- :func:`compile_function`: ``torch.compile`` of a function taking the module as an argument; the activation
  checkpointing regions (:mod:`gem_parallel.activation_checkpoint`) compile their policy function with it, so
  the checkpoint is traced inside the compiled graph.

Caches: :func:`configure_compile_cache` points inductor's FX graph and autotune caches and Triton's kernel
cache at one folder that outlives the run (``$GEM_COMPILE_CACHE``, default ``~/.cache/gem/compile``), so a
second run of the same config loads its compiled kernels instead of building them again. (The tuning choices
of gem-kernels' own kernels live in gem-kernels' cache, ``gem_kernels.tune_cache``.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "COMPILE_CACHE_ENV",
    "DYNAMIC",
    "compile_cache_dir",
    "compile_counters",
    "compile_function",
    "compile_layers",
    "configure_compile_cache",
]

COMPILE_CACHE_ENV = "GEM_COMPILE_CACHE"
# torch.compile's ``dynamic`` for every compiled layer (see the module docstring).
DYNAMIC = True


def compile_layers(
    model: nn.Module,
    *,
    backend: str | Callable[..., Any] = "inductor",
    cache_dir: str | os.PathLike[str] | None = None,
    dynamic: bool | None = DYNAMIC,
) -> nn.Module:
    """Compile each block of ``model.layers`` (a ``ModuleDict``/``ModuleList``) in place, or the whole model
    if it has none; the embeddings, input projections and heads around the blocks stay eager.

    Args:
        backend: ``torch.compile`` backend (``"aot_eager"`` or a counting backend in CPU tests).
        cache_dir: with the inductor backend, the compile caches go to :func:`configure_compile_cache`
            ``(cache_dir)``.
        dynamic: ``torch.compile``'s ``dynamic``; anything but :data:`DYNAMIC` is for measuring the choice
            (None: torch's automatic dynamic shapes, one recompile per size that changes).

    Returns ``model``.
    """
    if backend == "inductor":
        configure_compile_cache(cache_dir)
    layers = getattr(model, "layers", None)
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else layers
    if isinstance(blocks, list | nn.ModuleList) and len(blocks) > 0:
        for layer in blocks:
            layer.compile(dynamic=dynamic, backend=backend)
    else:
        model.compile(dynamic=dynamic, backend=backend)
    return model


def compile_function(
    fn: Callable[..., Any], *, backend: str | Callable[..., Any] = "inductor"
) -> Callable[..., Any]:
    """``torch.compile(fn)`` with the options of :func:`compile_layers` (the caches configured first)."""
    if backend == "inductor":
        configure_compile_cache()
    return torch.compile(fn, dynamic=DYNAMIC, backend=backend)


def compile_cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The compile cache folder: ``path`` if given, else ``$GEM_COMPILE_CACHE``, else
    ``$XDG_CACHE_HOME/gem/compile`` (``~/.cache/gem/compile``)."""
    if path:
        return Path(path).expanduser()
    env = os.environ.get(COMPILE_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gem" / "compile"


def configure_compile_cache(path: str | os.PathLike[str] | None = None) -> Path:
    """Persist compilation across runs in :func:`compile_cache_dir` ``(path)``; returns the folder.

    Call before the first compiled step. Sets (unless already set in the environment)
    ``TORCHINDUCTOR_CACHE_DIR`` (``<dir>/inductor``: the FX graph cache and the autotuning of inductor's
    GEMM and pointwise kernels) and ``TRITON_CACHE_DIR`` (``<dir>/triton``: compiled Triton kernels), and
    turns on inductor's local FX graph and autotune caches.
    """
    root = compile_cache_dir(path)
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    return root


def compile_counters() -> dict[str, int]:
    """Dynamo's frame counters (``frames.ok``: graphs compiled, ``recompiles``), for warm-up reports."""
    from torch._dynamo.utils import counters

    return {
        "frames_ok": int(counters["frames"]["ok"]),
        "frames_total": int(counters["frames"]["total"]),
        "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
    }
