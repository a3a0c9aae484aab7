"""gem_kernels.swiglu_ffn's fused backward on a CUDA device (skipped without one): bf16 at GEM trunks'
widths, ragged token counts, under autocast and inside torch.compile (inductor) with a dynamic token count,
against the fp64 composition; the error bound is the bf16 composition's own error on the same inputs."""

from __future__ import annotations

import pytest
import torch

from gem_kernels import swiglu_ffn
from gem_kernels.swiglu.reference import swiglu_ffn_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# The fused kernel keeps dh in fp32 where the composition rounds it to bf16: at most the composition's
# error, give or take the accumulation order (2x), plus a floor for the tiny cases.
FACTOR, FLOOR = 2.0, 2e-3


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(dy.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _case(m, d, hidden, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, d, device="cuda", generator=g)
    w13 = torch.randn(2 * hidden, d, device="cuda", generator=g) / d**0.5
    w2 = torch.randn(d, hidden, device="cuda", generator=g) / hidden**0.5
    dy = torch.randn(m, d, device="cuda", generator=g)
    return [t.to(dtype) for t in (x, w13, w2)], dy


SHAPES = [
    (0, 512, 2048),
    (1, 512, 2048),
    (4097, 512, 2048),
    (20_011, 512, 2048),
    (3001, 1024, 4096),
    (777, 96, 200),
]  # fmt: skip  (K = 96 takes the masked K loop, H = 200 partial column tiles)


@pytest.mark.parametrize(("m", "d", "hidden"), SHAPES)
def test_fused_matches_fp64(m, d, hidden):
    inputs, dy = _case(m, d, hidden)
    got = _grads(lambda *a: swiglu_ffn(*a, backend="triton"), inputs, dy)
    same = _grads(swiglu_ffn_reference, inputs, dy)
    exact = _grads(swiglu_ffn_reference, [t.double() for t in inputs], dy.double())
    for name, a, s, e in zip(("out", "dx", "dw13", "dw2"), got, same, exact):
        assert a.dtype == torch.bfloat16 and a.isfinite().all(), name
        if e.numel() and e.norm() > 0:
            assert _rel(a, e) <= FACTOR * _rel(s, e) + FLOOR, (name, _rel(a, e), _rel(s, e))


def test_autocast_casts_and_weights_get_fp32_grads():
    inputs, dy = _case(1000, 128, 256, dtype=torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _grads(swiglu_ffn, inputs, dy)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        same = _grads(swiglu_ffn_reference, inputs, dy)
    exact = _grads(swiglu_ffn_reference, [t.double() for t in inputs], dy.double())
    assert got[0].dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in got[1:])
    for a, s, e in zip(got, same, exact):
        assert _rel(a, e) <= FACTOR * _rel(s, e) + FLOOR


def test_inside_torch_compile_with_a_dynamic_token_count():
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, c: swiglu_ffn(a, b, c), dynamic=True)
    for seed, m in enumerate((1000, 2333, 4097)):
        inputs, dy = _case(m, 256, 512, seed=seed)
        got = _grads(fn, inputs, dy)
        exact = _grads(swiglu_ffn_reference, [t.double() for t in inputs], dy.double())
        same = _grads(swiglu_ffn_reference, inputs, dy)
        for a, s, e in zip(got, same, exact):
            assert _rel(a, e) <= FACTOR * _rel(s, e) + FLOOR
