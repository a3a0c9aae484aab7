"""The vectorized CPU path of jagged attention (:mod:`gem_kernels.attention.cpu`) against the
per-sequence oracle (:mod:`gem_kernels.attention.reference`): values, LSE and all three gradients,
every activation and band, self and cross attention, ragged lengths with 0 and 1; gradcheck through the public
functions; and a count of the Python-level iterations, which must not grow with the batch size.

Tolerances: both paths compute the same products in the same dtype, only batched differently (padding adds
exact zeros to the sums), so they differ only by the summation order of the matmul kernels: a few ulps of
the compute dtype, amplified by at most the conditioning of the softmax. fp64: ||a-b||/||b|| < 1e-12
(eps 2.2e-16, ~4 decades of margin); fp32: < 1e-5 (eps 1.2e-7, ~2 decades).
"""

from __future__ import annotations

import pytest
import torch

from gem_kernels import gdpa, jagged_flash_attention
from gem_kernels.attention import cpu, cpu_groups, cpu_sparse, reference
from gem_kernels.attention.activations import GDPA_ACTIVATIONS
from gem_kernels.memo import ValueMemo

ACTS = ("softmax", *GDPA_ACTIVATIONS)
# (left, right): none, causal, window, causal + window.
BANDS = [(-1, -1), (-1, 0), (2, 1), (3, 0)]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
# (q lengths, kv lengths); None = self-attention.
CASES = [
    ([0, 1, 5, 17, 0, 33, 2, 1], None),  # ragged self-attention with empty and length-1 sequences
    ([1, 1, 1], None),
    ([0, 0], None),  # nothing attends at all
    ([40, 0, 23, 9, 1], [3, 5, 0, 2, 1]),  # long Q / short KV (cross)
    ([1, 2, 0, 1, 4], [37, 64, 5, 0, 1]),  # few Q / long KV (PMA-like)
]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def _inputs(lq, lk, dtype, seed, h=2, d=8, dv=5):
    g = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    q = torch.randn(sum(lq), h, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lk), h, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lk), h, dv, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(sum(lq), h, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout, _offsets(lq), _offsets(lk)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (0 when both are exactly 0, e.g. a batch where nothing attends)."""
    diff = (a.double() - b.double()).norm()
    ref = b.double().norm()
    return float(diff / ref) if ref > 0 else float(diff)


def _random_lengths(g: torch.Generator, cross: bool) -> tuple[list[int], list[int] | None]:
    """A fresh batch of 1-39 sequences, log-normal lengths up to 70 with ~15% empty; ``None`` keys for
    self-attention, else their own log-normal lengths."""
    b = int(torch.randint(1, 40, (1,), generator=g))
    lq = torch.exp(torch.randn(b, generator=g) * 1.2 + 1.5).long().clamp(max=70)
    lq[torch.rand(b, generator=g) < 0.15] = 0
    lk = torch.exp(torch.randn(b, generator=g) * 1.2 + 1.5).long().clamp(max=70).tolist() if cross else None
    return lq.tolist(), lk


def _compare(lq, lk, act, band, dtype, seed, dv=5):
    q, k, v, dout, qo, ko = _inputs(lq, lk, dtype, seed, dv=dv)
    args = (q, k, v, qo, ko, act, *band, 0.37, 0.61)
    out, lse = cpu.attention_fwd(*args)
    out_ref, lse_ref = reference.attention_fwd(*args)
    grads = cpu.attention_bwd(dout, *args, out=out, lse=lse)  # as the autograd op calls it
    grads_ref = reference.attention_bwd(dout, *args)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        assert _rel(a, b) < TOL[dtype], (name, _rel(a, b))
    assert lse.dtype == lse_ref.dtype == torch.float32 and lse.shape == lse_ref.shape
    # Rows with no visible key have LSE -inf on both paths; the finite ones agree to fp32 rounding.
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("band", BANDS, ids=lambda b: f"l{b[0]}r{b[1]}")
@pytest.mark.parametrize("act", ACTS)
def test_matches_oracle(act, band, dtype):
    for i, (lq, lk) in enumerate(CASES):
        _compare(lq, lk, act, band, dtype, seed=1000 * ACTS.index(act) + 10 * BANDS.index(band) + i)


def _count_flash(monkeypatch) -> list[int]:
    """Patch :func:`cpu._flash_softmax` to record each group it takes (its size)."""
    calls: list[int] = []
    real = cpu._flash_softmax

    def counting(qb, kb, vb, grp, qk_scale):
        calls.append(grp.size)
        return real(qb, kb, vb, grp, qk_scale)

    monkeypatch.setattr(cpu, "_flash_softmax", counting)
    return calls


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("band", BANDS, ids=lambda b: f"l{b[0]}r{b[1]}")
@pytest.mark.parametrize("act", ACTS)
def test_sparse_path_matches_oracle(monkeypatch, act, band, dtype):
    """The CSR forward and backward (:mod:`gem_kernels.attention.cpu_sparse`) taking every call, long sides
    included: values, LSE (``-inf`` where a valid query sees no key) and the three gradients against the
    oracle, every band and activation; no padded group is formed."""
    monkeypatch.setattr(cpu_sparse, "SHORT_SIDE", 10**9)
    calls = _count_groups(monkeypatch)
    for i, (lq, lk) in enumerate(CASES):
        _compare(lq, lk, act, band, dtype, seed=9000 + 10 * BANDS.index(band) + i)
    assert calls == []


@pytest.mark.parametrize("act", ("softmax", "silu"))
def test_sparse_path_random_ragged_batches(monkeypatch, act):
    """Fresh random length mixes (log-normal, with zeros), self and cross, all through the CSR path."""
    monkeypatch.setattr(cpu_sparse, "SHORT_SIDE", 10**9)
    g = torch.Generator().manual_seed(2027)
    for trial in range(6):
        lq, lk = _random_lengths(g, cross=bool(trial % 2))
        _compare(lq, lk, act, BANDS[trial % len(BANDS)], torch.float64, seed=trial, dv=8 if trial % 3 else 5)


def test_short_sides_take_the_sparse_path(monkeypatch):
    """PMA-like (2 queries a sequence) and context cross-attention (6 keys) calls take the CSR forward and
    backward; self-attention over longer histories keeps the padded groups."""
    taken: list[tuple[str, int, int]] = []
    for name in ("attention_fwd", "attention_bwd"):
        real = getattr(cpu_sparse, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            q, k = args[:2] if _name == "attention_fwd" else args[1:3]
            taken.append((_name[-3:], q.shape[0], k.shape[0]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(cpu_sparse, name, counting)
    lengths = [0, 1, 9, 30, 17]
    for lq, lk in (([2] * 5, lengths), (lengths, [6] * 5), (lengths, None)):
        q, k, v, dout, qo, ko = _inputs(lq, lk, torch.float32, seed=1)
        args = (q, k, v, qo, ko, "softmax", -1, -1, 0.3, 1.0)
        cpu.attention_bwd(dout, *args, *cpu.attention_fwd(*args))
    assert taken == [("fwd", 10, 57), ("bwd", 10, 57), ("fwd", 57, 30), ("bwd", 57, 30)]


@pytest.mark.skipif(cpu._FLASH_CPU is None, reason="this torch has no fused CPU flash-attention kernel")
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("band", BANDS, ids=lambda b: f"l{b[0]}r{b[1]}")
def test_flash_forward_matches_oracle(monkeypatch, band, dtype):
    """With ``D == Dv`` the softmax forward runs PyTorch's fused CPU kernel (every mask shape: none for causal
    self-attention, band, key padding, both); values, LSE (``-inf`` where a valid query sees no key: the
    window (2, 1) over the short cross-attention keys) and the backward agree with the oracle."""
    calls = _count_flash(monkeypatch)
    for i, (lq, lk) in enumerate(CASES):
        _compare(lq, lk, "softmax", band, dtype, seed=7000 + 10 * BANDS.index(band) + i, dv=8)
    assert calls, "the fused kernel never ran"


def test_flash_absent_falls_back(monkeypatch):
    """Without the fused kernel (another build) the batched-matmul softmax runs, with the same results."""
    q, k, v, _, qo, ko = _inputs([5, 0, 17, 1], [3, 4, 0, 9], torch.float64, seed=11, dv=8)
    args = (q, k, v, qo, ko, "softmax", 2, 1, 0.37, 1.0)
    fused = cpu.attention_fwd(*args)
    monkeypatch.setattr(cpu, "_FLASH_CPU", None)
    calls = _count_flash(monkeypatch)
    plain = cpu.attention_fwd(*args)
    assert calls == []
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(fused[1]), torch.isinf(plain[1]))


def _count_flash_bwd(monkeypatch) -> list[int]:
    """Patch the fused backward kernel to record each group it takes (its size)."""
    calls: list[int] = []
    real = cpu._FLASH_CPU_BWD

    def counting(dout, q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(dout, q, *args, **kwargs)

    monkeypatch.setattr(cpu, "_FLASH_CPU_BWD", counting)
    return calls


@pytest.mark.skipif(cpu._FLASH_CPU_BWD is None, reason="this torch has no fused CPU flash-attention backward")
@pytest.mark.parametrize("band", BANDS, ids=lambda b: f"l{b[0]}r{b[1]}")
def test_flash_backward_matches_oracle(monkeypatch, band):
    """fp32 softmax given the forward's ``out`` and LSE: the fused kernel's backward, every mask shape (none,
    band, key padding, both; valid queries that see no key under the window (2, 1) over short keys), short
    sides too (the CSR path off), then fresh random ragged batches; gradients against the oracle."""
    monkeypatch.setattr(cpu_sparse, "SHORT_SIDE", 0)
    calls = _count_flash_bwd(monkeypatch)
    for i, (lq, lk) in enumerate(CASES):
        _compare(lq, lk, "softmax", band, torch.float32, seed=7100 + 10 * BANDS.index(band) + i, dv=8)
    g = torch.Generator().manual_seed(2028 + BANDS.index(band))
    for trial in range(4):
        lq, lk = _random_lengths(g, cross=bool(trial % 2))
        _compare(lq, lk, "softmax", band, torch.float32, seed=trial, dv=8)
    assert calls, "the fused backward never ran"


@pytest.mark.skipif(cpu._FLASH_CPU_BWD is None, reason="this torch has no fused CPU flash-attention backward")
def test_flash_backward_needs_fp32_and_the_forward_results(monkeypatch):
    """Without ``out`` and LSE, or in fp64 (whose forward LSE was rounded to fp32), the backward takes the
    batched matmuls: the same gradients to each dtype's rounding."""
    calls = _count_flash_bwd(monkeypatch)
    for dtype in (torch.float32, torch.float64):
        q, k, v, dout, qo, ko = _inputs([5, 0, 17, 1, 12], [3, 4, 0, 9, 12], dtype, seed=11, dv=8)
        args = (q, k, v, qo, ko, "softmax", 2, 1, 0.37, 1.0)
        out, lse = cpu.attention_fwd(*args)
        calls.clear()
        with_results = cpu.attention_bwd(dout, *args, out=out, lse=lse)
        assert bool(calls) == (dtype == torch.float32)
        calls.clear()
        without = cpu.attention_bwd(dout, *args)
        assert calls == []
        for a, b in zip(with_results, without, strict=True):
            assert _rel(a, b) < TOL[dtype]


@pytest.mark.parametrize("act", ("softmax", "silu"))
def test_random_ragged_batches(act):
    """Fresh random length mixes (log-normal, with zeros), self and cross."""
    g = torch.Generator().manual_seed(2026)
    for trial in range(6):
        lq, lk = _random_lengths(g, cross=bool(trial % 2))
        band = BANDS[trial % len(BANDS)]
        _compare(lq, lk, act, band, torch.float64, seed=trial, dv=8 if trial % 3 else 5)


def test_int32_offsets():
    """int32 offsets give bit-identical results to int64 ones."""
    q, k, v, dout, qo, ko = _inputs([3, 0, 9], [4, 2, 0], torch.float32, seed=5)
    args = (q, k, v, qo, ko, "relu2", -1, -1, 0.4, 0.3)
    args32 = (q, k, v, qo.int(), ko.int(), "relu2", -1, -1, 0.4, 0.3)
    for a, b in zip(cpu.attention_fwd(*args), cpu.attention_fwd(*args32), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(cpu.attention_bwd(dout, *args), cpu.attention_bwd(dout, *args32), strict=True):
        assert torch.equal(a, b)


def test_split_by_score_budget(monkeypatch):
    """A bucket larger than the score budget is split into chunks, with the same results."""
    monkeypatch.setattr(cpu_sparse, "SHORT_SIDE", 0)  # the padded path, whatever the lengths
    monkeypatch.setattr(cpu_groups, "SCORE_BUDGET", 300)
    calls = _count_groups(monkeypatch)
    _compare([8, 8, 8, 8, 1, 8, 8, 8, 8], None, "softmax", (-1, 0), torch.float64, seed=3)
    # Two buckets, in key order: length 1 (one chunk), then 8 sequences of length 8, each H*8*8 = 128
    # scores: 300 // 128 = 2 per chunk. Forward then backward.
    assert calls == [1, 2, 2, 2, 2] * 2


def test_bf16_inputs_keep_dtype():
    q, k, v, dout, qo, ko = _inputs([7, 0, 12], None, torch.bfloat16, seed=4)
    args = (q, k, v, qo, ko, "gelu", -1, 0, 0.3, 0.5)
    out, _ = cpu.attention_fwd(*args)
    grads = cpu.attention_bwd(dout, *args)
    out_ref, _ = reference.attention_fwd(*args)
    grads_ref = reference.attention_bwd(dout, *args)
    for a, b in zip((out, *grads), (out_ref, *grads_ref), strict=True):
        assert a.dtype == torch.bfloat16
        # Same fp32 compute; the outputs may differ by one bf16 rounding (2**-8 relative).
        assert _rel(a, b) < 2**-7


@pytest.mark.parametrize("act", ["softmax", "silu"])
def test_autocast_does_not_lower_the_compute_precision(act):
    """Under bf16 autocast the path still computes in fp32: the same results as without autocast."""
    q, k, v, dout, qo, ko = _inputs([9, 0, 33, 1], None, torch.float32, seed=6)
    args = (q, k, v, qo, ko, act, -1, 0, 0.3, 0.5)
    expected = (cpu.attention_fwd(*args)[0], *cpu.attention_bwd(dout, *args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = (cpu.attention_fwd(*args)[0], *cpu.attention_bwd(dout, *args))
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)


def _count_groups(monkeypatch) -> list[int]:
    """Patch :func:`cpu_groups.make_group` (called once per Python-level iteration) to record each group's
    size; the plans are not memoised meanwhile (a second call over the same offsets would reuse the first's
    groups)."""
    monkeypatch.setattr(cpu_groups, "PLANS", ValueMemo(0))
    calls: list[int] = []
    real = cpu_groups.make_group

    def counting(members, *args, **kwargs):
        calls.append(int(members.numel()))
        return real(members, *args, **kwargs)

    monkeypatch.setattr(cpu_groups, "make_group", counting)
    return calls


@pytest.mark.parametrize("cross", (False, True))
def test_iterations_do_not_grow_with_batch(monkeypatch, cross):
    calls = _count_groups(monkeypatch)
    pattern = [0, 1, 3, 7, 16, 33, 64, 5]  # one length distribution, every bucket present at both sizes
    counts = {}
    for b in (8, 512):
        lq = (pattern * (b // len(pattern)))[:b]
        lk = lq[::-1] if cross else None
        q, k, v, dout, qo, ko = _inputs(lq, lk, torch.float32, seed=b, d=4, dv=4)
        args = (q, k, v, qo, ko, "softmax", -1, -1, 0.5, 1.0)
        calls.clear()
        cpu.attention_fwd(*args)
        cpu.attention_bwd(dout, *args)
        counts[b] = len(calls)
        assert sum(calls) == 2 * sum(1 for i, n in enumerate(lq) if n > 0 and (lk or lq)[i] > 0)
    buckets = int(cpu_groups.bucket_ids(torch.tensor(max(pattern)))) + 1  # bucket ids of lengths 1..64
    assert counts[8] == counts[512] <= 2 * buckets**2, counts


def test_public_ops_use_vectorized_path(monkeypatch):
    monkeypatch.setattr(cpu_sparse, "SHORT_SIDE", 0)  # the padded path, whatever the lengths
    calls = _count_groups(monkeypatch)

    def forbidden(*args, **kwargs):
        raise AssertionError("the per-sequence oracle ran inside the custom op")

    monkeypatch.setattr(reference, "attention_fwd", forbidden)
    monkeypatch.setattr(reference, "attention_bwd", forbidden)
    q, k, v, _, qo, _ = _inputs([6, 6], None, torch.float32, seed=8)
    q.requires_grad_(True)
    jagged_flash_attention(q, k, v, qo, max_q_len=6, causal=True).sum().backward()
    # Equal lengths: one group of both sequences in the forward, one in the backward.
    assert calls == [2, 2] and q.grad is not None


@pytest.mark.parametrize("act", ACTS)
def test_gradcheck_public_fp64(act):
    q, k, v, _, qo, _ = _inputs([3, 0, 4, 1], None, torch.float64, seed=21, h=1, d=4, dv=3)
    args = tuple(t.requires_grad_(True) for t in (q, k, v))
    if act == "softmax":
        fn = lambda q, k, v: jagged_flash_attention(q, k, v, qo, max_q_len=4, window=(2, 1))
    else:
        fn = lambda q, k, v: gdpa(q, k, v, qo, max_q_len=4, activation=act, causal=True)
    assert torch.autograd.gradcheck(fn, args)


def test_gradcheck_public_fp64_cross():
    q, k, v, _, qo, ko = _inputs([2, 3, 0, 1], [3, 0, 2, 4], torch.float64, seed=22, h=1, d=4, dv=2)
    args = tuple(t.requires_grad_(True) for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: jagged_flash_attention(q, k, v, qo, ko, max_q_len=3, max_kv_len=4), args
    )
    assert torch.autograd.gradcheck(lambda q, k, v: gdpa(q, k, v, qo, ko, max_q_len=3, max_kv_len=4), args)


@pytest.mark.parametrize("act", ["softmax", "silu"])
def test_uninitialised_memory_never_reaches_the_outputs(monkeypatch, act):
    # The head-major copies are allocated uninitialised (only their padding row is zeroed): with every
    # torch.empty of this path poisoned with NaN, the forward still equals the oracle on ragged lengths
    # (0, 1, odd; 17/19/21 and 6/7 share buckets, so groups are padded), so no position is read before it
    # is written.
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    lq = [0, 1, 5, 17, 19, 0, 33, 2, 1, 7, 6, 21]
    q, k, v, _, qo, ko = _inputs(lq, None, torch.float32, seed=3)
    want, want_lse = reference.attention_fwd(q, k, v, qo, ko, act, -1, 0, 0.3, 0.7)
    monkeypatch.setattr(cpu.torch, "empty", nan_empty)
    out, lse = cpu.attention_fwd(q, k, v, qo, ko, act, -1, 0, 0.3, 0.7)
    assert torch.isfinite(out).all()
    assert _rel(out, want) < TOL[torch.float32]
    if act == "softmax":
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu._FLASH_CPU is None, reason="this torch has no fused CPU flash-attention kernel")
def test_flash_padding_never_carries_another_sequence_rows(monkeypatch):
    """The fused forward gathers each group straight from q, k and v (strided views of one projection here),
    reading padding rows from row 0 and zeroing them: with NaN in the first sequence's rows (which row 0 is)
    every other sequence, padded in shared buckets, still equals the oracle and stays finite."""
    calls = _count_flash(monkeypatch)
    lq = [3, 1, 5, 17, 19, 0, 33, 2, 6, 7, 21]
    q, k, v, _, qo, ko = _inputs(lq, None, torch.float32, seed=5, dv=8)  # the fused kernel wants D == Dv
    qkv = torch.stack([q, k, v], dim=1)  # [N, 3, H, D]: q, k and v below are strided views
    qkv[:3] = float("nan")
    q, k, v = qkv.unbind(1)
    for band in ((-1, 0), (4, 0), (-1, -1)):
        out, lse = cpu.attention_fwd(q, k, v, qo, ko, "softmax", *band, 0.3, 1.0)
        want, want_lse = reference.attention_fwd(q, k, v, qo, ko, "softmax", *band, 0.3, 1.0)
        assert torch.isnan(out[:3]).all() and torch.isfinite(out[3:]).all(), band
        assert _rel(out[3:], want[3:]) < TOL[torch.float32], band
        torch.testing.assert_close(lse[3:], want_lse[3:], rtol=1e-5, atol=1e-5)
    assert calls, "the fused kernel never ran"
