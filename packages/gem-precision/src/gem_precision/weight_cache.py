"""Cached FP8 casts of weights: an ``fp8_rowwise`` layer's weight is quantized once per optimizer step, not
in every GEMM that reads it.

A layer's forward GEMM reads ``w`` row-wise (``[N, K]``, K = in) and its dgrad GEMM reads ``w`` column-wise
(stored ``[K, N]``); without the cache both are cast in every call: forward and backward of every
micro-step, the recomputed forward of activation checkpointing, every evaluation batch. The weight does not
change between two optimizer steps, so :func:`cache_fp8_weights` keeps both copies (of ``weight.to(dtype)``,
the bytes the GEMMs would make) in non-persistent buffers of each :class:`~gem_precision.MXFP8Linear` and a
forward pre-hook on the model refreshes them, in place, when they are stale:

- after any optimizer step (a global ``torch.optim`` step post-hook bumps a generation counter: fused AdamW
  updates parameters without moving their version counters, so versions alone cannot tell);
- when the weight's version counter or storage changed (``load_state_dict``, ``copy_``, ``to``);
- for a layer whose weight is a ``DTensor`` (FSDP2, expert parallelism) the cache is dropped: such a layer
  gathers its weight inside its own forward, after the model's pre-hook ran, so it keeps casting per call.

The refresh runs eagerly (``torch.compiler.disable``) before the compiled blocks, which see the buffers as
inputs. It decides on the host, so a CUDA graph captured over the forward replays whatever the capture did:
call :func:`invalidate_fp8_weights` before capturing (the cast is then in the graph, run on every replay).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from gem_precision.linear import MXFP8Linear
from gem_precision.rowwise import FP8_ALIGN, quantize_rowwise

__all__ = ["cache_fp8_weights", "cached_layers", "invalidate_fp8_weights"]

_GENERATION = itertools.count(1)
_current = [0]  # the generation now: bumped by every optimizer step
_hook: list[RemovableHandle] = []


def _bump(*_: Any) -> None:
    _current[0] = next(_GENERATION)


def _uses_cache(layer: MXFP8Linear) -> bool:
    r = layer.layer_recipe
    return r.forward == "fp8_rowwise" or r.dgrad == "fp8_rowwise"


def cached_layers(model: nn.Module) -> list[MXFP8Linear]:
    """The layers of ``model`` that hold a weight-cast cache."""
    return [m for m in model.modules() if isinstance(m, MXFP8Linear) and m.fp8_cache_dtype is not None]


def cache_fp8_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> RemovableHandle | None:
    """Cache the FP8 weight casts of every :class:`~gem_precision.MXFP8Linear` of ``model`` whose forward or
    dgrad GEMM runs ``fp8_rowwise``, for GEMMs in ``dtype`` (the autocast dtype; a call in another dtype
    casts as before). Returns the handle of the model's refresh pre-hook (None if no layer qualifies)."""
    layers = [m for m in model.modules() if isinstance(m, MXFP8Linear) and _uses_cache(m)]
    if not layers:
        return None
    if not _hook:
        _hook.append(register_optimizer_step_post_hook(_bump))
    for layer in layers:
        layer.fp8_cache_dtype = dtype
        layer.fp8_cache_key = None
    return model.register_forward_pre_hook(_refresh_hook)


def invalidate_fp8_weights(model: nn.Module) -> None:
    """Mark every cached cast of ``model`` stale: the next forward recasts them."""
    for layer in cached_layers(model):
        layer.fp8_cache_key = None


def _refresh_hook(model: nn.Module, args: Any) -> None:
    _refresh_eagerly(model)


@torch.no_grad()
def refresh_fp8_weights(model: nn.Module) -> None:
    """Recast the stale cached weights of ``model`` (see the module docstring); runs before each forward."""
    from torch.distributed.tensor import DTensor

    for layer in cached_layers(model):
        w = layer.weight
        if isinstance(w, DTensor) or not isinstance(w, torch.Tensor):
            layer.fp8_cache_dtype = None  # sharded: gathered inside its own forward
            layer.drop_fp8_weight_cache()
            continue
        key = (_current[0], w._version, w.data_ptr(), w.device, layer.layer_recipe.elem_dtype)
        if key == layer.fp8_cache_key:
            continue
        assert layer.fp8_cache_dtype is not None
        w16 = w.detach().to(layer.fp8_cache_dtype)
        elem = layer.layer_recipe.elem_dtype
        copies = (
            quantize_rowwise(w16, elem, k_multiple=FP8_ALIGN),
            quantize_rowwise(w16, elem, transpose=True, k_multiple=FP8_ALIGN),
        )
        layer.set_fp8_weight_cache(*copies[0], *copies[1])
        layer.fp8_cache_key = key


# The hook's refresh runs eagerly even inside a compiled region (a graph break around it): its decisions
# read version counters and storage pointers on the host.
_refresh_eagerly = cast(Callable[[nn.Module], None], torch.compiler.disable(refresh_fp8_weights))  # type: ignore[no-untyped-call]
