"""``ValueMemo`` (keys compared by value, stored as copies) and the CPU paths that memoise through it: a
changed offsets or positions tensor never meets a stale plan, pattern or table."""

from __future__ import annotations

import torch

from gem_kernels.attention import cpu, cpu_sparse, reference
from gem_kernels.memo import ValueMemo
from gem_kernels.rotary import cpu as rotary_cpu
from gem_kernels.rotary.reference import rotary_reference


def test_equal_values_hit_and_anything_else_misses():
    memo: ValueMemo[int] = ValueMemo(4)
    made: list[int] = []

    def make(n: int):
        return lambda: made.append(n) or n

    a = torch.tensor([0, 3, 5])
    assert memo.get((a, 1), make(1)) == 1
    assert memo.get((a.clone(), 1), make(2)) == 1  # another tensor of the same values: a hit
    assert memo.get((a, 2), make(3)) == 3  # another hashable part
    assert memo.get((a.int(), 1), make(4)) == 4  # another dtype
    assert memo.get((torch.tensor([0, 3, 6]), 1), make(5)) == 5  # another value
    assert memo.get((torch.tensor([0, 3]), 1), make(6)) == 6  # another shape
    assert made == [1, 3, 4, 5, 6]


def test_a_key_changed_in_place_does_not_meet_its_old_entry():
    memo: ValueMemo[str] = ValueMemo(4)
    a = torch.tensor([0, 3, 5])
    assert memo.get((a,), lambda: "old") == "old"
    a[2] = 9  # the caller reuses its buffer
    assert memo.get((a,), lambda: "new") == "new"
    assert memo.get((torch.tensor([0, 3, 5]),), lambda: "again") == "old"


def test_least_recently_used_entries_go_first():
    memo: ValueMemo[int] = ValueMemo(2)
    memo.get((1,), lambda: 1)
    memo.get((2,), lambda: 2)
    memo.get((1,), lambda: -1)  # 1 is now the most recent
    memo.get((3,), lambda: 3)  # evicts 2
    assert memo.get((1,), lambda: -1) == 1
    assert memo.get((2,), lambda: 22) == 22
    memo.clear()
    assert memo.get((1,), lambda: 11) == 11


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def test_attention_after_the_offsets_buffer_changed_in_place():
    """Both CPU paths (padded groups, CSR) and rotary, called again with the same offsets tensor holding
    other lengths (same total), match the oracle each time."""
    g = torch.Generator().manual_seed(3)
    for short in (False, True):  # self-attention (padded groups) / few queries (CSR)
        kv_offsets = _offsets([5, 0, 17, 9])
        q_offsets = _offsets([2, 2, 2, 2]) if short else kv_offsets
        q = torch.randn(int(q_offsets[-1]), 2, 8, generator=g, dtype=torch.float64)
        k = torch.randn(31, 2, 8, generator=g, dtype=torch.float64)
        v = torch.randn(31, 2, 8, generator=g, dtype=torch.float64)
        for lengths in ([5, 0, 17, 9], [1, 20, 0, 10], [5, 0, 17, 9]):
            kv_offsets.copy_(_offsets(lengths))  # in place: the same tensor object, other values
            args = (q, k, v, q_offsets, kv_offsets, "softmax", 3, 0, 0.4, 1.0)
            out, lse = cpu.attention_fwd(*args)
            out_ref, lse_ref = reference.attention_fwd(*args)
            torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
            assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
        assert cpu_sparse.applies(int(q_offsets.diff().max()), int(kv_offsets.diff().max())) == short
    positions = torch.rand(31, generator=g, dtype=torch.float64) * 100
    offsets = _offsets([5, 0, 17, 9])
    for _ in range(2):
        for x in (k, v):  # two calls over the same positions: the second one reuses the tables
            got = rotary_cpu.rotary_cpu(x.contiguous(), offsets, positions, 10000.0, inverse=False)
            torch.testing.assert_close(got, rotary_reference(x, offsets, positions), rtol=1e-12, atol=1e-12)
        positions.mul_(0.5)  # changed in place
