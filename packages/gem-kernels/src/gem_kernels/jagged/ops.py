"""The op face of the jagged helpers: jagged <-> padded dense, per-sequence concat/split, mean and last-k
pooling.

Layout: values ``[total, *F]`` (any trailing feature shape, floating dtype) plus offsets ``[B+1]``.
Each public function validates, flattens the features to ``[total, F]`` and calls a custom op
(``gem_kernels::jagged_*``, with fake implementations and autograd). The ops choose their path per
call:

* ``jagged_to_padded`` / ``padded_to_jagged``: fbgemm's ``jagged_to_padded_dense`` /
  ``dense_to_jagged`` when ``torch.ops.fbgemm`` has them (i.e. someone imported ``fbgemm_gpu``; this
  package never imports it) and the backend is ``auto``; else the Triton kernels on CUDA; else PyTorch.
* ``jagged_mean``: a Triton segment-sum kernel on CUDA (the PyTorch ``index_add_`` path pays for
  atomics), PyTorch elsewhere.
* the others: PyTorch index arithmetic on every device (a gather or scatter per token row).

No op synchronises with the GPU on the non-debug path, except where a host int is left out
(``padded_to_jagged(total=None)``, ``jagged_split(a_total=None)`` read one offset back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gem_kernels.checks import FLOAT_DTYPES, check_offsets, check_same, debug_enabled
from gem_kernels.dispatch import get_backend, use_triton
from gem_kernels.jagged import reference as ref

__all__ = [
    "jagged_concat",
    "jagged_last_k",
    "jagged_mean",
    "jagged_split",
    "jagged_to_padded",
    "padded_to_jagged",
]


def _fbgemm_op(name: str, t: torch.Tensor) -> Callable[..., Any] | None:
    """``torch.ops.fbgemm.<name>`` if fbgemm_gpu has been loaded, the backend is auto and fbgemm
    supports ``t``'s dtype (not fp64 on the CPU); else None."""
    if get_backend() != "auto" or t.dtype == torch.float64:
        return None
    try:
        op: Callable[..., Any] = getattr(torch.ops.fbgemm, name)
        return op
    except (AttributeError, RuntimeError):
        return None


# --- jagged <-> padded ----------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::jagged_to_padded", mutates_args=())
def _jagged_to_padded_op(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float
) -> torch.Tensor:
    fb = _fbgemm_op("jagged_to_padded_dense", values)
    if fb is not None:
        padded: torch.Tensor = fb(values, [offsets.long()], [max_len], padding_value)
        return padded
    if values.dtype != torch.float64 and use_triton(values):
        from gem_kernels.jagged.triton import jagged_to_padded_triton

        return jagged_to_padded_triton(values, offsets, max_len, padding_value)
    return ref.jagged_to_padded(values, offsets, max_len, padding_value)


@_jagged_to_padded_op.register_fake
def _(values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float) -> torch.Tensor:
    return values.new_empty((offsets.shape[0] - 1, max_len, values.shape[1]))


@torch.library.custom_op("gem_kernels::padded_to_jagged", mutates_args=())
def _padded_to_jagged_op(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    fb = _fbgemm_op("dense_to_jagged", padded)
    if fb is not None:
        jagged: torch.Tensor = fb(padded, [offsets.long()], total)[0]
        return jagged
    if padded.dtype != torch.float64 and use_triton(padded):
        from gem_kernels.jagged.triton import padded_to_jagged_triton

        return padded_to_jagged_triton(padded, offsets, total)
    return ref.padded_to_jagged(padded, offsets, total)


@_padded_to_jagged_op.register_fake
def _(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    return padded.new_empty((total, padded.shape[2]))


def _j2p_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    values, offsets, _, _ = inputs
    ctx.save_for_backward(offsets)
    ctx.total = values.shape[0]


def _j2p_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (offsets,) = ctx.saved_tensors
    return _padded_to_jagged_op(grad.contiguous(), offsets, ctx.total), None, None, None


def _p2j_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    padded, offsets, _ = inputs
    ctx.save_for_backward(offsets)
    ctx.n = padded.shape[1]


def _p2j_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (offsets,) = ctx.saved_tensors
    return _jagged_to_padded_op(grad.contiguous(), offsets, ctx.n, 0.0), None, None


_jagged_to_padded_op.register_autograd(_j2p_backward, setup_context=_j2p_setup)
_padded_to_jagged_op.register_autograd(_p2j_backward, setup_context=_p2j_setup)


# --- concat / split ---------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::jagged_concat", mutates_args=())
def _jagged_concat_op(
    a: torch.Tensor, a_offsets: torch.Tensor, b: torch.Tensor, b_offsets: torch.Tensor
) -> torch.Tensor:
    return ref.jagged_concat(a, a_offsets, b, b_offsets)


@_jagged_concat_op.register_fake
def _(a: torch.Tensor, a_offsets: torch.Tensor, b: torch.Tensor, b_offsets: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0] + b.shape[0], a.shape[1]))


@torch.library.custom_op("gem_kernels::jagged_split", mutates_args=())
def _jagged_split_op(
    values: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor, a_total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.jagged_split(values, a_offsets, b_offsets, a_total)


@_jagged_split_op.register_fake
def _(
    values: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor, a_total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    feat = values.shape[1]
    return values.new_empty((a_total, feat)), values.new_empty((values.shape[0] - a_total, feat))


def _concat_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    a, a_offsets, _, b_offsets = inputs
    ctx.save_for_backward(a_offsets, b_offsets)
    ctx.a_total = a.shape[0]


def _concat_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    a_offsets, b_offsets = ctx.saved_tensors
    ga, gb = _jagged_split_op(grad.contiguous(), a_offsets, b_offsets, ctx.a_total)
    return ga, None, gb, None


def _split_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, a_offsets, b_offsets, _ = inputs
    ctx.save_for_backward(a_offsets, b_offsets)


def _split_backward(ctx: Any, ga: torch.Tensor, gb: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    a_offsets, b_offsets = ctx.saved_tensors
    return _jagged_concat_op(ga.contiguous(), a_offsets, gb.contiguous(), b_offsets), None, None, None


_jagged_concat_op.register_autograd(_concat_backward, setup_context=_concat_setup)
_jagged_split_op.register_autograd(_split_backward, setup_context=_split_setup)


# --- pooling ----------------------------------------------------------------------------------------


@torch.library.custom_op("gem_kernels::jagged_mean", mutates_args=())
def _jagged_mean_op(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if values.dtype != torch.float64 and use_triton(values):
        from gem_kernels.jagged.triton import jagged_mean_triton

        return jagged_mean_triton(values, offsets)
    return ref.jagged_mean(values, offsets)


@_jagged_mean_op.register_fake
def _(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return values.new_empty((offsets.shape[0] - 1, values.shape[1]))


def _mean_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    values, offsets = inputs
    ctx.save_for_backward(offsets)
    ctx.total = values.shape[0]


def _mean_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (offsets,) = ctx.saved_tensors
    return ref.jagged_mean_backward(grad, offsets, ctx.total), None


_jagged_mean_op.register_autograd(_mean_backward, setup_context=_mean_setup)


@torch.library.custom_op("gem_kernels::jagged_last_k", mutates_args=())
def _jagged_last_k_op(
    values: torch.Tensor, offsets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.jagged_last_k(values, offsets, k)


@_jagged_last_k_op.register_fake
def _(values: torch.Tensor, offsets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch = offsets.shape[0] - 1
    return values.new_empty((batch, k, values.shape[1])), values.new_empty((batch, k), dtype=torch.bool)


def _last_k_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    values, offsets, _ = inputs
    ctx.save_for_backward(offsets)
    ctx.total = values.shape[0]
    ctx.mark_non_differentiable(output[1])


def _last_k_backward(
    ctx: Any, grad: torch.Tensor, _grad_mask: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    (offsets,) = ctx.saved_tensors
    return ref.jagged_last_k_backward(grad, offsets, ctx.total), None, None


_jagged_last_k_op.register_autograd(_last_k_backward, setup_context=_last_k_setup)


# --- public API -------------------------------------------------------------------------------------


def _check_jagged(name: str, values: torch.Tensor) -> None:
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() < 1:
        raise ValueError(f"{name} must have shape [total, *F], got a 0-d tensor")
    if values.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a dtype in {[str(d) for d in FLOAT_DTYPES]}, got {values.dtype}")


def _check_int(name: str, value: object, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _flat(values: torch.Tensor) -> torch.Tensor:
    """``[n, *F]`` -> contiguous ``[n, prod(F)]`` (explicit size: -1 is ambiguous when n is 0)."""
    return values.reshape(values.shape[0], math.prod(values.shape[1:])).contiguous()


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float = 0.0
) -> torch.Tensor:
    """Jagged ``[total, *F]`` -> padded dense ``[B, max_len, *F]``.

    Positions past a sequence's end hold ``padding_value``; tokens past ``max_len`` are dropped
    (so ``max_len`` may truncate). Differentiable in ``values``.
    """
    _check_jagged("values", values)
    _check_int("max_len", max_len)
    check_offsets("offsets", offsets, total=values.shape[0], device=values.device)
    if isinstance(padding_value, bool) or not isinstance(padding_value, (int, float)):
        raise ValueError(f"padding_value must be a number, got {padding_value!r}")
    out: torch.Tensor = _jagged_to_padded_op(_flat(values), offsets, max_len, float(padding_value))
    return out.view(out.shape[0], max_len, *values.shape[1:])


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Padded dense ``[B, N, *F]`` -> jagged ``[total, *F]`` (the adjoint of :func:`jagged_to_padded`).

    Token ``p`` of sequence ``b`` is ``padded[b, p]``; positions ``p >= N`` of longer sequences get 0.
    ``total`` (= ``offsets[-1]``) should be passed as a host int on CUDA: ``None`` reads it back
    (a GPU sync). Differentiable in ``padded``.
    """
    _check_jagged("padded", padded)
    if padded.dim() < 2:
        raise ValueError(f"padded must have shape [B, N, *F], got {tuple(padded.shape)}")
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
    if total is None:
        total = int(offsets[-1]) if offsets.numel() else 0
    _check_int("total", total)
    check_offsets("offsets", offsets, total=total, device=padded.device, batch=padded.shape[0])
    batch, n = padded.shape[:2]
    flat = padded.reshape(batch, n, math.prod(padded.shape[2:])).contiguous()
    out: torch.Tensor = _padded_to_jagged_op(flat, offsets, total)
    return out.view(total, *padded.shape[2:])


def jagged_concat(
    a: torch.Tensor, a_offsets: torch.Tensor, b: torch.Tensor, b_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate two jagged tensors per sequence: sequence ``s`` of the result is ``[a_s ; b_s]``.

    Args:
        a: ``[Ta, *F]``; b: ``[Tb, *F]`` with the same features, dtype and device.
        a_offsets, b_offsets: ``[B+1]`` offsets of a and b (same B).

    Returns:
        ``(values [Ta + Tb, *F], offsets = a_offsets + b_offsets)``. Differentiable in a and b.
    """
    _check_jagged("a", a)
    _check_jagged("b", b)
    check_same(("a", "b"), (a, b), "dtype")
    check_same(("a", "b"), (a, b), "device")
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(
            f"a and b must have the same feature shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    check_offsets("a_offsets", a_offsets, total=a.shape[0], device=a.device)
    check_offsets("b_offsets", b_offsets, total=b.shape[0], device=b.device, batch=a_offsets.numel() - 1)
    values = _jagged_concat_op(_flat(a), a_offsets, _flat(b), b_offsets)
    return values.view(values.shape[0], *a.shape[1:]), a_offsets + b_offsets


def jagged_split(
    values: torch.Tensor,
    offsets: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    *,
    a_total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`jagged_concat`: split each sequence into its first ``len(a_s)`` tokens and the rest.

    Args:
        values: ``[total, *F]`` with ``offsets = a_offsets + b_offsets`` (``[B+1]`` each).
        a_total: host int ``a_offsets[-1]``; pass it on CUDA (``None`` reads it back: a GPU sync).

    Returns:
        ``(a [Ta, *F], b [Tb, *F])``. Differentiable in ``values``.
    """
    _check_jagged("values", values)
    check_offsets("offsets", offsets, total=values.shape[0], device=values.device)
    if a_total is None:
        a_total = int(a_offsets[-1]) if isinstance(a_offsets, torch.Tensor) and a_offsets.numel() else 0
    _check_int("a_total", a_total)
    if a_total > values.shape[0]:
        raise ValueError(f"a_total={a_total} exceeds the {values.shape[0]} tokens of values")
    batch = offsets.numel() - 1
    check_offsets("a_offsets", a_offsets, total=a_total, device=values.device, batch=batch)
    check_offsets("b_offsets", b_offsets, total=values.shape[0] - a_total, device=values.device, batch=batch)
    # A value check like check_offsets': on the CPU or in debug mode, and not inside a traced graph.
    wanted = (values.device.type == "cpu" or debug_enabled()) and not torch.compiler.is_compiling()
    if wanted and not torch.equal(offsets.long(), (a_offsets + b_offsets).long()):
        raise ValueError("offsets must equal a_offsets + b_offsets")
    a, b = _jagged_split_op(_flat(values), a_offsets, b_offsets, a_total)
    return a.view(a_total, *values.shape[1:]), b.view(b.shape[0], *values.shape[1:])


def jagged_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence: ``[total, *F]`` -> ``[B, *F]`` (0 for an empty sequence).

    Sums in fp32 (fp64 for fp64 values) and rounds once. Differentiable in ``values``.
    """
    _check_jagged("values", values)
    check_offsets("offsets", offsets, total=values.shape[0], device=values.device)
    out: torch.Tensor = _jagged_mean_op(_flat(values), offsets)
    return out.view(out.shape[0], *values.shape[1:])


def jagged_last_k(values: torch.Tensor, offsets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The most recent ``k`` tokens of each sequence: ``([B, k, *F], mask [B, k] bool)``.

    Left-aligned: slot 0 holds the oldest of the last ``min(len, k)`` tokens, in sequence order,
    so the newest token sits at slot ``min(len, k) - 1``; slots past it are 0 and ``mask`` is False
    there. Differentiable in ``values``.
    """
    _check_jagged("values", values)
    _check_int("k", k)
    check_offsets("offsets", offsets, total=values.shape[0], device=values.device)
    out, mask = _jagged_last_k_op(_flat(values), offsets, k)
    return out.view(out.shape[0], k, *values.shape[1:]), mask
