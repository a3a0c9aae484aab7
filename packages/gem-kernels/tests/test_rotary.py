"""apply_rotary on the PyTorch path against an independent complex-number reference in fp64."""

from __future__ import annotations

import pytest
import torch

from gem_kernels import apply_rotary

LENGTHS = [0, 1, 63, 64, 65, 3]


def _offsets(lengths, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def naive_rotary(x: torch.Tensor, lengths, positions=None, base=10000.0) -> torch.Tensor:
    """Half-split RoPE as a complex multiplication, sequence by sequence, in fp64:
    z_i = x[i] + 1j x[i + D/2] times exp(1j * pos * base**(-2i/D))."""
    d = x.shape[-1]
    half = d // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    outs, start = [], 0
    for n in lengths:
        pos = (
            torch.arange(n, dtype=torch.float64)
            if positions is None
            else positions[start : start + n].double()
        )
        xs = x[start : start + n].double()
        z = torch.complex(xs[..., :half], xs[..., half:])
        z = z * torch.polar(torch.ones(n, half, dtype=torch.float64), pos[:, None] * freqs)[:, None, :]
        outs.append(torch.cat([z.real, z.imag], dim=-1))
        start += n
    return torch.cat(outs) if outs else x.double()


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kind", ["default", "int", "float"])
def test_apply_rotary_matches_complex_reference(dtype, tol, kind):
    # Tolerances: fp64 is exact up to rounding; fp32 computes the angle in fp32 (positions < 200, so the
    # angle error is ~1e-5 rad); bf16 rounds the output once (unit roundoff 2^-8 = 4e-3).
    torch.manual_seed(0)
    total = sum(LENGTHS)
    x = torch.randn(total, 3, 16, dtype=torch.float64)
    positions = {
        "default": None,
        "int": torch.randint(0, 200, (total,)),
        "float": torch.rand(total, dtype=torch.float64) * 10,
    }[kind]
    offsets = _offsets(LENGTHS, torch.int32)
    out = apply_rotary(x.to(dtype), offsets, positions=positions, base=500.0)
    assert out.dtype == dtype and out.shape == x.shape
    assert _rel(out, naive_rotary(x.to(dtype), LENGTHS, positions, 500.0)) < tol


def test_apply_rotary_relative_positions():
    # RoPE's defining property: <R(m) q, R(n) k> depends only on m - n.
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 32, dtype=torch.float64), torch.randn(1, 1, 32, dtype=torch.float64)
    one = _offsets([1])

    def dot(m, n):
        rq = apply_rotary(q, one, positions=torch.tensor([m], dtype=torch.float64))
        rk = apply_rotary(k, one, positions=torch.tensor([n], dtype=torch.float64))
        return float((rq * rk).sum())

    assert dot(7.0, 3.0) == pytest.approx(dot(104.0, 100.0), abs=1e-10)
    assert dot(7.0, 3.0) != pytest.approx(dot(7.0, 5.0), abs=1e-3)


def test_apply_rotary_gradcheck():
    torch.manual_seed(2)
    lengths = [2, 0, 3]
    x = torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True)
    pos = torch.rand(5, dtype=torch.float64) * 4
    offsets = _offsets(lengths)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, offsets, positions=pos, base=10.0), (x,))
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, offsets), (x,))


def test_apply_rotary_opcheck():
    torch.manual_seed(3)
    x = torch.randn(6, 2, 8, requires_grad=True)
    offsets = _offsets([4, 2])
    for pos in (None, torch.rand(6) * 3):
        torch.library.opcheck(torch.ops.gem_kernels.apply_rotary.default, (x, offsets, pos, 100.0, False))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=torch.randn(4, 2, 7)), "even head dim"),
        (dict(x=torch.randn(4, 8)), "x must have 3 dimensions"),
        (dict(x=torch.randn(4, 2, 8).int()), "x must have a dtype"),
        (dict(positions=torch.zeros(3)), r"positions must have shape \[total\]"),
        (dict(positions=torch.zeros(4, dtype=torch.bool)), "positions must have an integer or floating"),
        (dict(base=0.0), "base must be a positive number"),
        (dict(offsets=torch.tensor([0, 3])), r"offsets\[-1\] must equal the token count 4"),
        (dict(offsets=torch.tensor([0.0, 4.0])), "offsets must be int32 or int64"),
    ],
)
def test_apply_rotary_errors(kwargs, match):
    args = dict(x=torch.randn(4, 2, 8), offsets=torch.tensor([0, 1, 4]), positions=None, base=10.0)
    args.update(kwargs)
    x, offsets = args.pop("x"), args.pop("offsets")
    with pytest.raises((ValueError, TypeError), match=match):
        apply_rotary(x, offsets, **args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_cpu_path_matches_the_reference(dtype, inverse):
    """The CPU path (:mod:`gem_kernels.rotary.cpu`) against the oracle it re-arranges, forward and inverse,
    ragged lengths with 0 and 1, and an empty batch. Same products in the same compute dtype: a couple of
    roundings of it apart (fp64 < 1e-14, fp32 < 1e-6 relative; bf16: at most one output rounding, 2^-8)."""
    from gem_kernels.rotary.cpu import rotary_cpu
    from gem_kernels.rotary.reference import rotary_reference

    tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 2**-8}[dtype]
    g = torch.Generator().manual_seed(31 + inverse)
    for lengths in (LENGTHS, [0], [1, 0, 2]):
        total = sum(lengths)
        x = torch.randn(total, 2, 12, generator=g, dtype=torch.float64).to(dtype)
        offsets = _offsets(lengths)
        for positions in (None, torch.rand(total, generator=g) * 50):
            got = rotary_cpu(x, offsets, positions, 1000.0, inverse)
            ref = rotary_reference(x, offsets, positions, 1000.0, inverse)
            assert got.dtype == dtype and got.shape == x.shape
            if total:
                assert _rel(got, ref) < tol
