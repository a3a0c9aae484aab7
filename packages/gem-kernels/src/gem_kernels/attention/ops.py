"""The op face of jagged attention: validation, torch.library registration, dispatch, autograd, FLOPs.

Two custom ops carry both families (softmax attention and GDPA):

- ``gem_kernels::jagged_attention_fwd(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, activation,
  left, right, qk_scale, out_scale) -> (out, lse)``
- ``gem_kernels::jagged_attention_bwd(dout, q, k, v, out, lse, ...) -> (dq, dk, dv)``

Each runs the Triton kernels (:mod:`gem_kernels.attention.triton.launch`) when
:func:`gem_kernels.dispatch.use_triton` says so and the vectorized PyTorch path
(:mod:`gem_kernels.attention.cpu`; :mod:`gem_kernels.attention.reference` holds the per-sequence oracle)
otherwise. Both have fake
implementations (so ``torch.compile`` traces through them without a graph break) and FLOP formulas (so
``torch.utils.flop_counter.FlopCounterMode`` counts them). Double backward is not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from gem_kernels.attention import cpu, reference
from gem_kernels.attention.activations import GDPA_ACTIVATIONS, canonical_activation
from gem_kernels.checks import check_offsets, check_same, check_values
from gem_kernels.dispatch import get_backend, use_triton

__all__ = ["GDPA_ACTIVATIONS", "gdpa", "jagged_flash_attention"]

# --------------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------------


MAX_TRITON_HEAD_DIM = 256


def _on_triton(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the op runs the Triton kernels (else the vectorized PyTorch path).

    fp64 and head dims above 256 always take the PyTorch path (an error if the triton backend is forced).
    The kernel module is imported lazily by the callers, so that importing gem_kernels does not import
    Triton."""
    if not use_triton(q):
        return False
    if q.dtype == torch.float64 or max(q.shape[2], v.shape[2]) > MAX_TRITON_HEAD_DIM:
        if get_backend() == "triton":
            raise NotImplementedError(
                f"the triton attention kernels take fp32/fp16/bf16 and head dims <= {MAX_TRITON_HEAD_DIM}, "
                f"got {q.dtype}, D={q.shape[2]}, Dv={v.shape[2]}"
            )
        return False
    return True


@torch.library.custom_op("gem_kernels::jagged_attention_fwd", mutates_args=())
def _attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    activation: str,
    left: int,
    right: int,
    qk_scale: float,
    out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_triton(q, v):
        from gem_kernels.attention.triton import launch

        return launch.attention_fwd(
            q,
            k,
            v,
            q_offsets,
            kv_offsets,
            max_q_len,
            max_kv_len,
            activation,
            left,
            right,
            qk_scale,
            out_scale,
        )
    return cpu.attention_fwd(q, k, v, q_offsets, kv_offsets, activation, left, right, qk_scale, out_scale)


@_attention_fwd.register_fake
def _attention_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    activation: str,
    left: int,
    right: int,
    qk_scale: float,
    out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse_shape = (q.shape[0], q.shape[1]) if activation == reference.SOFTMAX else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("gem_kernels::jagged_attention_bwd", mutates_args=())
def _attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    activation: str,
    left: int,
    right: int,
    qk_scale: float,
    out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _on_triton(q, v):
        from gem_kernels.attention.triton import launch

        return launch.attention_bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            q_offsets,
            kv_offsets,
            max_q_len,
            max_kv_len,
            activation,
            left,
            right,
            qk_scale,
            out_scale,
        )
    return cpu.attention_bwd(
        dout, q, k, v, q_offsets, kv_offsets, activation, left, right, qk_scale, out_scale, out, lse
    )


@_attention_bwd.register_fake
def _attention_bwd_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Contiguous whatever the inputs' strides, as both implementations return.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_STATIC = ("max_q_len", "max_kv_len", "activation", "left", "right", "qk_scale", "out_scale")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, q_offsets, kv_offsets, *static = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, q_offsets, kv_offsets, out, lse)
    ctx.static = static
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, q_offsets, kv_offsets, out, lse = ctx.saved_tensors
    if dout is None:
        return (None,) * (5 + len(_STATIC))
    dq, dk, dv = _attention_bwd(dout.contiguous(), q, k, v, out, lse, q_offsets, kv_offsets, *ctx.static)
    return (dq, dk, dv) + (None,) * (2 + len(_STATIC))


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# FLOP formulas: 2 flops per multiply-add, over the valid (query, key) pairs only.
# --------------------------------------------------------------------------------------------------


def _flops(
    factor: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    activation: str,
    left: int,
    right: int,
    *_: object,
) -> int:
    """``factor * pairs * H * (D + Dv)`` for the forward op's arguments: factor 2 for one product with
    ``D`` and one with ``Dv`` per pair and head (2 flops per multiply-add), 4 for two of each."""
    try:
        pairs = reference.count_valid_pairs(q_offsets, kv_offsets, left, right)
    except Exception:  # fake tensors (tracing): an upper bound, every query against max_kv_len keys
        pairs = int(q.shape[0]) * int(max_kv_len)
    return int(factor * pairs * q.shape[1] * (q.shape[2] + v.shape[2]))


@register_flop_formula(torch.ops.gem_kernels.jagged_attention_fwd, get_raw=True)
def _attention_fwd_flops(*args: Any, out_val: object = None, **kwargs: object) -> int:
    """Forward: S = Q K^T and O = P V over the valid pairs."""
    return _flops(2, *args)


@register_flop_formula(torch.ops.gem_kernels.jagged_attention_bwd, get_raw=True)
def _attention_bwd_flops(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *fwd_args: Any,
    out_val: object = None,
    **kwargs: object,
) -> int:
    """Backward: dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q (the recomputation of S not counted,
    the convention of torch's own SDPA formulas)."""
    return _flops(4, q, k, v, *fwd_args)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _check_max_len(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _band(causal: bool, window: Sequence[int] | None, self_attention: bool) -> tuple[int, int]:
    """``(left, right)`` for the kernels (``-1`` = unbounded) from ``causal`` and ``window``."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None and (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in window)
    ):
        raise ValueError(f"window must be a pair (left, right) of non-negative ints, got {window!r}")
    if not self_attention and (causal or window is not None):
        raise ValueError(
            "causal and window apply to self-attention only (kv_offsets=None): query and key positions "
            "of different sequences are not comparable"
        )
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = 0
    return left, right


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None,
    max_q_len: int,
    max_kv_len: int | None,
    causal: bool,
    window: Sequence[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int]:
    """Validates the public ops' arguments; returns what the custom op takes (kv_offsets, max_kv_len
    filled in for self-attention, the band as ``(left, right)``)."""
    check_values("q", q, ndim=3)
    check_values("k", k, ndim=3)
    check_values("v", v, ndim=3)
    check_same(("q", "k", "v"), (q, k, v), "dtype")
    check_same(("q", "k", "v"), (q, k, v), "device")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(
            f"q, k and v must have the same number of heads, got {q.shape[1]}, {k.shape[1]}, {v.shape[1]}"
        )
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k must have q's head dim {q.shape[2]}, got {k.shape[2]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v must have as many tokens as k ({k.shape[0]}), got {v.shape[0]}")
    max_q_len = _check_max_len("max_q_len", max_q_len)
    self_attention = kv_offsets is None
    if kv_offsets is None:
        if k.shape[0] != q.shape[0]:
            raise ValueError(
                f"self-attention (kv_offsets=None) needs k and v with q's {q.shape[0]} tokens, "
                f"got {k.shape[0]}"
            )
        kv_offsets = q_offsets
        max_kv_len = max_q_len if max_kv_len is None else _check_max_len("max_kv_len", max_kv_len)
    elif max_kv_len is None:
        raise ValueError("max_kv_len is required when kv_offsets is given (cross-attention)")
    else:
        max_kv_len = _check_max_len("max_kv_len", max_kv_len)
    check_offsets(
        "q_offsets", q_offsets, total=q.shape[0], device=q.device, max_len=max_q_len, max_len_name="max_q_len"
    )
    check_offsets(
        "kv_offsets",
        kv_offsets,
        total=k.shape[0],
        device=q.device,
        batch=q_offsets.numel() - 1,
        max_len=max_kv_len,
        max_len_name="max_kv_len",
    )
    left, right = _band(causal, window, self_attention)
    return (
        _unit_last(q),
        _unit_last(k),
        _unit_last(v),
        q_offsets.contiguous(),
        kv_offsets.contiguous(),
        max_q_len,
        max_kv_len,
        left,
        right,
    )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has unit stride (the kernels take row and head strides, so views
    such as ``kv.view(T, 2, H, D).unbind(1)`` need no copy), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_scale(name: str, value: object, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
    return float(value)


def jagged_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    *,
    max_q_len: int,
    max_kv_len: int | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention over jagged sequences, without padding.

    Args:
        q: ``[total_q, H, D]`` fp32/fp16/bf16/fp64.
        k: ``[total_kv, H, D]``, v: ``[total_kv, H, Dv]``, q's dtype and device.
        q_offsets: ``[B+1]`` int32/int64, the query sequences.
        kv_offsets: ``[B+1]`` int32/int64, the key/value sequences; ``None`` for self-attention
            (keys share the query offsets).
        max_q_len: the longest query sequence (host int). max_kv_len: the longest key sequence; defaults
            to ``max_q_len`` for self-attention, required for cross-attention.
        causal: self-attention only; query ``i`` sees keys ``j <= i`` (positions within the sequence).
        window: self-attention only; ``(left, right)``: query ``i`` sees keys ``i-left <= j <= i+right``.
            With ``causal``, ``right`` becomes 0.
        scale: multiplies ``q.k`` before the softmax; default ``D**-0.5``.

    Returns:
        ``[total_q, H, Dv]`` in q's dtype. A query with no visible key (an empty key sequence) outputs 0.
    """
    q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, left, right = _prepare(
        q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, causal, window
    )
    scale = _check_scale("scale", scale, q.shape[2] ** -0.5)
    out_lse: tuple[torch.Tensor, torch.Tensor] = _attention_fwd(
        q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, reference.SOFTMAX, left, right, scale, 1.0
    )
    return out_lse[0]


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    *,
    max_q_len: int,
    max_kv_len: int | None = None,
    activation: str = "silu",
    causal: bool = False,
    window: tuple[int, int] | None = None,
    qk_scale: float | None = None,
    out_scale: float | None = None,
) -> torch.Tensor:
    """Generalized dot-product attention: ``out_i = out_scale * sum_j act(qk_scale * q_i.k_j) v_j``.

    The sum runs over the visible keys only; masked pairs contribute exactly 0. Arguments as in
    :func:`jagged_flash_attention`, plus:

    Args:
        activation: ``"silu"``, ``"gelu"`` (tanh approximation), ``"relu"``, ``"relu2"`` (alias
            ``"relu_square"``), or ``"identity"``.
        qk_scale: default ``D**-0.5``.
        out_scale: default ``1 / max_kv_len`` (1 when ``max_kv_len`` is 0).

    Returns:
        ``[total_q, H, Dv]`` in q's dtype; 0 for a query with no visible key.
    """
    activation = canonical_activation(activation)
    q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, left, right = _prepare(
        q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, causal, window
    )
    qk_scale = _check_scale("qk_scale", qk_scale, q.shape[2] ** -0.5)
    out_scale = _check_scale("out_scale", out_scale, 1.0 / max(max_kv_len, 1))
    out_lse: tuple[torch.Tensor, torch.Tensor] = _attention_fwd(
        q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, activation, left, right, qk_scale, out_scale
    )
    return out_lse[0]
