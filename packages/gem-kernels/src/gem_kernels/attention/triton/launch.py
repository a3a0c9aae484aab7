"""Entry points of the jagged attention Triton path: :func:`attention_fwd` and :func:`attention_bwd`.

Each allocates the outputs, buckets the shapes (batch and the longest query/key sequence to powers of two,
the band kind) and fixes the constexprs, then runs the variant :mod:`..variants` resolves: the persistent
TMA kernels (:mod:`.persistent_launch`), or the tiled kernels (:mod:`.fwd`, :mod:`.bwd`) and, for the
short-key and few-query shape classes, the one-tile kernels (:mod:`.onetile`, split backward in
:mod:`.split`), between which ``auto`` chooses by timing (:data:`AUTO_CHOICE`). Blocks are autotuned
(:mod:`.autotuners`) or fixed (:mod:`.tiles`).
"""

# fmt: off
# (Launch argument tuples stay packed: one argument per line would bury the logic.)

from __future__ import annotations

from typing import Any

import torch
import triton

from gem_kernels.attention import variants
from gem_kernels.attention.activations import ACTIVATION_IDS
from gem_kernels.attention.triton import persistent_launch
from gem_kernels.attention.triton.autotuners import AUTOTUNERS
from gem_kernels.attention.triton.bwd import dkdv_kernel, dq_kernel
from gem_kernels.attention.triton.fwd import fwd_kernel
from gem_kernels.attention.triton.onetile import (
    bwd_few_q_kernel,
    bwd_few_q_split_kernel,
    bwd_short_kv_kernel,
    bwd_short_kv_split_kernel,
    fwd_short_kv_kernel,
    sum_chunk_partials_kernel,
)
from gem_kernels.attention.triton.split import launch_split
from gem_kernels.attention.triton.tiles import Consts, fast_act_available, launch_onetile, launch_tiled
from gem_kernels.dispatch import triton_interpreted

# Stands for an unbounded side of the band; small enough that ``i + UNBOUNDED`` fits in int32.
UNBOUNDED = 1 << 30
# ``auto``'s timed choices of this process (tiled against one-tile, per bucket), also kept on disk.
AUTO_CHOICE = variants.AutoChoice()


def _bucket(n: int) -> int:
    return max(16, int(triton.next_power_of_2(max(n, 1))))


def _setup(
    q: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, max_q_len: int, max_kv_len: int,
    activation: str, left: int, right: int,
) -> tuple[int, int, tuple[int, int, int, int], Consts]:
    """``(left, right, autotune buckets, constexprs)`` shared by the three launchers."""
    left = UNBOUNDED if left < 0 else left
    right = UNBOUNDED if right < 0 else right
    band_kind = 0 if (left, right) == (UNBOUNDED, UNBOUNDED) else 1 if left == UNBOUNDED else 2
    d, dv = q.shape[2], v.shape[2]
    buckets = (_bucket(q_offsets.numel() - 1), _bucket(max_q_len), _bucket(max_kv_len), band_kind)
    consts: Consts = dict(
        ACT=ACTIVATION_IDS[activation],
        D=d,
        DV=dv,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        # fp32 inputs get exact fp32 products unless the user allowed TF32, as torch.matmul does.
        PRECISION="tf32" if q.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee",
        # silu/gelu through the hardware tanh (2^-11 relative error, below bf16/fp16 rounding): CUDA only.
        FAST_ACT=(
            fast_act_available()
            and not triton_interpreted()
            and q.dtype in (torch.bfloat16, torch.float16)
            and activation in ("silu", "gelu")
        ),
    )
    return left, right, buckets, consts


def _strides(*ts: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for t in ts for s in (t.stride(0), t.stride(1)))


def _choice_key(family: str, q: torch.Tensor, buckets: tuple[int, ...], consts: Consts) -> tuple[Any, ...]:
    return (family, q.dtype, *buckets, *sorted(consts.items()))


def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
    max_q_len: int, max_kv_len: int, activation: str, left: int, right: int, qk_scale: float,
    out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``(out [total_q, H, Dv], lse [total_q, H] fp32, or empty for GDPA)``.

    Arguments as in :func:`gem_kernels.attention.reference.attention_fwd`, plus the host ints
    ``max_q_len``/``max_kv_len`` that size the grid."""
    batch, heads = q_offsets.numel() - 1, q.shape[1]
    out = torch.empty(q.shape[0], heads, v.shape[2], dtype=q.dtype, device=q.device)
    softmax = activation == "softmax"
    lse = torch.empty((q.shape[0], heads) if softmax else (0,), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or batch == 0 or heads == 0:
        return out, lse
    left, right, buckets, consts = _setup(q, v, q_offsets, max_q_len, max_kv_len, activation, left, right)
    if (variant := variants.resolve_variant("fwd", q, buckets, q, k, v)) == "tma":
        persistent_launch.attention_fwd(q, k, v, out, lse, q_offsets, kv_offsets, max_q_len, left, right,
                                        qk_scale, out_scale, buckets, consts)
        return out, lse
    args = (q, k, v, out, lse, q_offsets, kv_offsets, *_strides(q, k, v, out), heads, left, right, qk_scale,
            out_scale, *buckets)

    def tiled() -> None:
        grid_of = lambda bm, bn: (batch * heads, triton.cdiv(max_q_len, bm))
        launch_tiled(AUTOTUNERS["fwd"], fwd_kernel, grid_of, args, consts)

    if variants.shape_class(buckets[1], buckets[2]) != "short_kv":
        tiled()
        return out, lse

    def onetile() -> None:
        launch_onetile(AUTOTUNERS["fwd_short_kv"], fwd_short_kv_kernel, (batch * heads,), args, consts,
                       {"BLOCK_N": buckets[2]})

    AUTO_CHOICE.run(variant, _choice_key("fwd", q, buckets, consts), [fwd_kernel, fwd_short_kv_kernel],
                    q.device, tiled, onetile)
    return out, lse


def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int,
    activation: str, left: int, right: int, qk_scale: float, out_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward: ``(dq, dk, dv)`` in the dtypes of ``(q, k, v)``.

    General: the dQ kernel (which also writes ``delta = rowsum(dO * O)`` for softmax), then the dK/dV
    kernel. Short keys or few queries: also a single fused one-tile kernel, whole or split."""
    batch, heads = q_offsets.numel() - 1, q.shape[1]
    # Contiguous gradients whatever the inputs' strides (the kernels address them with row stride H*D).
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if batch == 0 or heads == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout, out = dout.contiguous(), out.contiguous()  # dO is addressed with O's strides
    left, right, buckets, consts = _setup(q, v, q_offsets, max_q_len, max_kv_len, activation, left, right)
    if (variant := variants.resolve_variant("bwd", q, buckets, q, k, v, dout)) == "tma":
        persistent_launch.attention_bwd(dout, q, k, v, out, lse, dq, dk, dv, q_offsets, kv_offsets, max_q_len,
                                        max_kv_len, left, right, qk_scale, out_scale, buckets, consts)
        return dq, dk, dv
    strides = _strides(q, k, v, out)

    def tiled() -> None:
        delta = torch.empty_like(lse)
        if q.shape[0] > 0:
            args = (q, k, v, out, dout, dq, lse, delta, q_offsets, kv_offsets, *strides, heads, left, right,
                    qk_scale, out_scale, *buckets)
            launch_tiled(AUTOTUNERS["dq"], dq_kernel,
                         lambda bm, bn: (batch * heads, triton.cdiv(max_q_len, bm)), args, consts)
        if k.shape[0] > 0:
            args = (q, k, v, dout, dk, dv, lse, delta, q_offsets, kv_offsets, *strides, heads, left, right,
                    qk_scale, out_scale, *buckets)
            launch_tiled(AUTOTUNERS["dkdv"], dkdv_kernel,
                         lambda bm, bn: (batch * heads, triton.cdiv(max_kv_len, bn)), args, consts)

    kind = variants.shape_class(buckets[1], buckets[2])
    if kind == "general":
        tiled()
        return dq, dk, dv
    args = (q, k, v, out, dout, dq, dk, dv, lse, q_offsets, kv_offsets, *strides, heads, left, right,
            qk_scale, out_scale, *buckets)
    if kind == "short_kv":
        def onetile() -> None:
            launch_onetile(AUTOTUNERS["bwd_short_kv"], bwd_short_kv_kernel, (batch * heads,), args, consts,
                           {"BLOCK_N": buckets[2]})
    else:
        def onetile() -> None:
            launch_onetile(AUTOTUNERS["bwd_few_q"], bwd_few_q_kernel, (batch * heads,), args, consts,
                           {"BLOCK_M": buckets[1]})

    def split() -> None:
        # (long side's offsets, rows, longest; short side's offsets and the gradients summed over chunks)
        if kind == "short_kv":
            launch_split(kind, args, q_offsets, q.shape[0], max_q_len, kv_offsets, (dk, dv), buckets, consts)
        else:
            launch_split(kind, args, kv_offsets, k.shape[0], max_kv_len, q_offsets, (dq,), buckets, consts)

    fused = bwd_short_kv_kernel if kind == "short_kv" else bwd_few_q_kernel
    fused_split = bwd_short_kv_split_kernel if kind == "short_kv" else bwd_few_q_split_kernel
    AUTO_CHOICE.run(variant, _choice_key("bwd", q, buckets, consts),
                    [dq_kernel, dkdv_kernel, fused, fused_split, sum_chunk_partials_kernel], q.device, tiled,
                    onetile, split)
    return dq, dk, dv
