"""block_attention on the PyTorch path against a naive per-sequence, per-block fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_kernels import Rotary, apply_rotary, block_attention
from gem_kernels.block.ops import count_block_pairs

LENGTHS = [0, 1, 63, 64, 65, 2]


def _offsets(lengths, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def _rotate(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Half-split RoPE of one sequence x [n, H, D] at positions [n], pair by pair, in fp64."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        ang = pos * base ** (-2 * i / d)
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        out[:, :, i] = x[:, :, i] * c - x[:, :, i + d // 2] * s
        out[:, :, i + d // 2] = x[:, :, i + d // 2] * c + x[:, :, i] * s
    return out


def naive_block_attention(q, k, v, lengths, block_size, causal, scale, rotary=None):
    """Loop over sequences and blocks; dense softmax attention inside each block (fp64, autograd)."""
    q, k, v = q.double(), k.double(), v.double()
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        if rotary is not None:
            pos = torch.arange(n, dtype=torch.float64)
            if rotary.positions is not None:
                pos = rotary.positions[start : start + n].double()
            qs, ks = _rotate(qs, pos, rotary.base), _rotate(ks, pos, rotary.base)
        for b0 in range(0, n, block_size):
            b1 = min(b0 + block_size, n)
            s = torch.einsum("ihd,jhd->hij", qs[b0:b1], ks[b0:b1]) * scale
            if causal:
                s = s.masked_fill(torch.ones(b1 - b0, b1 - b0, dtype=torch.bool).triu(1), float("-inf"))
            outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vs[b0:b1]))
        start += n
    return torch.cat(outs) if outs else v.new_zeros(0, q.shape[1], v.shape[2])


def _rel(a, b):
    return float(
        (a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30)
    )


def _inputs(lengths, heads=2, d=16, dv=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(total, heads, dv, generator=g, dtype=torch.float64)
    do = torch.randn(total, heads, dv, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v)], do.to(dtype)


def _rotary(kind, total):
    if kind == "none":
        return None
    if kind == "default":
        return Rotary()
    # Real-valued per-token positions, like log time gaps.
    return Rotary(positions=torch.log1p(torch.rand(total, dtype=torch.float64) * 1e4), base=500.0)


@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary_kind", ["none", "default", "float"])
def test_block_attention_matches_naive_fp64(block_size, causal, rotary_kind):
    lengths = LENGTHS
    (q, k, v), do = _inputs(lengths, seed=block_size + causal)
    rotary = _rotary(rotary_kind, sum(lengths))
    out = block_attention(
        q, k, v, _offsets(lengths), max_seq_len=65, block_size=block_size, causal=causal, rotary=rotary
    )
    ref = naive_block_attention(q, k, v, lengths, block_size, causal, 16**-0.5, rotary)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    # fp64 throughout: agreement to rounding.
    assert _rel(out, ref) < 1e-12
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 1e-12


@pytest.mark.parametrize("dtype,factor", [(torch.float32, 1.0), (torch.bfloat16, 2.0), (torch.float16, 2.0)])
def test_block_attention_low_precision(dtype, factor):
    # The reference path computes in fp32 and rounds once per output; bound its error by a small
    # multiple of rounding the exact fp64 result to the same dtype (plus a floor for fp32, whose
    # rounding of inputs dominates).
    lengths = [70, 1, 64, 0, 33]
    (q, k, v), do = _inputs(lengths, d=32, dv=16, dtype=dtype, seed=7)
    rotary = Rotary()
    out = block_attention(
        q, k, v, _offsets(lengths, torch.int32), max_seq_len=70, block_size=32, rotary=rotary
    )
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = naive_block_attention(*leaves, lengths, 32, False, 32**-0.5, rotary)
    floor = _rel(ref.to(dtype), ref) * 4 * factor + 1e-5
    assert out.dtype == dtype
    assert _rel(out, ref) < floor
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < _rel(r.to(dtype), r) * 4 * factor + 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_gradcheck(causal):
    lengths = [3, 0, 5, 1]
    (q, k, v), _ = _inputs(lengths, heads=1, d=4, dv=2, seed=11)
    offsets = _offsets(lengths)
    pos = torch.rand(sum(lengths), dtype=torch.float64) * 5

    def f(q, k, v):
        return block_attention(
            q, k, v, offsets, max_seq_len=5, block_size=2, causal=causal, rotary=Rotary(pos, 30.0)
        )

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_block_attention_fused_equals_unfused_rotary():
    lengths = [65, 9, 0, 128]
    (q, k, v), do = _inputs(lengths, seed=3)
    offsets = _offsets(lengths)
    pos = torch.rand(sum(lengths), dtype=torch.float64) * 50
    fused = block_attention(q, k, v, offsets, max_seq_len=128, rotary=Rotary(pos, 1000.0), causal=True)
    qr = apply_rotary(q, offsets, positions=pos, base=1000.0)
    kr = apply_rotary(k, offsets, positions=pos, base=1000.0)
    unfused = block_attention(qr, kr, v, offsets, max_seq_len=128, causal=True)
    assert _rel(fused, unfused) < 1e-12
    for a, b in zip(torch.autograd.grad(fused, (q, k, v), do), torch.autograd.grad(unfused, (q, k, v), do)):
        assert _rel(a, b) < 1e-12


def test_block_attention_dv_and_scale():
    lengths = [10, 5]
    (q, k, v), _ = _inputs(lengths, d=8, dv=4, seed=5)
    out = block_attention(q, k, v, _offsets(lengths), max_seq_len=10, block_size=4, scale=0.3)
    assert out.shape == (15, 2, 4)
    assert _rel(out, naive_block_attention(q, k, v, lengths, 4, False, 0.3)) < 1e-12


def test_block_attention_empty_batch():
    (q, k, v), _ = _inputs([0, 0], seed=1)
    out = block_attention(q, k, v, _offsets([0, 0]), max_seq_len=0)
    assert out.shape == (0, 2, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_block_attention_opcheck():
    lengths = [5, 0, 9]
    (q, k, v), _ = _inputs(lengths, d=8, dv=8, dtype=torch.float32, seed=2)
    pos = torch.rand(14) * 3
    for rot in ((None, 10000.0, False), (pos, 100.0, True), (None, 50.0, True)):
        args = (q, k, v, _offsets(lengths), 9, 4, True, 0.35, *rot)
        torch.library.opcheck(torch.ops.gem_kernels.block_attention.default, args)


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_flop_count(causal):
    # 600 = 9 * 64 + 24 and 400 = 6 * 64 + 16 tokens: full blocks and a partial last block; one empty
    # sequence.
    total, heads, d, dv = 1000, 4, 32, 16
    q = torch.randn(total, heads, d, requires_grad=True)
    v = torch.randn(total, heads, dv, requires_grad=True)
    offsets = torch.tensor([0, 600, 600, 1000])
    pairs = (lambda w: w * (w + 1) // 2) if causal else (lambda w: w * w)
    valid = 15 * pairs(64) + pairs(24) + pairs(16)
    assert count_block_pairs(offsets, 64, causal) == valid
    assert count_block_pairs(torch.tensor([0]), 64, causal) == 0
    # Small blocks against a pair-by-pair count.
    lengths = [5, 0, 9, 1]
    naive = sum(
        i // 4 == j // 4 and (j <= i or not causal) for n in lengths for i in range(n) for j in range(n)
    )
    assert count_block_pairs(_offsets(lengths), 4, causal) == naive
    with FlopCounterMode(display=False) as counter:
        out = block_attention(q, q, v, offsets, max_seq_len=600, block_size=64, causal=causal)
    # Forward: QK^T and PV, 2 FLOPs per multiply-add, over the valid pairs of each block only.
    assert counter.get_total_flops() == 2 * valid * heads * (d + dv)
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    # Backward: dV, dP, dQ, dK (the recomputed S not counted, as torch counts the SDPA backward).
    assert counter.get_total_flops() == 4 * valid * heads * (d + dv)


def test_block_attention_compiles_without_graph_breaks():
    lengths = [7, 0, 12]
    (q, k, v), do = _inputs(lengths, d=8, dv=8, dtype=torch.float32, seed=9)
    offsets = _offsets(lengths)

    def f(q, k, v, offsets):
        return block_attention(q, k, v, offsets, max_seq_len=12, block_size=4, causal=True, rotary=Rotary())

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, offsets)
    torch.testing.assert_close(out, f(q, k, v, offsets))
    torch.testing.assert_close(
        torch.autograd.grad(out, q, do)[0], torch.autograd.grad(f(q, k, v, offsets), q, do)[0]
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=torch.randn(10, 2)), "q must have 3 dimensions"),
        (dict(k=torch.randn(10, 2, 4, dtype=torch.float64)), "k has dtype"),
        (dict(k=torch.randn(10, 3, 8)), "k must have the shape of q"),
        (dict(v=torch.randn(9, 2, 8)), r"v must have shape \[10, 2, Dv\]"),
        (dict(offsets=torch.tensor([0, 4, 9])), r"offsets\[-1\] must equal the token count 10"),
        (dict(offsets=torch.tensor([0, 6, 4, 10])), "offsets must be non-decreasing"),
        (dict(offsets=torch.tensor([[0, 10]])), "offsets must be 1-D"),
        (dict(max_seq_len=5), "max_seq_len=5 is smaller than the longest sequence"),
        (dict(max_seq_len=5.0), "max_seq_len must be a non-negative int"),
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(scale="x"), "scale must be a number"),
        (dict(rotary=(None, 1.0)), "rotary must be a gem_kernels.Rotary"),
        (dict(rotary=Rotary(torch.zeros(9))), r"positions must have shape \[total\]"),
        (dict(rotary=Rotary(base=-1.0)), "base must be a positive number"),
    ],
)
def test_block_attention_errors(change, match):
    args = dict(
        q=torch.randn(10, 2, 8),
        k=torch.randn(10, 2, 8),
        v=torch.randn(10, 2, 8),
        offsets=torch.tensor([0, 4, 10]),
        max_seq_len=6,
        block_size=4,
        scale=None,
        rotary=None,
    )
    args.update(change)
    q, k, v, offsets = (args.pop(n) for n in ("q", "k", "v", "offsets"))
    with pytest.raises((ValueError, TypeError), match=match):
        block_attention(q, k, v, offsets, **args)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_block_attention_long_sequence(block_size):
    lengths = [1000, 17, 999]
    (q, k, v), do = _inputs(lengths, heads=1, d=8, dv=8, seed=block_size)
    rotary = Rotary()
    out = block_attention(
        q, k, v, _offsets(lengths), max_seq_len=1000, block_size=block_size, causal=True, rotary=rotary
    )
    ref = naive_block_attention(q, k, v, lengths, block_size, True, 8**-0.5, rotary)
    assert _rel(out, ref) < 1e-12
    for g, r in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        assert _rel(g, r) < 1e-12
    assert math.isfinite(float(out.sum()))
