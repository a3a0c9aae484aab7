"""Triton kernels for jagged <-> padded dense copies (one read and one write per element).

``jagged_to_padded``: program (sequence, row tile) copies its rows and writes the padding, so every
element of the padded output is written once. ``padded_to_jagged``: program (token tile) finds each
token's sequence by a vectorised binary search over the offsets and gathers its row (0 past ``N``), so
the grid follows the host-known ``total`` and no program works on padding.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 16


def _block_f(feat: int) -> int:
    block: int = triton.next_power_of_2(max(feat, 1))
    return min(block, 1024)


@triton.jit
def segment_of_item(starts_ptr, item, n_segments, LOG_N: tl.constexpr):
    """The segment that owns work item ``item``: the largest ``b < n_segments`` with ``starts[b] <= item``,
    where ``starts`` ``[n_segments]`` (int32) is the exclusive prefix sum of the segments' item counts (the
    block kernels' blocks per sequence, the split attention kernels' chunks). A branchless binary search
    over ``2**LOG_N >= n_segments``; a segment with no items never owns one, and item 0 belongs to segment 0
    or the first that follows empty ones."""
    b = item * 0
    for i in tl.static_range(LOG_N):
        cand = b + (1 << (LOG_N - 1 - i))
        start = tl.load(starts_ptr + cand, mask=cand < n_segments, other=2147483647)
        b = tl.where(start <= item, cand, b)
    return b


@triton.jit
def segment_bounds(offsets_ptr, b):
    """(first row, row count) of segment ``b`` of ``offsets`` ``[B+1]``, both int64 (row * feature offsets of
    large tensors overflow int32)."""
    start = tl.load(offsets_ptr + b).to(tl.int64)
    return start, tl.load(offsets_ptr + b + 1).to(tl.int64) - start


@triton.jit
def _jagged_to_padded_kernel(
    V, P, offsets_ptr, max_len, F, padding_value, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr
):
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start, n = segment_bounds(offsets_ptr, b)
    src_ok = rows < n
    dst_ok = rows < max_len
    src = (start + rows)[:, None] * F
    dst = (b.to(tl.int64) * max_len + rows)[:, None] * F
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        col_ok = (cols < F)[None, :]
        x = tl.load(V + src + cols[None, :], mask=src_ok[:, None] & col_ok, other=padding_value)
        tl.store(P + dst + cols[None, :], x, mask=dst_ok[:, None] & col_ok)


@triton.jit
def _padded_to_jagged_kernel(
    P, V, offsets_ptr, B, N, total, F,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, LOG_B: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    tok_ok = tok < total
    # Sequence of each token: the largest b < B with offsets[b] <= tok (skips empty sequences).
    seg = tl.zeros([BLOCK_N], dtype=tl.int64)
    for i in tl.static_range(LOG_B):
        cand = seg + (1 << (LOG_B - 1 - i))
        start = tl.load(offsets_ptr + cand, mask=cand < B, other=total).to(tl.int64)
        seg = tl.where(start <= tok, cand, seg)
    pos = tok - tl.load(offsets_ptr + seg, mask=tok_ok, other=0).to(tl.int64)
    src_ok = tok_ok & (pos < N)
    src = (seg * N + pos)[:, None] * F
    dst = tok[:, None] * F
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        col_ok = (cols < F)[None, :]
        x = tl.load(P + src + cols[None, :], mask=src_ok[:, None] & col_ok, other=0.0)
        tl.store(V + dst + cols[None, :], x, mask=tok_ok[:, None] & col_ok)


def jagged_to_padded_triton(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float
) -> torch.Tensor:
    """values ``[total, F]`` contiguous -> ``[B, max_len, F]``."""
    batch = offsets.numel() - 1
    feat = values.shape[1]
    out = torch.empty(batch, max_len, feat, dtype=values.dtype, device=values.device)
    if out.numel() == 0:
        return out
    grid = (batch, triton.cdiv(max_len, BLOCK_N))
    _jagged_to_padded_kernel[grid](
        values, out, offsets, max_len, feat, padding_value, BLOCK_N=BLOCK_N, BLOCK_F=_block_f(feat)
    )
    return out


def padded_to_jagged_triton(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """padded ``[B, N, F]`` contiguous -> ``[total, F]`` (0 for positions ``>= N``)."""
    batch, n, feat = padded.shape
    out = torch.empty(total, feat, dtype=padded.dtype, device=padded.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(total, BLOCK_N),)
    _padded_to_jagged_kernel[grid](
        padded, out, offsets, batch, n, total, feat,
        BLOCK_N=BLOCK_N, BLOCK_F=_block_f(feat), LOG_B=max(1, math.ceil(math.log2(max(batch, 1)))),
    )  # fmt: skip
    return out


@triton.jit
def _jagged_mean_kernel(V, M, offsets_ptr, F, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    # Program (sequence, feature tile): sums the sequence's rows in fp32, BLOCK_N rows at a time.
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    start, n = segment_bounds(offsets_ptr, b)
    acc = tl.zeros([BLOCK_N, BLOCK_F], dtype=tl.float32)
    for r0 in range(0, n, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        ptrs = V + (start + rows)[:, None] * F + cols[None, :]
        acc += tl.load(ptrs, mask=(rows < n)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    mean = tl.sum(acc, 0) / tl.maximum(n, 1).to(tl.float32)
    tl.store(M + b.to(tl.int64) * F + cols, mean.to(M.dtype.element_ty), mask=col_ok)


def jagged_mean_triton(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """values ``[total, F]`` contiguous -> ``[B, F]`` means (0 for an empty sequence)."""
    batch = offsets.numel() - 1
    feat = values.shape[1]
    out = torch.empty(batch, feat, dtype=values.dtype, device=values.device)
    if out.numel() == 0:
        return out
    block_f = min(_block_f(feat), 128)
    grid = (batch, triton.cdiv(feat, block_f))
    _jagged_mean_kernel[grid](values, out, offsets, feat, BLOCK_N=32, BLOCK_F=block_f)
    return out
