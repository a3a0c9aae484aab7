"""``train.compile``: torch.compile applied per block, from outside the model (as torchtitan does), with the
jagged sizes dynamic and the compile caches on disk.

Recompiles: every batch has a different number of history events (``total``) and longest history
(``max_len``). Compiled with static shapes, each new value recompiles every layer (the base-h200 warm-up did
not finish in 230 s). Here the layers are compiled with ``dynamic=True``: the activations' sizes and the host
ints start symbolic, parameters stay static (``force_parameter_static_shapes``), and any size that meets a
static one (``d_model`` in a matmul with a weight) is specialised by a guard, so only the batch-dependent
sizes (``total``, ``max_len``, B) stay symbolic and one graph per layer *kind* serves every batch
(tests/test_train_compile.py counts them). The layers of a kind share the graph (``inline_inbuilt_nn_modules``
makes parameters graph inputs).

Caches: :func:`configure_compile_cache` points inductor's FX graph and autotune caches and Triton's kernel
and autotuning caches at one folder that outlives the run, so a second run of the same config loads the
compiled kernels and the attention kernels' tuning choices instead of redoing them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

__all__ = [
    "COMPILE_CACHE_ENV",
    "apply_compile",
    "compile_cache_dir",
    "compile_counters",
    "configure_compile_cache",
]

COMPILE_CACHE_ENV = "GEM_COMPILE_CACHE"


def apply_compile(
    model: nn.Module,
    *,
    dynamic: bool | None = True,
    backend: str | Callable[..., Any] = "inductor",
    cache_dir: str | os.PathLike[str] | None = None,
) -> nn.Module:
    """Compile each block of ``model.layers`` (a ``ModuleDict``), or the whole model if it has none.

    Per-block compilation fuses the norms, gates, casts and residual adds inside a layer while keeping
    graphs small (one compile serves all layers of a kind) and leaving the embedding collections and the
    jagged batch handling eager. ``nn.Module.compile`` works in place, so parameter names and checkpoint
    keys do not change (no ``_orig_mod.`` prefix).

    Args:
        dynamic: ``torch.compile``'s ``dynamic`` (True: batch-dependent sizes symbolic from the first
            compile, see the module doc; None: torch's automatic dynamic shapes, one extra recompile per
            size that changes).
        backend: ``torch.compile`` backend (``"aot_eager"`` or a counting backend in CPU tests).
        cache_dir: with the inductor backend, the compile caches go to
            :func:`configure_compile_cache` ``(cache_dir)`` (default: ``$GEM_COMPILE_CACHE`` or
            ``~/.cache/gem/compile``).

    Returns ``model``.
    """
    if backend == "inductor":
        configure_compile_cache(cache_dir)
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict) and len(layers) > 0:
        for layer in layers.values():
            layer.compile(dynamic=dynamic, backend=backend)
    else:
        model.compile(dynamic=dynamic, backend=backend)
    return model


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
    ``TORCHINDUCTOR_CACHE_DIR`` (``<dir>/inductor``: FX graph cache, autotuning of inductor's GEMM and
    pointwise kernels) and ``TRITON_CACHE_DIR`` (``<dir>/triton``: compiled kernels and autotuning results),
    turns on inductor's local FX graph and autotune caches and Triton's on-disk autotuning cache
    (``TRITON_CACHE_AUTOTUNING=1``). Triton reads that variable when an autotuner is created (gem_kernels
    creates them on import), so the autotuners already created in ``gem_kernels`` modules are switched to
    caching here too.
    """
    root = compile_cache_dir(path)
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    _cache_triton_autotuning()
    return root


def _cache_triton_autotuning() -> None:
    """Switch on the on-disk cache of the Triton autotuners that ``gem_kernels`` modules already created.

    Duck-typed (gem-train does not depend on Triton itself): any module-level object of a class named
    ``Autotuner`` with a ``cache_results`` flag. Under the interpreter Triton never caches (its own rule).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    for name, module in list(sys.modules.items()):
        if not name.startswith("gem_kernels") or module is None:
            continue
        for value in vars(module).values():
            if type(value).__name__ == "Autotuner" and hasattr(value, "cache_results"):
                value.cache_results = True


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
