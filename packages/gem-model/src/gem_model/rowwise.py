"""Position-wise chains run over row chunks in CPU inference, so that their intermediates stay in cache.

A chain of per-token ops over a history (``RMSNorm -> W13 -> silu * -> W2 -> + s``) makes one tensor per op
of ``[tokens, width]``: at the tiny model's ~44,000 tokens a batch of 2,048, ``[44k, 128]`` fp32 is 22 MB,
far beyond a core's L2 (1-2 MB), so every op streams its input from L3 or DRAM and writes its output back.
Run over chunks of :data:`ROW_CHUNK` rows, each op's operand is still in cache from the op before: the FFN
block alone went from 14.1 to 8.9 ms at ``[44k, 32]`` (one core of the 2-core AMD EPYC machine); the tiny
model's whole forward, with the FFN block and the attention projections chunked, 1.03x alone and 1.06x beside
a second process on the other core (gem-train BENCHMARKS.md, issue 36).

Only where it changes nothing but speed: autograd off (no graph to keep whole), a CPU tensor of more than one
chunk, and not while ``torch.compile`` traces (inductor fuses such chains itself). Every op of a chain must
act on each row alone (a linear, a norm over the last dimension, a pointwise op): then each output row is the
one the whole-tensor call gives (the same kernels on the same row; bit-identical in the tests, which check
it to a float32 rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["ROW_CHUNK", "chunks_rows", "rowwise"]

# Rows per chunk: at width 128 fp32 a chunk's widest intermediate is 2 MB, L2-to-L3 sized on the machines
# measured; 2,048 / 4,096 / 8,192 rows gave 9.0 / 8.9 / 9.6 ms for the FFN block above (1,024: 9.3 ms).
ROW_CHUNK = 4096


def chunks_rows(x: Tensor) -> bool:
    """Whether :func:`rowwise` would split ``x`` (``[N, ...]``) into chunks."""
    return (
        x.device.type == "cpu"
        and x.shape[0] > ROW_CHUNK
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


def rowwise(fn: Callable[..., tuple[Tensor, ...]], *xs: Tensor) -> tuple[Tensor, ...]:
    """``fn(*xs)``, computed over chunks of :data:`ROW_CHUNK` rows where :func:`chunks_rows` says so.

    Args:
        fn: a position-wise function of tensors ``[N, ...]`` (all with the same ``N``) returning a tuple of
            tensors ``[N, ...]``; it must treat each row on its own.
        xs: its inputs; the first decides whether to chunk.

    Returns:
        ``fn``'s outputs, each contiguous when chunked (their dtypes and trailing shapes are those of the
        first chunk's outputs).
    """
    first = xs[0]
    n = first.shape[0]
    if any(x.shape[0] != n for x in xs):
        raise ValueError(f"rowwise: inputs of {[x.shape[0] for x in xs]} rows; they must agree")
    if not chunks_rows(first):
        return fn(*xs)
    outs: list[Tensor] = []
    for lo in range(0, n, ROW_CHUNK):
        parts = fn(*(x[lo : lo + ROW_CHUNK] for x in xs))
        if not outs:
            outs = [torch.empty((n, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in parts]
        for out, part in zip(outs, parts, strict=True):
            out[lo : lo + part.shape[0]] = part
    return tuple(outs)
