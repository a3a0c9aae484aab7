""":class:`gem_parallel.all_gather.AllGatherRound` on its own (one process, no FSDP): the unit's shards are
quantized in one batch per round, every shard gets the bytes of quantizing it alone at that moment, and
membership follows the shards a round actually serves."""

from __future__ import annotations

import pytest
import torch

from gem_parallel.all_gather import AllGatherRound, QuantizedAllGatherWeight
from gem_precision.packed import quantize_packed


def _shards(fmt: str, round_: AllGatherRound, n: int = 3) -> list[QuantizedAllGatherWeight]:
    g = torch.Generator().manual_seed(n)
    shards = [QuantizedAllGatherWeight(torch.randn(4 + i, 64, generator=g), fmt, round_) for i in range(n)]
    for s in shards:
        round_.add(s)
    return shards


def _gather(round_: AllGatherRound, shards: list[QuantizedAllGatherWeight]) -> None:
    """One FSDP round: each shard's pre-all-gather input equals quantizing it alone, now."""
    for s in shards:
        (packed,), _ = s.fsdp_pre_all_gather(None, None, None, None, None)
        assert torch.equal(packed, quantize_packed(s._tensor, round_.fmt))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_one_batch_per_round_and_fresh_bytes(fmt):
    round_ = AllGatherRound(fmt)
    shards = _shards(fmt, round_)
    _gather(round_, shards)
    assert round_.batches == 1
    for s in shards:  # an optimizer step: in place, same tensors
        s._tensor.mul_(-1.5).add_(0.25)
    _gather(round_, shards[::-1])  # any order
    assert round_.batches == 2
    # A write between two calls of one round (never done by FSDP) bumps the version: re-quantized, not stale.
    shards[0].fsdp_pre_all_gather(None, None, None, None, None)
    shards[1]._tensor.add_(1.0)
    _gather(round_, shards[1:])
    assert round_.batches == 4


def test_members_follow_what_a_round_serves():
    round_ = AllGatherRound("fp8")
    a, b, gone = _shards("fp8", round_)
    new = QuantizedAllGatherWeight(torch.randn(5, 64), "fp8", round_)  # e.g. FSDP re-created a shard
    _gather(round_, [a, b, new])  # 'gone' (a member never asked for) is quantized in round 1's batch...
    assert round_.batches == 2  # ...and 'new', unknown to it, in a batch of its own
    _gather(round_, [a, b, new])  # round 2's members: the three served, 'gone' dropped
    assert round_.batches == 3 and len(round_._kept) == 0
    del gone


def test_shard_without_round_quantizes_alone():
    s = QuantizedAllGatherWeight(torch.randn(3, 64), "fp8")
    (packed,), _ = s.fsdp_pre_all_gather(None, None, None, None, None)
    assert torch.equal(packed, quantize_packed(s._tensor, "fp8"))
    assert s.detach()._round is None
    r = AllGatherRound("fp8")
    assert QuantizedAllGatherWeight(torch.randn(3, 64), "fp8", r)[:2]._round is r  # FSDP's slices keep it


def test_members_left_on_another_device_are_skipped():
    """A model built on the meta device and materialised after ``fully_shard`` (``to_empty``): FSDP derives
    new shards, and the round's first members, still on the meta device, must not join a batch."""
    round_ = AllGatherRound("fp8")
    ghost = QuantizedAllGatherWeight(torch.empty(4, 64, device="meta"), "fp8", round_)
    round_.add(ghost)
    real = QuantizedAllGatherWeight(torch.randn(4, 64), "fp8", round_)
    (packed,), _ = real.fsdp_pre_all_gather(None, None, None, None, None)
    assert torch.equal(packed, quantize_packed(real._tensor, "fp8"))
