"""gem_kernels.swiglu_ffn: the fused backward kernel under the interpreter against the fp64 reference, the
autograd function's backward by gradcheck, its custom op by opcheck, torch.compile, dispatch and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gem_kernels import swiglu_ffn
from gem_kernels.swiglu.ops import _swiglu_backward_op, _SwiGLUFFN
from gem_kernels.swiglu.reference import swiglu_backward_reference, swiglu_ffn_reference

DRIVER = Path(__file__).with_name("swiglu_interpreter_cases.py")
DRIVER_TIMEOUT_S = 300
# The kernel keeps dh in fp32 where the composition rounds it to the dtype, so its error is at most the
# composition's in the same dtype, give or take the accumulation order: 2x (fp32 cases sit at ~1e-7).
FACTOR = 2.0
LABELS = ("out", "dx", "dw13", "dw2")


def test_kernel_matches_the_fp64_reference(interpreter_results, over_bound):
    assert {r["dtype"] for r in interpreter_results} == {"torch.float32", "torch.float16"}
    assert not over_bound(interpreter_results, FACTOR, LABELS)


def test_kernel_ran_with_finite_outputs_in_the_input_dtype(interpreter_results):
    for r in interpreter_results:
        assert r["finite"], r["name"]
        assert set(r["dtypes"]) == {r["dtype"]}, r
        assert r["launched"] == 1, r  # the fused path ran: one kernel call per backward
        # fp16 cases ask for tensor descriptors (odd seeds: the persistent kernel), taken where H is whole
        # 16-wide tiles (rows are aligned here); everything else runs the pointer kernel
        if r["M"] == 0:
            want = {}
        elif r["dtype"] == "torch.float16" and r["H"] % 16 == 0:
            want = {"persistent" if r["seed"] % 2 else "tma": 1}
        else:
            want = {"pointer": 1}
        assert r["paths"] == want, r


def _inputs(m=9, d=6, hidden=5, d_out=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, d, generator=g, dtype=dtype, requires_grad=True),
        torch.randn(2 * hidden, d, generator=g, dtype=dtype, requires_grad=True),
        torch.randn(d_out, hidden, generator=g, dtype=dtype, requires_grad=True),
    )


def test_autograd_function_gradcheck():
    x, w13, w2 = _inputs()
    assert torch.autograd.gradcheck(lambda a, b, c: _SwiGLUFFN.apply(a, b, c, False), (x, w13, w2))


def test_backward_step_matches_autograd_of_the_composition():
    x, w13, w2 = _inputs(m=13, d=8, hidden=6, d_out=5)
    dy = torch.randn(13, 5, dtype=torch.float64)
    gu = (x @ w13.t()).detach()
    dgu, h = swiglu_backward_reference(dy, w2.detach(), gu)
    gu_leaf = gu.clone().requires_grad_(True)
    gate, up = gu_leaf.chunk(2, dim=-1)
    h_ref = torch.nn.functional.silu(gate) * up
    (h_ref @ w2.detach().t()).backward(dy)
    torch.testing.assert_close(dgu, gu_leaf.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_ref.detach(), rtol=1e-12, atol=1e-12)


def test_backward_op_opcheck():
    dy = torch.randn(7, 4)
    w2 = torch.randn(4, 3)
    gu = torch.randn(7, 6)
    torch.library.opcheck(_swiglu_backward_op, (dy, w2, gu, False))


def test_compiles_with_the_custom_op_in_the_backward():
    x, w13, w2 = _inputs(dtype=torch.float32)
    fn = torch.compile(lambda a, b, c: _SwiGLUFFN.apply(a, b, c, False), backend="aot_eager", fullgraph=True)
    out = fn(x, w13, w2)
    out.square().sum().backward()
    got = [t.grad.clone() for t in (x, w13, w2)]
    for t in (x, w13, w2):
        t.grad = None
    ref = swiglu_ffn_reference(x, w13, w2)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for a, t in zip(got, (x, w13, w2)):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)


def test_cpu_default_is_the_composition():
    x, w13, w2 = _inputs(m=4, dtype=torch.float32, seed=3)
    lead_x = x.detach().reshape(2, 2, -1)
    out = swiglu_ffn(lead_x, w13, w2)
    assert out.shape == (2, 2, 7) and "SwiGLU" not in out.grad_fn.name()  # autograd's nodes, no Function
    torch.testing.assert_close(out, swiglu_ffn_reference(lead_x, w13, w2), rtol=1e-6, atol=1e-7)
    # Forced to the fused function (its reference backward), the same op's node is the function's.
    assert "SwiGLU" in _SwiGLUFFN.apply(x, w13, w2, False).grad_fn.name()


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((4, 6), (10, 6), (7, 4)), "do not chain"),  # w13 rows != 2 * w2 columns
        (((4, 5), (10, 6), (7, 5)), "do not chain"),  # x width != w13 width
        (((4, 6), (10,), (7, 5)), "need x"),
    ],
)
def test_errors(shapes, match):
    x, w13, w2 = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        swiglu_ffn(x, w13, w2)


def test_blocks_from_the_environment(monkeypatch):
    from gem_kernels.swiglu.triton import BLOCKS_ENV, SwiGLUBlocks, default_blocks

    monkeypatch.setenv(BLOCKS_ENV, "64,128,64,8,4,2,1")
    assert default_blocks(torch.device("cpu")) == SwiGLUBlocks(64, 128, 64, 8, 4, 2, prefetch=True)
    monkeypatch.setenv(BLOCKS_ENV, "64,128,64,8,4,2,0,1")
    assert default_blocks(torch.device("cpu")).tma
    assert SwiGLUBlocks.parse(SwiGLUBlocks(tma=True).csv()) == SwiGLUBlocks(tma=True)
    monkeypatch.setenv(BLOCKS_ENV, "64,64,64,8,4,3,0,1,2")
    assert default_blocks(torch.device("cpu")).persistent == 2
    monkeypatch.setenv(BLOCKS_ENV, "64,128")
    with pytest.raises(ValueError, match="7 to 9 comma-separated"):
        default_blocks(torch.device("cpu"))


def test_rejects_integer_inputs():
    with pytest.raises(TypeError, match="dtype"):
        swiglu_ffn(torch.ones(2, 3, dtype=torch.int64), torch.randn(4, 3), torch.randn(3, 2))
