"""Launcher of the split one-tile backward (``onetile_split``): the long side of each sequence cut into
chunks, one program per (chunk, head), then a deterministic sum of the chunks' fp32 partials of the short
side's gradient (:mod:`.onetile`: ``bwd_short_kv_split_kernel``, ``bwd_few_q_split_kernel``,
``sum_chunk_partials_kernel``)."""

# fmt: off
# (Launch argument tuples stay packed: one argument per line would bury the logic.)

from __future__ import annotations

from typing import Any

import torch
import triton

from gem_kernels.attention import variants
from gem_kernels.attention.triton.autotuners import AUTOTUNERS
from gem_kernels.attention.triton.onetile import (
    bwd_few_q_split_kernel,
    bwd_short_kv_split_kernel,
    sum_chunk_partials_kernel,
)
from gem_kernels.attention.triton.tiles import Consts, Grid, launch_onetile


def split_schedule(
    long_offsets: torch.Tensor, total_long: int, max_long: int, chunk: int, heads: int
) -> tuple[torch.Tensor, Grid]:
    """``(chunk_starts, grid)`` of a split one-tile backward (no host sync).

    Sequence ``b`` owns ``max(1, ceil(len_b / chunk))`` chunks of its long side (one even when empty: it
    writes the zero gradient of its short side); ``chunk_starts`` ``[B+1]`` int32 on the device is their
    exclusive prefix sum. The grid ``(P, H)`` bounds the chunk count from the host ints: ``max(1, ceil(n /
    c)) <= 1 + n // c`` per sequence gives ``P <= B + total // c``, and at most ``B * max(1, ceil(max_len /
    c))``; the spare programs (P minus the true count, under one per sequence) exit at once."""
    batch = long_offsets.numel() - 1
    lengths = long_offsets[1:] - long_offsets[:-1]
    counts = torch.clamp_min(torch.div(lengths + (chunk - 1), chunk, rounding_mode="floor"), 1)
    chunk_starts = torch.zeros(batch + 1, dtype=torch.int32, device=long_offsets.device)
    chunk_starts[1:] = torch.cumsum(counts, 0)
    programs = min(batch + total_long // chunk, batch * max(1, triton.cdiv(max_long, chunk)))
    return chunk_starts, (programs, heads)


def launch_split(
    kind: str, args: tuple[Any, ...], long_offsets: torch.Tensor, total_long: int, max_long: int,
    short_offsets: torch.Tensor, short_grads: tuple[torch.Tensor, ...], buckets: tuple[int, int, int, int],
    consts: Consts,
) -> None:
    """The split one-tile backward of shape class ``kind``: the chunk schedule, the fp32 workspace of the
    short side's partial gradients ``short_grads`` (dK, dV or dQ), the split kernel, then the sum of the
    partials. ``args`` are the whole-stream kernel's; the workspace is allocated and the sum launched only
    when some sequence is longer than a chunk (``max_long``)."""
    chunk = variants.split_chunk(kind)
    batch, heads = short_offsets.numel() - 1, short_grads[0].shape[1]
    chunk_starts, grid = split_schedule(long_offsets, total_long, max_long, chunk, heads)
    block = buckets[2] if kind == "short_kv" else buckets[1]  # the resident (short) side's tile
    split_needed = max_long > chunk
    if split_needed:
        parts = tuple(torch.empty(grid[0], heads, block, g.shape[2], dtype=torch.float32, device=g.device)
                      for g in short_grads)
    else:  # every sequence is one chunk: no workspace is touched (a 1-element placeholder pointer)
        parts = tuple(torch.empty(1, dtype=torch.float32, device=g.device) for g in short_grads)
    # The whole-stream kernels' arguments, with the schedule and workspace after the offsets, and the
    # sequence count and chunk rows after the scales.
    split_args = (*args[:11], chunk_starts, *parts, *args[11:-4], batch, chunk, *args[-4:])
    resident = {"BLOCK_N" if kind == "short_kv" else "BLOCK_M": block,
                "LOG_B": buckets[0].bit_length() - 1}
    if kind == "short_kv":
        launch_onetile(AUTOTUNERS["bwd_short_kv_split"], bwd_short_kv_split_kernel, grid, split_args, consts,
                       resident)
    else:
        launch_onetile(AUTOTUNERS["bwd_few_q_split"], bwd_few_q_split_kernel, grid, split_args, consts,
                       resident)
    if not split_needed:
        return
    for part, g in zip(parts, short_grads, strict=True):
        d = g.shape[2]
        sum_chunk_partials_kernel[(batch, heads)](
            part, g, chunk_starts, short_offsets, heads, D=d, BLOCK_R=block,
            BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=4)
