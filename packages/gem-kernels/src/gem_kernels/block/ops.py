"""The op face of block attention: softmax attention within fixed-size blocks of each jagged sequence.

Block ``j`` of a sequence covers its tokens ``[j*block_size, (j+1)*block_size)`` (the last block may be
shorter); every query attends only to the keys of its own block, so the cost grows linearly with the
sequence length (GEM's BlockAttention). Optional rotary embeddings (:class:`gem_kernels.Rotary`) are
applied to q and k inside the kernel, and their inverse to dQ and dK inside the backward kernel.

Three layers: :func:`block_attention` validates; the custom op ``gem_kernels::block_attention`` (with a
fake implementation, autograd and a FLOP formula) dispatches to the Triton kernel on CUDA or to the
PyTorch reference elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from gem_kernels.block.reference import block_attention_backward_reference, block_attention_reference
from gem_kernels.checks import check_offsets, check_same, check_values
from gem_kernels.dispatch import use_triton
from gem_kernels.rotary.ops import Rotary, check_rotary_args

__all__ = ["block_attention"]


def _use_kernel(q: torch.Tensor, v: torch.Tensor, block_size: int) -> bool:
    # The kernel holds a whole block of q, k, v (and O, dO in the backward) in registers; fp64 and
    # larger shapes take the reference.
    supported = q.dtype != torch.float64 and block_size <= 128 and q.shape[-1] <= 256 and v.shape[-1] <= 256
    return supported and use_triton(q)


@torch.library.custom_op("gem_kernels::block_attention", mutates_args=())
def _block_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    causal: bool,
    scale: float,
    positions: torch.Tensor | None,
    base: float,
    use_rotary: bool,
) -> torch.Tensor:
    if _use_kernel(q, v, block_size):
        from gem_kernels.block.triton import block_attention_fwd

        return block_attention_fwd(
            q, k, v, offsets, max_seq_len, block_size, causal, scale, positions, base, use_rotary
        )
    return block_attention_reference(q, k, v, offsets, block_size, causal, scale, positions, base, use_rotary)


@_block_attention_op.register_fake
def _block_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=v.dtype)


@torch.library.custom_op("gem_kernels::block_attention_backward", mutates_args=())
def _block_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    causal: bool,
    scale: float,
    positions: torch.Tensor | None,
    base: float,
    use_rotary: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_kernel(q, v, block_size):
        from gem_kernels.block.triton import block_attention_bwd

        return block_attention_bwd(
            grad_out,
            q,
            k,
            v,
            out,
            offsets,
            max_seq_len,
            block_size,
            causal,
            scale,
            positions,
            base,
            use_rotary,
        )
    return block_attention_backward_reference(
        grad_out, q, k, v, offsets, block_size, causal, scale, positions, base, use_rotary
    )


@_block_attention_backward_op.register_fake
def _block_attention_backward_fake(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *args: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, offsets, max_seq_len, block_size, causal, scale, positions, base, use_rotary = inputs
    ctx.save_for_backward(q, k, v, output, offsets, positions)
    ctx.args = (max_seq_len, block_size, causal, scale)
    ctx.rotary = (base, use_rotary)


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, out, offsets, positions = ctx.saved_tensors
    dq, dk, dv = _block_attention_backward_op(
        grad_out.contiguous(), q, k, v, out, offsets, *ctx.args, positions, *ctx.rotary
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


_block_attention_op.register_autograd(_backward, setup_context=_setup_context)


def count_block_pairs(offsets: torch.Tensor, block_size: int, causal: bool) -> int:
    """Number of (query, key) pairs that attend, summed over the batch (heads not counted).

    A sequence of length ``n`` has ``n // block_size`` full blocks and one partial block of
    ``n % block_size`` tokens; a block of ``w`` tokens has ``w * w`` pairs, ``w * (w + 1) / 2`` if causal.
    Reads the offsets on the host (FLOP counting is not a hot path)."""
    o = offsets.detach().to("cpu", torch.int64)
    lengths = o[1:] - o[:-1]
    full, rest = lengths // block_size, lengths % block_size

    def pairs(w: int | torch.Tensor) -> int | torch.Tensor:
        return w * (w + 1) // 2 if causal else w * w

    return int((full * pairs(block_size) + pairs(rest)).sum())


def _pairs(q: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, block_size: int, causal: bool) -> int:
    try:
        return count_block_pairs(offsets, block_size, causal)
    except RuntimeError:  # fake or meta tensors (tracing): an upper bound that treats every block as full
        w = max(min(block_size, max_seq_len), 0)
        return int(q.shape[0] * ((w + 1) / 2 if causal else w))


# 2 FLOPs per multiply-add, over the valid (query, key) pairs of each block only.
@register_flop_formula(torch.ops.gem_kernels.block_attention, get_raw=True)
def _block_attention_flop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    causal: bool,
    *args: object,
    out_val: object = None,
    **kw: object,
) -> int:
    """Forward: S = Q K^T and O = P V."""
    pairs = _pairs(q, offsets, max_seq_len, block_size, causal)
    return int(2 * pairs * q.shape[1] * (q.shape[2] + v.shape[2]))


@register_flop_formula(torch.ops.gem_kernels.block_attention_backward, get_raw=True)
def _block_attention_backward_flop(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    causal: bool,
    *args: object,
    out_val: object = None,
    **kw: object,
) -> int:
    """Backward: dV, dP, dQ, dK, as torch counts the SDPA backward; the recomputed S is not counted."""
    pairs = _pairs(q, offsets, max_seq_len, block_size, causal)
    return int(4 * pairs * q.shape[1] * (q.shape[2] + v.shape[2]))


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_seq_len: int,
    block_size: int = 64,
    causal: bool = False,
    scale: float | None = None,
    rotary: Rotary | None = None,
) -> torch.Tensor:
    """Softmax attention within fixed blocks of each jagged sequence.

    Args:
        q: ``[total, H, D]`` queries (fp32, fp16, bf16 or fp64).
        k: ``[total, H, D]`` keys, same dtype and device as q.
        v: ``[total, H, Dv]`` values.
        offsets: ``[B+1]`` int32/int64 sequence offsets (0 first, non-decreasing, ``total`` last).
        max_seq_len: host int, at least the longest sequence (bounds the kernel grid; no GPU sync).
        block_size: tokens per block; block ``j`` of a sequence is its tokens
            ``[j*block_size, (j+1)*block_size)``, the last block may be shorter.
        causal: mask keys after the query within the block.
        scale: softmax scale, default ``D ** -0.5``.
        rotary: :class:`gem_kernels.Rotary` to rotate q and k (positions 0..len-1 within the whole
            sequence by default, not within the block) inside the kernel; ``None`` for no rotation.

    Returns:
        ``[total, H, Dv]`` in v's dtype; differentiable in q, k and v.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_values(name, t, ndim=3)
    check_same(("q", "k", "v"), (q, k, v), "dtype")
    check_same(("q", "k", "v"), (q, k, v), "device")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have shape [{q.shape[0]}, {q.shape[1]}, Dv], got {tuple(v.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
        raise ValueError(f"max_seq_len must be a non-negative int, got {max_seq_len!r}")
    check_offsets(
        "offsets", offsets, total=q.shape[0], device=q.device, max_len=max_seq_len, max_len_name="max_seq_len"
    )
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number or None, got {scale!r}")
    if rotary is not None and not isinstance(rotary, Rotary):
        raise TypeError(f"rotary must be a gem_kernels.Rotary or None, got {type(rotary).__name__}")
    positions, base = (rotary.positions, rotary.base) if rotary is not None else (None, 10000.0)
    if rotary is not None:
        check_rotary_args("q", positions, base, q)
    out: torch.Tensor = _block_attention_op(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        offsets,
        max_seq_len,
        block_size,
        bool(causal),
        float(scale),
        positions,
        float(base),
        rotary is not None,
    )
    return out
