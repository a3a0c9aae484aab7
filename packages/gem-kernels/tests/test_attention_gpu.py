"""The attention Triton kernels on CUDA in bf16/fp16 against the fp32 reference (skipped without a GPU).

Blocks are fixed at 64x64 (the short side of a one-tile kernel at its bucket) and the implementation is
forced ("tiled" general kernels, "onetile" where it applies, or "onetile_split" with chunks of
``SPLIT_CHUNK_ROWS`` so that long sequences span several): one compile per case instead of an autotuning
sweep. The autotuned configurations are checked at the
benchmark shapes by ``benchmarks/bench_attention.py``.
"""

from __future__ import annotations

import pytest
import torch

from gem_kernels import gdpa, jagged_flash_attention, use_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LQ = [0, 1, 200, 513, 64, 37, 600, 129]
LK_CROSS = [5, 0, 64, 17, 1, 33, 48, 64]
LQ_PMA = [32, 0, 32, 1, 32, 17, 32, 32]
LK_PMA = [900, 3, 0, 1500, 64, 129, 700, 1]
CASES = [
    # (activation, q lengths, kv lengths or None, causal, window, head dim)
    ("softmax", LQ, None, True, None, 128),
    ("softmax", LQ, None, False, (100, 30), 64),
    ("softmax", LQ, LK_CROSS, False, None, 128),
    ("softmax", LQ_PMA, LK_PMA, False, None, 64),
    ("silu", LQ, None, False, None, 128),
    ("silu", LQ, None, True, (256, 0), 128),
    ("gelu", LQ, LK_CROSS, False, None, 64),
    ("relu2", LQ_PMA, LK_PMA, False, None, 128),
    ("identity", LQ, None, True, None, 64),
    ("relu", LQ, None, False, (7, 7), 64),
]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _run(act, q, k, v, qo, ko, mq, mk, causal, window):
    if act == "softmax":
        return jagged_flash_attention(
            q, k, v, qo, ko, max_q_len=mq, max_kv_len=mk, causal=causal, window=window
        )
    return gdpa(q, k, v, qo, ko, max_q_len=mq, max_kv_len=mk, activation=act, causal=causal, window=window)


LQ_SHORT = [20, 0, 1, 33, 64, 64, 7, 50]
SPLIT_CHUNK_ROWS = 128  # LQ up to 600 queries: 5 chunks; LK_PMA up to 1500 keys: 12
ONETILE_CASES = [
    # Cross (short keys), PMA (few queries) and short self-attention: the one-tile kernels.
    ("softmax", LQ, LK_CROSS, False, None, 128),
    ("silu", LQ, LK_CROSS, False, None, 128),
    ("softmax", LQ_PMA, LK_PMA, False, None, 128),
    ("gelu", LQ_PMA, LK_PMA, False, None, 64),
    ("softmax", LQ_SHORT, None, True, (9, 0), 64),
    ("silu", LQ_SHORT, None, False, (5, 12), 128),
]


@pytest.mark.parametrize(
    "variant,dtype,act,lq,lk,causal,window,d",
    [("tiled", torch.bfloat16, *c) for c in CASES]
    + [("tiled", torch.float16, *c) for c in CASES[:1] + CASES[5:7]]
    + [("onetile", torch.bfloat16, *c) for c in ONETILE_CASES]
    + [("onetile", torch.float16, *c) for c in ONETILE_CASES[:2]]
    + [("onetile_split", torch.bfloat16, *c) for c in ONETILE_CASES]
    + [("onetile_split", torch.float16, *ONETILE_CASES[0])]
    # Strided inputs (padded rows and heads), read in place by every implementation.
    + [("strided-tiled", torch.bfloat16, *CASES[0]), ("strided-onetile", torch.bfloat16, *ONETILE_CASES[3])]
    + [("strided-onetile_split", torch.bfloat16, *ONETILE_CASES[3])],
)
def test_triton_matches_fp32_reference(variant, dtype, act, lq, lk, causal, window, d):
    torch.manual_seed(0)
    lk_ = lq if lk is None else lk
    qo, ko = _offsets(lq), (None if lk is None else _offsets(lk))
    mq, mk = max(lq), (None if lk is None else max(lk))
    q, k, v = (torch.randn(sum(n), 4, d, device="cuda").to(dtype) for n in (lq, lk_, lk_))
    dout = torch.randn(sum(lq), 4, d, device="cuda").to(dtype)

    from gem_kernels.attention import testing

    strided = variant.startswith("strided-")

    def grads(backend, cdtype):
        # Leaves padded to 2*d in the last dim when strided; the op gets the first d columns (a view).
        leaves = [
            (torch.cat([t, torch.zeros_like(t)], -1) if strided else t)
            .detach()
            .to(cdtype)
            .requires_grad_(True)
            for t in (q, k, v)
        ]
        chunk = SPLIT_CHUNK_ROWS if "split" in variant else None
        forced = testing.forced(variant=variant.removeprefix("strided-"), blocks=(64, 64), chunk=chunk)
        with use_backend(backend), forced:
            out = _run(act, *(t[..., :d] for t in leaves), qo, ko, mq, mk, causal, window)
            out.backward(dout.to(cdtype))
        return [out.detach(), *(t.grad[..., :d] for t in leaves)]

    ref = grads("reference", torch.float32)
    ref_low = grads("reference", dtype)
    tri = grads("triton", dtype)
    for what, a, b, c in zip(("out", "dq", "dk", "dv"), tri, ref, ref_low):
        assert torch.isfinite(a).all(), what
        err = ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()
        ref_err = ((c.float() - b).norm() / b.norm().clamp_min(1e-30)).item()
        # bf16/fp16 kernels round P and dS to the input dtype once more than the reference (which rounds
        # only its output): allow a few times the reference's own error.
        assert err <= 4 * ref_err + 2e-3, f"{what}: {err:.2e} vs reference {ref_err:.2e}"
