"""The persistent attention kernels (``tma``; ``auto`` where it picks them) on CUDA in bf16/fp16 against the
fp32 reference, at realistic shapes (skipped without a GPU).

H=4, D=128 (and 64), ragged lengths from 0 to ~2000 including 1 and non-multiples of every tile; causal and
non-causal softmax, causal/non-causal/windowed silu GDPA, cross and PMA shapes; forward and the three
gradients. Most cases fix 64x64 tiles, two run autotuned (the production configurations), one 32x64. On
compute capability >= 9 the ``tma`` variant must have taken the TMA path. 14 cases of a few seconds of
compilation each.
"""

from __future__ import annotations

import pytest
import torch

from gem_kernels import gdpa, jagged_flash_attention, use_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LQ = [0, 1, 200, 513, 64, 37, 1999, 129, 1024, 700, 3, 1500]
LK_CROSS = [5, 0, 64, 17, 1, 33, 48, 64, 20, 64, 7, 30]
LQ_PMA = [32, 0, 32, 1, 32, 17, 32, 32]
LK_PMA = [900, 3, 0, 1500, 64, 129, 2000, 1]
CASES = [
    # (activation, q lengths, kv lengths or None, causal, window, head dim)
    ("softmax", LQ, None, True, None, 128),
    ("softmax", LQ, None, False, None, 128),
    ("silu", LQ, None, False, None, 128),
    ("silu", LQ, None, True, None, 128),
    ("silu", LQ, None, True, (256, 0), 128),
    ("softmax", LQ, LK_CROSS, False, None, 128),
    ("silu", LQ_PMA, LK_PMA, False, None, 128),
    ("gelu", LQ, None, False, (100, 30), 64),
]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _run(act, q, k, v, qo, ko, mq, mk, causal, window):
    if act == "softmax":
        return jagged_flash_attention(
            q, k, v, qo, ko, max_q_len=mq, max_kv_len=mk, causal=causal, window=window
        )
    return gdpa(q, k, v, qo, ko, max_q_len=mq, max_kv_len=mk, activation=act, causal=causal, window=window)


# Fixed 64x64 tiles (one compile per kernel and case; they fit every kernel at D=128 with the launch's
# default 4 warps and 3 stages) except two autotuned cases (the production path: 128-row outer tiles).
FIXED = (64, 64)


@pytest.mark.parametrize(
    "variant,dtype,blocks,act,lq,lk,causal,window,d",
    [("tma", torch.bfloat16, FIXED, *c) for c in CASES]
    + [("tma", torch.float16, FIXED, *CASES[0]), ("tma", torch.bfloat16, (32, 64), *CASES[3])]
    + [("tma", torch.bfloat16, None, *CASES[0]), ("tma", torch.bfloat16, None, *CASES[2])]
    # The default: on sm_90 the TMA forward everywhere, the TMA backward only without a mask.
    + [("auto", torch.bfloat16, None, *CASES[0]), ("auto", torch.bfloat16, None, *CASES[2])],
)
def test_persistent_matches_fp32_reference(variant, dtype, blocks, act, lq, lk, causal, window, d):
    from gem_kernels.attention import testing

    torch.manual_seed(0)
    lk_ = lq if lk is None else lk
    qo, ko = _offsets(lq), (None if lk is None else _offsets(lk))
    mq, mk = max(lq), (None if lk is None else max(lk))
    q, k, v = (torch.randn(sum(n), 4, d, device="cuda").to(dtype) for n in (lq, lk_, lk_))
    dout = torch.randn(sum(lq), 4, d, device="cuda").to(dtype)

    def grads(backend, cdtype):
        leaves = [t.detach().to(cdtype).requires_grad_(True) for t in (q, k, v)]
        with use_backend(backend), testing.forced(variant=variant, blocks=blocks):
            out = _run(act, *leaves, qo, ko, mq, mk, causal, window)
            out.backward(dout.to(cdtype))
        return [out.detach(), *(t.grad for t in leaves)]

    ref = grads("reference", torch.float32)
    ref_low = grads("reference", dtype)
    before = testing.persistent_launches()
    tri = grads("triton", dtype)
    ran = {key for key, n in testing.persistent_launches().items() if n > before.get(key, 0)}
    path = "tma" if torch.cuda.get_device_capability()[0] >= 9 else "pointer"
    expected = {("fwd", path), ("dq", path), ("dkdv", path)}
    if variant == "auto":
        on_sm90 = torch.cuda.get_device_capability() == (9, 0)
        unmasked = not causal and window is None
        expected = {("fwd", "tma")} | ({("dq", "tma"), ("dkdv", "tma")} if unmasked else set())
        expected = expected if on_sm90 else set()
    assert ran == expected, ran
    for what, a, b, c in zip(("out", "dq", "dk", "dv"), tri, ref, ref_low):
        assert torch.isfinite(a).all(), what
        err = ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()
        ref_err = ((c.float() - b).norm() / b.norm().clamp_min(1e-30)).item()
        # As test_attention_gpu.py: the kernels round P and dS to the input dtype once more than the
        # reference (which rounds only its output): a few times the reference's own error.
        assert err <= 4 * ref_err + 2e-3, f"{what}: {err:.2e} vs reference {ref_err:.2e}"
    if lk is not None:  # queries of an empty key sequence: exactly zero output and gradient
        for b_, n in enumerate(lk):
            if n == 0:
                rows = slice(int(qo[b_]), int(qo[b_ + 1]))
                assert (tri[0][rows] == 0).all() and (tri[1][rows] == 0).all()
