"""Jagged helpers against naive per-sequence loops; gradients, opcheck, errors, fbgemm parity."""

from __future__ import annotations

import pytest
import torch

from gem_kernels import (
    jagged_concat,
    jagged_last_k,
    jagged_mean,
    jagged_split,
    jagged_to_padded,
    padded_to_jagged,
    use_backend,
)

LENGTHS = [0, 1, 63, 64, 65, 1000, 3]


def _offsets(lengths, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def _seqs(values, lengths):
    start = 0
    for n in lengths:
        yield values[start : start + n]
        start += n


def _values(lengths, feat=(3, 2), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), *feat, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("max_len", [70, 64, 5, 0])
def test_jagged_to_padded_and_back(offsets_dtype, max_len):
    x = _values(LENGTHS)
    offsets = _offsets(LENGTHS, offsets_dtype)
    padded = jagged_to_padded(x, offsets, max_len, padding_value=-2.5)
    assert padded.shape == (len(LENGTHS), max_len, 3, 2)
    for b, seq in enumerate(_seqs(x, LENGTHS)):
        n = min(len(seq), max_len)
        assert torch.equal(padded[b, :n], seq[:n])
        assert bool((padded[b, n:] == -2.5).all())
    back = padded_to_jagged(padded, offsets, total=x.shape[0])
    # Tokens past max_len come back as zeros (padded_to_jagged is the adjoint of the truncation).
    for seq, got in zip(_seqs(x, LENGTHS), _seqs(back, LENGTHS)):
        n = min(len(seq), max_len)
        assert torch.equal(got[:n], seq[:n]) and bool((got[n:] == 0).all())


def test_padded_to_jagged_total_from_offsets_and_1d_features():
    padded = torch.randn(3, 4, dtype=torch.float64)
    offsets = torch.tensor([0, 2, 2, 6])
    out = padded_to_jagged(padded, offsets)
    assert torch.equal(out, torch.cat([padded[0, :2], padded[2, :4]]))


def test_jagged_to_padded_gradcheck():
    lengths = [2, 0, 4]
    x = _values(lengths, feat=(2,))
    offsets = _offsets(lengths)
    assert torch.autograd.gradcheck(lambda t: jagged_to_padded(t, offsets, 3, 1.0), (x,))
    padded = torch.randn(3, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: padded_to_jagged(t, offsets, 6), (padded,))


def test_jagged_concat_split_roundtrip():
    a_len, b_len = [1, 0, 3, 0, 2], [2, 4, 0, 0, 1]
    a, b = _values(a_len, seed=1), _values(b_len, seed=2)
    a_off, b_off = _offsets(a_len, torch.int32), _offsets(b_len, torch.int32)
    values, offsets = jagged_concat(a, a_off, b, b_off)
    assert torch.equal(offsets, a_off + b_off)
    expect = torch.cat([torch.cat([sa, sb]) for sa, sb in zip(_seqs(a, a_len), _seqs(b, b_len))])
    assert torch.equal(values, expect)
    a2, b2 = jagged_split(values, offsets, a_off, b_off)
    assert torch.equal(a2, a) and torch.equal(b2, b)
    a3, _ = jagged_split(values, offsets, a_off, b_off, a_total=6)
    assert torch.equal(a3, a)


def test_jagged_concat_split_gradcheck():
    a_len, b_len = [1, 0, 2], [2, 1, 0]
    a, b = _values(a_len, feat=(2,), seed=3), _values(b_len, feat=(2,), seed=4)
    a_off, b_off = _offsets(a_len), _offsets(b_len)
    assert torch.autograd.gradcheck(lambda x, y: jagged_concat(x, a_off, y, b_off)[0], (a, b))
    v = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: jagged_split(t, a_off + b_off, a_off, b_off, a_total=3), (v,))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_jagged_mean(dtype, tol):
    x = _values(LENGTHS, dtype=dtype, seed=5)
    mean = jagged_mean(x, _offsets(LENGTHS))
    expect = torch.stack(
        [s.double().mean(0) if len(s) else torch.zeros(3, 2, dtype=torch.float64) for s in _seqs(x, LENGTHS)]
    )
    assert mean.dtype == dtype and mean.shape == (len(LENGTHS), 3, 2)
    # One rounding of an fp32 sum: within a unit roundoff of the dtype.
    torch.testing.assert_close(mean.double(), expect, rtol=tol, atol=tol)
    assert bool((mean[0] == 0).all())


def test_jagged_mean_gradcheck():
    lengths = [3, 0, 1]
    x = _values(lengths, feat=(2,), seed=6)
    offsets = _offsets(lengths)
    assert torch.autograd.gradcheck(lambda t: jagged_mean(t, offsets), (x,))


@pytest.mark.parametrize("k", [0, 1, 4, 64, 100])
def test_jagged_last_k(k):
    x = _values(LENGTHS, seed=7)
    out, mask = jagged_last_k(x, _offsets(LENGTHS), k)
    assert (
        out.shape == (len(LENGTHS), k, 3, 2) and mask.shape == (len(LENGTHS), k) and mask.dtype == torch.bool
    )
    for b, seq in enumerate(_seqs(x, LENGTHS)):
        n = min(len(seq), k)
        # Left-aligned, in order: slot 0 is the oldest of the last n tokens.
        assert torch.equal(out[b, :n], seq[len(seq) - n :])
        assert bool((out[b, n:] == 0).all())
        assert mask[b].tolist() == [True] * n + [False] * (k - n)


def test_jagged_last_k_gradcheck_and_empty_batch():
    lengths = [3, 0, 1]
    x = _values(lengths, feat=(2,), seed=8)
    offsets = _offsets(lengths)
    assert torch.autograd.gradcheck(lambda t: jagged_last_k(t, offsets, 2)[0], (x,))
    out, mask = jagged_last_k(torch.zeros(0, 4), torch.tensor([0, 0]), 3)
    assert out.shape == (1, 3, 4) and not bool(mask.any())


def test_jagged_opcheck():
    lengths = [2, 0, 5]
    x = torch.randn(7, 3, requires_grad=True)
    off = _offsets(lengths)
    ops = torch.ops.gem_kernels
    torch.library.opcheck(ops.jagged_to_padded.default, (x, off, 4, 0.5))
    torch.library.opcheck(ops.padded_to_jagged.default, (torch.randn(3, 5, 3, requires_grad=True), off, 7))
    b = torch.randn(4, 3, requires_grad=True)
    b_off = _offsets([1, 3, 0])
    torch.library.opcheck(ops.jagged_concat.default, (x, off, b, b_off))
    torch.library.opcheck(ops.jagged_split.default, (torch.randn(11, 3, requires_grad=True), off, b_off, 7))
    torch.library.opcheck(ops.jagged_mean.default, (x, off))
    torch.library.opcheck(ops.jagged_last_k.default, (x, off, 3))


def test_jagged_helpers_compile_without_graph_breaks():
    lengths = [2, 0, 5]
    x = torch.randn(7, 3, requires_grad=True)
    off = _offsets(lengths)

    def f(x, off):
        padded = jagged_to_padded(x, off, 5)
        both, both_off = jagged_concat(x, off, padded_to_jagged(padded * 2, off, 7), off)
        a, b = jagged_split(both, both_off, off, off, a_total=7)
        last, _ = jagged_last_k(b, off, 2)
        return jagged_mean(a, off).sum() + last.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, off), f(x, off))
    torch.testing.assert_close(
        torch.autograd.grad(compiled(x, off), x)[0], torch.autograd.grad(f(x, off), x)[0]
    )


def test_fbgemm_path_matches_pytorch_path():
    pytest.importorskip("fbgemm_gpu")
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm, which the auto backend then uses)

    x = _values(LENGTHS, dtype=torch.float32, seed=9)
    offsets = _offsets(LENGTHS, torch.int32)
    do = torch.randn(len(LENGTHS), 64, 3, 2)
    results = {}
    for backend in ("auto", "reference"):
        with use_backend(backend):
            padded = jagged_to_padded(x, offsets, 64, 1.5)
            back = padded_to_jagged(padded * 3, offsets, x.shape[0])
            grad = torch.autograd.grad(padded, x, do)[0]
        results[backend] = (padded, back, grad)
    for a, b in zip(results["auto"], results["reference"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: jagged_to_padded(torch.randn(5, 2), torch.tensor([0, 5]), -1),
            "max_len must be an int >= 0",
        ),
        (lambda: jagged_to_padded(torch.randn(5, 2), torch.tensor([0, 4]), 5), r"offsets\[-1\] must equal"),
        (lambda: jagged_to_padded(torch.arange(5), torch.tensor([0, 5]), 5), "values must have a dtype"),
        (lambda: padded_to_jagged(torch.randn(2, 3), torch.tensor([0, 1, 2, 3])), "the batch needs 3"),
        (lambda: padded_to_jagged(torch.randn(2), torch.tensor([0, 1, 2])), r"padded must have shape \[B, N"),
        (
            lambda: jagged_concat(
                torch.randn(2, 3), torch.tensor([0, 2]), torch.randn(2, 4), torch.tensor([0, 2])
            ),
            "same feature shape",
        ),
        (
            lambda: jagged_concat(
                torch.randn(2, 3), torch.tensor([0, 2]), torch.randn(2, 3), torch.tensor([0, 1, 2])
            ),
            "b_offsets has 3 entries",
        ),
        (
            lambda: jagged_split(
                torch.randn(4, 2), torch.tensor([0, 4]), torch.tensor([0, 1]), torch.tensor([0, 2])
            ),
            r"b_offsets\[-1\] must equal the token count 3",
        ),
        (
            lambda: jagged_split(
                torch.randn(4, 2), torch.tensor([0, 1, 4]), torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])
            ),
            "offsets must equal a_offsets",
        ),
        (lambda: jagged_last_k(torch.randn(4, 2), torch.tensor([0, 4]), -3), "k must be an int >= 0"),
        (lambda: jagged_mean(torch.randn(4, 2), torch.tensor([0, 5, 4])), "non-decreasing"),
    ],
)
def test_jagged_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
