"""Jagged softmax attention and GDPA on the reference path (CPU): values, gradients, custom-op checks,
FLOP counting, input validation.

The per-sequence reference is checked against an independent dense formulation (torch SDPA with a boolean
mask for softmax; ``F.silu``/``F.gelu``... with autograd for GDPA), and its hand-written backward with
``gradcheck`` in fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import gem_kernels
from gem_kernels import gdpa, jagged_flash_attention
from gem_kernels.attention import reference

ACTS = ("silu", "gelu", "relu", "relu2", "identity")
TORCH_ACT = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x) ** 2,
    "identity": lambda x: x,
}
# (causal, window) for self-attention; cross-attention only takes (False, None).
MASKS = [(False, None), (True, None), (False, (2, 1)), (True, (3, 0)), (False, (0, 0))]


def _offsets(lengths, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _inputs(lq, lk=None, h=2, d=16, dv=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    tq, tk = sum(lq), sum(lk)
    q = torch.randn(tq, h, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(tk, h, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(tk, h, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, _offsets(lq), _offsets(lk)


def _dense(q, k, v, qo, ko, act, causal, window, scale, out_scale):
    """Independent formulation: per sequence, a dense [H, Lq, Lk] problem with a boolean mask."""
    outs = []
    for b in range(qo.numel() - 1):
        qb = q[qo[b] : qo[b + 1]].transpose(0, 1)
        kb = k[ko[b] : ko[b + 1]].transpose(0, 1)
        vb = v[ko[b] : ko[b + 1]].transpose(0, 1)
        lq, lk = qb.shape[1], kb.shape[1]
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        mask = torch.ones(lq, lk, dtype=torch.bool)
        if window is not None:
            mask &= (j >= i - window[0]) & (j <= i + window[1])
        if causal:
            mask &= j <= i
        if lq == 0:
            continue
        if lk == 0:
            outs.append(torch.zeros(lq, q.shape[1], v.shape[2], dtype=q.dtype))
            continue
        if act == "softmax":
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        else:
            s = scale * qb @ kb.transpose(1, 2)
            ob = out_scale * torch.where(mask, TORCH_ACT[act](s), torch.zeros_like(s)) @ vb
        outs.append(ob.transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


def _run(act, q, k, v, qo, ko, max_q, max_k, causal=False, window=None):
    if act == "softmax":
        return jagged_flash_attention(
            q, k, v, qo, ko, max_q_len=max_q, max_kv_len=max_k, causal=causal, window=window
        )
    return gdpa(
        q, k, v, qo, ko, max_q_len=max_q, max_kv_len=max_k, activation=act, causal=causal, window=window
    )


@pytest.mark.parametrize("act", ("softmax", *ACTS))
@pytest.mark.parametrize("causal,window", MASKS)
def test_self_attention_matches_dense(act, causal, window):
    lengths = [5, 0, 1, 9, 3]
    q, k, v, qo, _ = _inputs(lengths, seed=len(act))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = _run(act, q, k, v, qo, None, max(lengths), None, causal, window)
    want = _dense(q, k, v, qo, qo, act, causal, window, 16**-0.5, 1 / max(lengths))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("act", ("softmax", *ACTS))
def test_cross_attention_matches_dense_with_empty_sequences(act):
    lq, lk = [4, 3, 0, 6, 1], [2, 0, 5, 7, 1]
    q, k, v, qo, ko = _inputs(lq, lk, seed=3)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = _run(act, q, k, v, qo, ko, 6, 7)
    want = _dense(q, k, v, qo, ko, act, False, None, 16**-0.5, 1 / 7)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    # Sequence 1 has no keys: its queries output exactly 0 and get zero gradients.
    assert torch.equal(out[4:7], torch.zeros_like(out[4:7]))
    out.backward(torch.randn_like(out))
    assert torch.equal(q.grad[4:7], torch.zeros_like(q.grad[4:7]))
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("act", ("softmax", *ACTS))
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (1, 2))])
def test_gradcheck_fp64(act, causal, window):
    lengths = [3, 0, 4, 1]
    q, k, v, qo, _ = _inputs(lengths, h=1, d=4, dv=3, seed=7)
    # relu/relu2 have kinks at 0: shift the scores away from 0 is not possible in general, but random
    # fp64 inputs put no score within gradcheck's eps (1e-6) of 0 with overwhelming probability.
    args = tuple(t.requires_grad_(True) for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: _run(act, q, k, v, qo, None, 4, None, causal, window), args
    )


def test_gradcheck_fp64_cross():
    q, k, v, qo, ko = _inputs([2, 3, 0], [3, 0, 2], h=1, d=4, dv=2, seed=11)
    args = tuple(t.requires_grad_(True) for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: _run("softmax", q, k, v, qo, ko, 3, 3), args)
    assert torch.autograd.gradcheck(lambda q, k, v: _run("gelu", q, k, v, qo, ko, 3, 3), args)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("act", ("softmax", "silu"))
def test_low_precision_inputs(dtype, act):
    lengths = [7, 2, 0, 12]
    q, k, v, qo, _ = _inputs(lengths, dtype=dtype, seed=5)
    out = _run(act, q, k, v, qo, None, 12, None, True, None)
    assert out.dtype == dtype
    want = _run(act, q.double(), k.double(), v.double(), qo, None, 12, None, True, None)
    # The reference computes in fp32 and rounds once to the output dtype.
    rel = (out.double() - want).norm() / want.norm()
    assert rel < {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]


def test_opcheck():
    q, k, v, qo, ko = _inputs([3, 0, 5], [2, 4, 1], dtype=torch.float32, seed=1)
    for t in (q, k, v):
        t.requires_grad_(True)
    fwd = torch.ops.gem_kernels.jagged_attention_fwd
    for act, left, right in (("softmax", -1, -1), ("silu", -1, -1), ("gelu", -1, -1)):
        torch.library.opcheck(fwd, (q, k, v, qo, ko, 5, 4, act, left, right, 0.25, 0.5))
    q2, k2, v2, qo2, _ = _inputs([4, 1, 6], dtype=torch.float32, seed=2)
    for t in (q2, k2, v2):
        t.requires_grad_(True)
    torch.library.opcheck(fwd, (q2, k2, v2, qo2, qo2, 6, 6, "softmax", 2, 0, 0.25, 1.0))
    torch.library.opcheck(fwd, (q2, k2, v2, qo2, qo2, 6, 6, "relu2", -1, 0, 0.25, 0.1))
    out, lse = fwd(q2, k2, v2, qo2, qo2, 6, 6, "softmax", -1, 0, 0.25, 1.0)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.gem_kernels.jagged_attention_bwd,
        (
            dout,
            q2.detach(),
            k2.detach(),
            v2.detach(),
            out.detach(),
            lse,
            qo2,
            qo2,
            6,
            6,
            "softmax",
            -1,
            0,
            0.25,
            1.0,
        ),
    )


def test_compile_fullgraph():
    q, k, v, qo, _ = _inputs([3, 5], dtype=torch.float32, seed=4)
    q.requires_grad_(True)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(q, k, v, qo):
        return (
            gdpa(q, k, v, qo, max_q_len=5, causal=True).sum()
            + jagged_flash_attention(q, k, v, qo, max_q_len=5).sum()
        )

    loss = f(q, k, v, qo)
    loss.backward()
    want = (
        gdpa(q, k, v, qo, max_q_len=5, causal=True).sum()
        + jagged_flash_attention(q, k, v, qo, max_q_len=5).sum()
    )
    torch.testing.assert_close(loss, want)
    assert q.grad is not None


def test_flop_counter_counts_valid_pairs():
    lengths = [4, 0, 3]
    q, k, v, qo, _ = _inputs(lengths, h=2, d=16, dv=8, dtype=torch.float32)
    q.requires_grad_(True)
    causal_pairs = 4 * 5 // 2 + 3 * 4 // 2
    assert reference.count_valid_pairs(qo, qo, -1, 0) == causal_pairs
    assert reference.count_valid_pairs(qo, qo, -1, -1) == 16 + 9
    assert reference.count_valid_pairs(qo, qo, 1, 0) == (1 + 2 + 2 + 2) + (1 + 2 + 2)
    with FlopCounterMode(display=False) as fc:
        out = jagged_flash_attention(q, k, v, qo, max_q_len=4, causal=True)
    assert fc.get_total_flops() == 2 * causal_pairs * 2 * (16 + 8)
    with FlopCounterMode(display=False) as fc:
        out.sum().backward()
    assert fc.get_total_flops() == 4 * causal_pairs * 2 * (16 + 8)


def test_gdpa_defaults_and_aliases():
    q, k, v, qo, _ = _inputs([3, 6], seed=9)
    base = gdpa(q, k, v, qo, max_q_len=6, activation="relu2")
    torch.testing.assert_close(gdpa(q, k, v, qo, max_q_len=6, activation="relu_square"), base)
    explicit = gdpa(q, k, v, qo, max_q_len=6, activation="relu2", qk_scale=16**-0.5, out_scale=1 / 6)
    torch.testing.assert_close(explicit, base)
    # out_scale defaults to 1/max_kv_len, so a larger declared max_kv_len scales the output down.
    torch.testing.assert_close(gdpa(q, k, v, qo, max_q_len=6, max_kv_len=12, activation="relu2"), base / 2)


def test_validation_errors():
    q, k, v, qo, ko = _inputs([3, 2], [1, 4], dtype=torch.float32)
    ok = dict(max_q_len=3, max_kv_len=4)
    with pytest.raises(ValueError, match="heads"):
        jagged_flash_attention(q, k[:, :1], v[:, :1], qo, ko, **ok)
    with pytest.raises(ValueError, match="head dim"):
        jagged_flash_attention(q, k[..., :8], v, qo, ko, **ok)
    with pytest.raises(TypeError, match="dtype"):
        jagged_flash_attention(q.to(torch.int32), k, v, qo, ko, **ok)
    with pytest.raises(ValueError, match="dtype"):
        jagged_flash_attention(q, k.double(), v, qo, ko, **ok)
    with pytest.raises(ValueError, match="v must have as many tokens"):
        jagged_flash_attention(q, k, v[:3], qo, ko, **ok)
    with pytest.raises(TypeError, match="q_offsets must be int32 or int64"):
        jagged_flash_attention(q, k, v, qo.float(), ko, **ok)
    with pytest.raises(ValueError, match="kv_offsets has 2 entries"):
        jagged_flash_attention(q, k, v, qo, ko[:2], **ok)
    with pytest.raises(ValueError, match=r"q_offsets\[-1\] must equal the token count"):
        jagged_flash_attention(q, k, v, torch.tensor([0, 3, 4]), ko, **ok)
    with pytest.raises(ValueError, match="max_q_len=2 is smaller"):
        jagged_flash_attention(q, k, v, qo, ko, max_q_len=2, max_kv_len=4)
    with pytest.raises(ValueError, match="max_kv_len is required"):
        jagged_flash_attention(q, k, v, qo, ko, max_q_len=3)
    with pytest.raises(ValueError, match="self-attention only"):
        jagged_flash_attention(q, k, v, qo, ko, causal=True, **ok)
    with pytest.raises(ValueError, match="self-attention only"):
        gdpa(q, k, v, qo, ko, window=(1, 1), **ok)
    with pytest.raises(ValueError, match="window must be a pair"):
        jagged_flash_attention(q, q, q, qo, max_q_len=3, window=(1, -1))
    with pytest.raises(ValueError, match=r"self-attention \(kv_offsets=None\) needs k and v"):
        jagged_flash_attention(q, k[:4], v[:4], qo, max_q_len=3)
    with pytest.raises(ValueError, match="activation must be one of"):
        gdpa(q, k, v, qo, ko, activation="tanh", **ok)
    with pytest.raises(ValueError, match="max_q_len must be a non-negative int"):
        gdpa(q, k, v, qo, ko, max_q_len=3.0, max_kv_len=4)


def test_exported():
    assert gem_kernels.jagged_flash_attention is jagged_flash_attention
    assert gem_kernels.gdpa is gdpa


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    act=st.sampled_from(("softmax", *ACTS)),
    mask=st.sampled_from(MASKS),
    seed=st.integers(0, 2**16),
)
def test_self_attention_random_shapes(lengths, act, mask, seed):
    """Random ragged batches (empty sequences included): forward and gradients match the dense formulation."""
    causal, window = mask
    q, k, v, qo, _ = _inputs(lengths, h=2, d=8, dv=4, seed=seed)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    max_len = max(lengths)
    out = _run(act, q, k, v, qo, None, max_len, None, causal, window)
    want = _dense(q, k, v, qo, qo, act, causal, window, 8**-0.5, 1 / max(max_len, 1))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    if out.numel():
        g = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_strided_inputs_and_contiguous_grads():
    """Views with padded rows and heads (e.g. ``kv.view(T, 2, H, D).unbind(1)``) give the same results as
    contiguous copies, and the gradients come back contiguous (as the fake implementation declares)."""
    q, k, v, qo, ko = _inputs([4, 0, 6], [3, 5, 0], h=2, d=8, dv=8, dtype=torch.float32, seed=12)
    kv = torch.stack([k, v], dim=1).requires_grad_(True)  # [T, 2, H, D]
    qw = torch.cat([q, torch.zeros_like(q)], dim=-1).requires_grad_(True)  # [T, H, 2D]
    ks, vs = kv.unbind(1)
    qs = qw[..., :8]
    assert not ks.is_contiguous() and not qs.is_contiguous()
    out = gdpa(qs, ks, vs, qo, ko, max_q_len=6, max_kv_len=5, activation="gelu")
    g = torch.randn_like(out)
    out.backward(g)
    qc, kc, vc = (t.clone().requires_grad_(True) for t in (q, k, v))
    want = gdpa(qc, kc, vc, qo, ko, max_q_len=6, max_kv_len=5, activation="gelu")
    want.backward(g)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(qw.grad[..., :8], qc.grad)
    torch.testing.assert_close(kv.grad[:, 0], kc.grad)
    torch.testing.assert_close(kv.grad[:, 1], vc.grad)
    dq, dk, dv = torch.ops.gem_kernels.jagged_attention_bwd(
        g, qs.detach(), ks.detach(), vs.detach(), out.detach(), torch.empty(0), qo, ko, 6, 5, "gelu", -1, -1,
        8**-0.5, 0.2,
    )  # fmt: skip
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
