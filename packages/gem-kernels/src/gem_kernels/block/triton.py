"""Triton kernels of block attention, forward and backward, with rotary embeddings fused in.

One program per (block, head) tile (or per block and ``HEAD_GROUP`` heads, which then share the rotary
angles): it loads its block of q, k, v (at most ``block_size`` tokens) once, computes the whole
``S = q k^T`` tile, softmax and ``P v`` and stores once. Because a block never spans
more than one tile there is no loop over key tiles, no online-softmax rescaling, no log-sum-exp written to
HBM (the backward recomputes the row max and sum), and ``Di`` is computed inline as ``rowsum(P * dP)``,
so the backward does not even read O (7 tensor passes instead of 8).

Scheduling: ``block_starts[b]`` (an exclusive prefix sum of the per-sequence block counts, on the device)
maps program ``pid`` to its sequence by a branchless binary search; the grid is an upper bound on the
block count (``ceil(total / block_size) + B``, no host sync), and the few spare programs exit at once.
No program touches padding.

Rotary (half-split convention, see :mod:`gem_kernels.rotary`; sin and cos by
:func:`gem_kernels.rotary.triton.cos_sin`): q and k are loaded as two halves
``x1 = x[:, :D/2]``, ``x2 = x[:, D/2:]``, rotated in fp32 registers and rounded once to the input dtype
for the tensor-core dots, so ``S = q1 k1^T + q2 k2^T``. The backward applies the inverse rotation to dQ and
dK in fp32 before their single rounding. The same half split is used without rotary (it also serves odd D).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from gem_kernels.jagged.triton import segment_bounds, segment_of_item
from gem_kernels.rotary.reference import inv_frequencies
from gem_kernels.rotary.triton import cos_sin


@dataclass(frozen=True)
class LaunchSettings:
    """Launch settings of the block kernels, chosen on the H200 (BENCHMARKS.md).

    ``head_group`` heads share one program (and its rotary angles) when it divides H. ``bwd_maxnreg``: the
    backward's register cap (ptxas ``.maxnreg``; 128 lets two 8-warp programs share an SM, at the price
    of a small spill); None leaves it to ptxas."""

    fwd_warps: int = 4
    bwd_warps: int = 8
    num_stages: int = 1
    head_group: int = 1
    bwd_maxnreg: int | None = None


_settings = LaunchSettings()


def launch_settings() -> LaunchSettings:
    """The settings the launches use now (the defaults outside :func:`launched_with`)."""
    return _settings


@contextlib.contextmanager
def launched_with(**changes: Any) -> Iterator[LaunchSettings]:
    """Launch with some settings changed inside a ``with`` block (benchmarks sweep them, tests cover
    ``head_group > 1``); yields the settings in force."""
    global _settings
    old, _settings = _settings, dataclasses.replace(_settings, **changes)
    try:
        yield _settings
    finally:
        _settings = old


def _cuda_options(maxnreg: int | None) -> dict[str, int]:
    # The interpreter takes no ptxas options.
    if maxnreg is None or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return {}
    return {"maxnreg": maxnreg}


@triton.jit
def _block_coords(offsets_ptr, block_starts_ptr, pid, B, BLOCK: tl.constexpr, LOG_B: tl.constexpr):
    """(first token of the block, tokens in it, position of its first token in the sequence)."""
    b = segment_of_item(block_starts_ptr, pid, B, LOG_B)
    seq_start, seq_len = segment_bounds(offsets_ptr, b)
    first = (pid - tl.load(block_starts_ptr + b)).to(tl.int64) * BLOCK
    n = tl.minimum(seq_len - first, BLOCK)
    return seq_start + first, n, first


@triton.jit
def _block_tile(
    offsets_ptr, block_starts_ptr, pid, B, D: tl.constexpr, DV: tl.constexpr, HALF: tl.constexpr,
    HALF_P: tl.constexpr, DV_P: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, LOG_B: tl.constexpr,
):  # fmt: skip
    """The prologue of both block kernels: block ``pid``'s tokens and the masks of its tiles.

    Returns ``(tok [TILE] int64, rows [TILE], n, first, row_ok [TILE], d [HALF_P], mask1, mask2 [TILE, HALF_P]
    (the two rotary halves of q/k), dv [DV_P], vmask [TILE, DV_P])``.
    """
    tok0, n, first = _block_coords(offsets_ptr, block_starts_ptr, pid, B, BLOCK, LOG_B)
    rows = tl.arange(0, TILE)
    row_ok = rows < n
    tok = tok0 + rows
    d = tl.arange(0, HALF_P)
    mask1 = row_ok[:, None] & (d < HALF)[None, :]
    mask2 = row_ok[:, None] & (d + HALF < D)[None, :]
    dv = tl.arange(0, DV_P)
    vmask = row_ok[:, None] & (dv < DV)[None, :]
    return tok, rows, n, first, row_ok, d, mask1, mask2, dv, vmask


@triton.jit
def _rotation(positions_ptr, inv_freq_ptr, tok, rows, first, row_ok, d, d_ok, HAS_POS: tl.constexpr):
    """cos, sin ``[TILE, HALF_P]`` of the rotary angles of the block's tokens."""
    if HAS_POS:
        pos = tl.load(positions_ptr + tok, mask=row_ok, other=0.0)
    else:
        pos = (first + rows).to(tl.float32)
    freq = tl.load(inv_freq_ptr + d, mask=d_ok, other=0.0)
    return cos_sin(pos[:, None] * freq[None, :])


@triton.jit
def _load_halves(ptr, tok, h, stride_t, stride_h, d, mask1, mask2, HALF: tl.constexpr):
    base = ptr + tok[:, None] * stride_t + h * stride_h + d[None, :]
    return tl.load(base, mask=mask1, other=0.0), tl.load(base + HALF, mask=mask2, other=0.0)


@triton.jit
def _head_qk(
    Q, K, tok, h, stride_t, stride_h, d, mask1, mask2, cos, sin, HALF: tl.constexpr, ROTARY: tl.constexpr
):  # fmt: skip
    """Head ``h``'s q and k halves of the block, rotated by ``cos``/``sin`` when ``ROTARY`` (unused
    otherwise): ``(q1, q2, k1, k2)``, each ``[TILE, HALF_P]`` in the input dtype."""
    q1, q2 = _load_halves(Q, tok, h, stride_t, stride_h, d, mask1, mask2, HALF)
    k1, k2 = _load_halves(K, tok, h, stride_t, stride_h, d, mask1, mask2, HALF)
    if ROTARY:
        q1, q2 = _rotate(q1, q2, cos, sin)
        k1, k2 = _rotate(k1, k2, cos, sin)
    return q1, q2, k1, k2


@triton.jit
def _rotate(x1, x2, cos, sin):
    """Rotate the half pair in fp32 and round once back to the input dtype."""
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return (x1 * cos - x2 * sin).to(dt), (x2 * cos + x1 * sin).to(dt)


@triton.jit
def _probabilities(q1, q2, k1, k2, rows, n, scale_log2e, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Softmax of the block's scores, ``[TILE, TILE]`` fp32; masked keys get exactly 0."""
    s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
    s += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
    keep = (rows < n)[None, :]
    if CAUSAL:
        keep = keep & (rows[:, None] >= rows[None, :])
    # Key 0 of a block is always kept, so every row has a finite max.
    s = tl.where(keep, s * scale_log2e, float("-inf"))
    p = tl.exp2(s - tl.max(s, 1)[:, None])
    return p / tl.sum(p, 1)[:, None]


@triton.jit
def _block_attention_fwd(
    Q, K, V, Out, offsets_ptr, block_starts_ptr, positions_ptr, inv_freq_ptr,
    B, stride_qt, stride_qh, stride_vt, stride_vh, scale_log2e,
    D: tl.constexpr, DV: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, DV_P: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, LOG_B: tl.constexpr, HEAD_GROUP: tl.constexpr,
    CAUSAL: tl.constexpr, ROTARY: tl.constexpr, HAS_POS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid >= tl.load(block_starts_ptr + B):
        return
    tok, rows, n, first, row_ok, d, mask1, mask2, dv, vmask = _block_tile(
        offsets_ptr, block_starts_ptr, pid, B, D, DV, HALF, HALF_P, DV_P, BLOCK, TILE, LOG_B
    )
    cos, sin = 0.0, 0.0  # no angles without rotary
    if ROTARY:
        # The angles depend on the token only: computed once for the program's heads.
        cos, sin = _rotation(positions_ptr, inv_freq_ptr, tok, rows, first, row_ok, d, d < HALF, HAS_POS)
    for hh in tl.static_range(HEAD_GROUP):
        h = tl.program_id(1) * HEAD_GROUP + hh
        q1, q2, k1, k2 = _head_qk(Q, K, tok, h, stride_qt, stride_qh, d, mask1, mask2, cos, sin, HALF, ROTARY)
        p = _probabilities(q1, q2, k1, k2, rows, n, scale_log2e, CAUSAL, PRECISION)
        v_off = tok[:, None] * stride_vt + h * stride_vh + dv[None, :]
        v = tl.load(V + v_off, mask=vmask, other=0.0)
        o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        tl.store(Out + v_off, o.to(v.dtype), mask=vmask)


@triton.jit
def _block_attention_bwd(
    Q, K, V, DO, DQ, DK, DV, offsets_ptr, block_starts_ptr, positions_ptr, inv_freq_ptr,
    B, stride_qt, stride_qh, stride_vt, stride_vh, scale_log2e, scale,
    D: tl.constexpr, DVD: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, DV_P: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, LOG_B: tl.constexpr, HEAD_GROUP: tl.constexpr,
    CAUSAL: tl.constexpr, ROTARY: tl.constexpr, HAS_POS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid >= tl.load(block_starts_ptr + B):
        return
    tok, rows, n, first, row_ok, d, mask1, mask2, dv, vmask = _block_tile(
        offsets_ptr, block_starts_ptr, pid, B, D, DVD, HALF, HALF_P, DV_P, BLOCK, TILE, LOG_B
    )
    cos, sin = 0.0, 0.0  # no angles without rotary
    if ROTARY:
        cos, sin = _rotation(positions_ptr, inv_freq_ptr, tok, rows, first, row_ok, d, d < HALF, HAS_POS)
    for hh in tl.static_range(HEAD_GROUP):
        h = tl.program_id(1) * HEAD_GROUP + hh
        q1, q2, k1, k2 = _head_qk(Q, K, tok, h, stride_qt, stride_qh, d, mask1, mask2, cos, sin, HALF, ROTARY)
        dt = q1.dtype
        p = _probabilities(q1, q2, k1, k2, rows, n, scale_log2e, CAUSAL, PRECISION)
        # Each gradient is stored as soon as it is complete, so few [TILE, *] tiles are live at once
        # (the kernel is register-bound, not memory-bound, in its middle).
        v_off = tok[:, None] * stride_vt + h * stride_vh + dv[None, :]
        do = tl.load(DO + v_off, mask=vmask, other=0.0)
        dv_acc = tl.dot(tl.trans(p.to(dt)), do, input_precision=PRECISION)
        tl.store(DV + v_off, dv_acc.to(dt), mask=vmask)
        v = tl.load(V + v_off, mask=vmask, other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        # Di inline, as rowsum(P * dP) (= rowsum(dO * O), since O = P V): the block's own keys are all
        # there is, so no preprocessing kernel and no read of O at all.
        di = tl.sum(p * dp, 1)
        ds = (p * (dp - di[:, None])).to(dt)
        qk_off = tok[:, None] * stride_qt + h * stride_qh + d[None, :]
        dq1 = tl.dot(ds, k1, input_precision=PRECISION)
        dq2 = tl.dot(ds, k2, input_precision=PRECISION)
        _store_grad_halves(
            DQ + qk_off, dq1, dq2, scale, mask1, mask2,
            positions_ptr, inv_freq_ptr, tok, rows, first, row_ok, d, HALF, ROTARY, HAS_POS,
        )  # fmt: skip
        dk1 = tl.dot(tl.trans(ds), q1, input_precision=PRECISION)
        dk2 = tl.dot(tl.trans(ds), q2, input_precision=PRECISION)
        _store_grad_halves(
            DK + qk_off, dk1, dk2, scale, mask1, mask2,
            positions_ptr, inv_freq_ptr, tok, rows, first, row_ok, d, HALF, ROTARY, HAS_POS,
        )  # fmt: skip


@triton.jit
def _store_grad_halves(
    ptr, g1, g2, scale, mask1, mask2, positions_ptr, inv_freq_ptr, tok, rows, first, row_ok, d,
    HALF: tl.constexpr, ROTARY: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    """Store the gradient of a rotated q or k: scale, apply the inverse rotation in fp32 (angles
    recomputed here rather than kept live in registers), round once."""
    g1 = g1 * scale
    g2 = g2 * scale
    if ROTARY:
        cos, sin = _rotation(positions_ptr, inv_freq_ptr, tok, rows, first, row_ok, d, d < HALF, HAS_POS)
        g1, g2 = g1 * cos + g2 * sin, g2 * cos - g1 * sin
    dt = ptr.dtype.element_ty
    tl.store(ptr, g1.to(dt), mask=mask1)
    tl.store(ptr + HALF, g2.to(dt), mask=mask2)


def launch_args(
    q: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    positions: torch.Tensor | None,
    base: float,
    use_rotary: bool,
) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Grid, schedule tensors and constexprs shared by the forward and backward launches."""
    total, heads, d = q.shape
    batch = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    counts = (lengths + block_size - 1) // block_size
    # block_starts[b] = blocks before sequence b; block_starts[B] = all blocks (read by the kernel).
    block_starts = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    block_starts[1:] = torch.cumsum(counts, 0)
    # Upper bound without a sync: each sequence adds at most one partial block.
    num_programs = min(triton.cdiv(total, block_size) + batch, batch * triton.cdiv(max_seq_len, block_size))
    half = (d + 1) // 2
    if use_rotary:
        inv_freq = inv_frequencies(d, base, torch.float32, q.device)
        pos = positions.to(torch.float32).contiguous() if positions is not None else inv_freq
    else:
        inv_freq = pos = block_starts  # unused pointers
    meta: dict[str, Any] = dict(
        D=d, HALF=half, HALF_P=max(16, triton.next_power_of_2(half)),
        DV_P=max(16, triton.next_power_of_2(v.shape[-1])),
        BLOCK=block_size, TILE=max(16, triton.next_power_of_2(block_size)),
        LOG_B=max(1, math.ceil(math.log2(max(batch, 1)))),
        ROTARY=use_rotary, HAS_POS=positions is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    group = _settings.head_group if heads % _settings.head_group == 0 else 1
    meta["HEAD_GROUP"] = group
    return (max(num_programs, 0), heads // group), block_starts, pos, inv_freq, meta


def block_attention_fwd(
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
    """Forward launch: q, k ``[total, H, D]``, v ``[total, H, Dv]`` contiguous -> ``[total, H, Dv]``."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=v.dtype, device=q.device)
    grid, block_starts, pos, inv_freq, meta = launch_args(
        q, v, offsets, max_seq_len, block_size, positions, base, use_rotary
    )
    if grid[0] == 0 or q.shape[0] == 0:
        return out
    _block_attention_fwd[grid](
        q, k, v, out, offsets, block_starts, pos, inv_freq,
        offsets.numel() - 1, q.stride(0), q.stride(1), v.stride(0), v.stride(1), scale * 1.4426950408889634,
        DV=v.shape[2], CAUSAL=causal, num_warps=_settings.fwd_warps, num_stages=_settings.num_stages, **meta,
    )  # fmt: skip
    return out


def block_attention_bwd(
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
    """Backward launch: ``(dq, dk, dv)`` in the input dtype (``out`` is not needed: Di comes from P)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grid, block_starts, pos, inv_freq, meta = launch_args(
        q, v, offsets, max_seq_len, block_size, positions, base, use_rotary
    )
    if grid[0] == 0 or q.shape[0] == 0:
        return dq, dk, dv
    _block_attention_bwd[grid](
        q, k, v, grad_out, dq, dk, dv, offsets, block_starts, pos, inv_freq,
        offsets.numel() - 1, q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        scale * 1.4426950408889634, scale,
        DVD=v.shape[2], CAUSAL=causal, num_warps=_settings.bwd_warps, num_stages=_settings.num_stages,
        **_cuda_options(_settings.bwd_maxnreg), **meta,
    )  # fmt: skip
    return dq, dk, dv
