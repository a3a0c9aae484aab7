"""Jagged tile schedules of the persistent attention kernels: which (sequence, tile) pairs hold work, heavy
tiles first.

A persistent kernel launches about one program per SM (not one per tile of the longest sequence) and each
program loops over work items ``w = pid, pid + P, pid + 2P, ...``. The items are the (sequence, outer tile)
pairs that exist (tiles past a sequence's end are skipped, not launched and returned from), sorted by their
cost, the number of inner (key or query) positions they visit in the band, most expensive first: the LPT
(longest processing time first) order that Meta's GDPA kernels use for jagged batches, which keeps the
programs' total loads close to each other when the lengths are log-normal. Every head of a tile is a
separate item (``w // H`` indexes the tile list, ``w % H`` is the head), so a tile's heads run side by side.

Everything is built with torch ops on the offsets' device, with no host synchronisation: the list has the
host-known capacity ``B * cdiv(max_len, block)`` (empty slots sorted to the end), and the number of real
items stays on the device (the kernel loads it). Schedules are cached per offsets tensor (by identity and
version, through a weak reference), so the forward and the dQ kernel of one step share one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileSchedule:
    """Work list of one persistent launch.

    ``tiles`` ``[capacity]`` int32: ``b * n_tiles + t`` (sequence ``b``, outer tile ``t``), real tiles first,
    by decreasing cost; ``count`` ``[1]`` int32 on the device: real tiles times heads (the number of work
    items); ``n_tiles``: outer tiles of the longest sequence (host int); ``capacity`` = ``B * n_tiles``."""

    tiles: torch.Tensor
    count: torch.Tensor
    n_tiles: int
    capacity: int


def build_schedule(
    outer_offsets: torch.Tensor,
    inner_offsets: torch.Tensor,
    max_outer_len: int,
    block_outer: int,
    lo_dist: int,
    hi_dist: int,
    heads: int,
) -> TileSchedule:
    """Schedule of the outer tiles of ``block_outer`` rows over ``outer_offsets`` ``[B+1]``.

    Inner position ``c`` is visible from outer row ``r`` iff ``r - lo_dist <= c <= r + hi_dist`` (and ``c``
    lies in its sequence of ``inner_offsets``); the distances are the launcher's (a large number for an
    unbounded side). A tile's cost is the inner positions its rows visit, plus ``block_outer`` for loading
    and storing the tile itself (so that tiles whose band is empty, which still write zeros, are kept)."""
    batch = outer_offsets.numel() - 1
    n_tiles = max(1, -(-max_outer_len // block_outer))
    dev = outer_offsets.device
    len_o = (outer_offsets[1:] - outer_offsets[:-1]).to(torch.int64)  # [B]
    len_i = (inner_offsets[1:] - inner_offsets[:-1]).to(torch.int64)
    start = torch.arange(n_tiles, device=dev, dtype=torch.int64) * block_outer  # [T]
    lo = (start[None, :] - lo_dist).clamp_min(0)  # [1, T]
    hi = torch.minimum(len_i[:, None], start[None, :] + block_outer + hi_dist)  # [B, T]
    cost = (hi - lo).clamp_min(0) + block_outer
    cost = torch.where(start[None, :] < len_o[:, None], cost, -1).reshape(-1)
    order = torch.sort(cost, descending=True, stable=True).indices.to(torch.int32)
    count = ((cost >= 0).sum() * heads).to(torch.int32).reshape(1)
    return TileSchedule(order, count, n_tiles, batch * n_tiles)


# Weak references to the offsets of recent schedules; an entry is used only while its tensors are alive
# and unmodified (same object, same version), so a freed and reallocated offsets buffer never matches.
_CACHE_SIZE = 16
_cache: dict[
    tuple[object, ...], tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int, int, TileSchedule]
] = {}


def cached_schedule(
    outer_offsets: torch.Tensor,
    inner_offsets: torch.Tensor,
    max_outer_len: int,
    block_outer: int,
    lo_dist: int,
    hi_dist: int,
    heads: int,
) -> TileSchedule:
    """:func:`build_schedule`, reused while the same offsets tensors are passed again unchanged.

    Inference tensors (made under ``torch.inference_mode``) have no version counter, so a change in place
    could not be seen: their schedule is built afresh on every call (a few small ops), never cached."""
    if outer_offsets.is_inference() or inner_offsets.is_inference():
        return build_schedule(
            outer_offsets, inner_offsets, max_outer_len, block_outer, lo_dist, hi_dist, heads
        )
    key = (id(outer_offsets), id(inner_offsets), max_outer_len, block_outer, lo_dist, hi_dist, heads)
    hit = _cache.get(key)
    if hit is not None:
        ro, ri, vo, vi, sched = hit
        same = ro() is outer_offsets and ri() is inner_offsets
        if same and (outer_offsets._version, inner_offsets._version) == (vo, vi):
            return sched
    sched = build_schedule(outer_offsets, inner_offsets, max_outer_len, block_outer, lo_dist, hi_dist, heads)
    if len(_cache) >= _CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    _cache[key] = (
        weakref.ref(outer_offsets),
        weakref.ref(inner_offsets),
        outer_offsets._version,
        inner_offsets._version,
        sched,
    )
    return sched


def clear_cache() -> None:
    """Forget every cached schedule (tests)."""
    _cache.clear()
