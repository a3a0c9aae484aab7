"""The fp8_rowwise recipe on shapes its FP8 path cannot take: bf16 inside the layer, never an error.

``torch._scaled_mm`` needs K and N to be multiples of 16. K is zero-padded (exact); a GEMM with N not a
multiple of 16, or M or K below 16, runs unquantized. The rule is the same on every device, so these CPU
tests see what the GPU does (GEMM numerics are emulated in fp32 here).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_precision import MXFP8Linear, Recipe, convert, fp8_rowwise_mm, quantize_rowwise
from gem_precision.linear import _MXLinearFn
from gem_precision.rowwise.ops import rowwise_fallback, scaled_mm_rowwise
from gem_precision.rowwise.reference import quantize_rowwise_reference

FP8 = Recipe.fp8_rowwise()


def _run(recipe: Recipe, lin: MXFP8Linear, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(y, dx, dw, db) of the layer's parameters run through the GEMM Function with ``recipe``."""
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    xx = x.detach().clone().requires_grad_()
    y = _MXLinearFn.apply(xx, w, b, recipe)
    y.backward(g)
    return y.detach(), xx.grad, w.grad, b.grad


def _layer(k: int, n: int, seed: int) -> MXFP8Linear:
    torch.manual_seed(seed)
    return MXFP8Linear.from_linear(nn.Linear(k, n), FP8)


def test_for_layer_decides_per_gemm_at_conversion():
    assert FP8.for_layer(64, 48) is FP8  # every GEMM takes FP8
    # out = 40: forward's N is 40 -> bf16; dgrad (K = 40, padded) and wgrad (M = 40) stay FP8.
    assert FP8.for_layer(64, 40).gemms == ("bf16", "fp8_rowwise", "fp8_rowwise")
    # in = 4 (K = 4 < 16 forward, N = 4 for dgrad and wgrad): all bf16.
    assert FP8.for_layer(4, 512).gemms == ("bf16", "bf16", "bf16")
    assert FP8.for_layer(512, 8).gemms == ("bf16", "bf16", "bf16")  # N = 8 forward, K = 8 dgrad, M = 8 wgrad
    assert Recipe().for_layer(4, 512) == Recipe()  # MXFP8 GEMMs take any shape
    lin = _layer(20, 36, 0)
    assert lin.recipe == FP8 and lin.layer_recipe.gemms == ("bf16", "bf16", "bf16")
    assert "forward=bf16" in repr(lin)
    lin.recipe = Recipe.fp8_rowwise(fp8_fast_accum=False)  # re-decided when the recipe changes
    assert lin.layer_recipe.gemms == ("bf16",) * 3 and not lin.layer_recipe.fp8_fast_accum


@pytest.mark.parametrize(
    ("tokens", "k", "n"),
    [
        (37, 20, 36),  # K and N not multiples of 16: the whole layer is bf16 at conversion
        (4, 64, 512),  # tiny M (the PMA seed projections): each GEMM falls back per call
        (3, 5, 7),
    ],
)
def test_untakeable_shapes_equal_the_bf16_layer(tokens, k, n):
    lin = _layer(k, n, seed=tokens)
    x = torch.randn(tokens, k, dtype=torch.bfloat16)
    g = torch.randn(tokens, n, dtype=torch.bfloat16)
    got = _run(lin.layer_recipe, lin, x, g)
    want = _run(Recipe.bf16(), lin, x, g)
    for a, b, name in zip(got, want, ("y", "dx", "dw", "db")):
        assert torch.equal(a, b), name
    # Through the module (its bf16 fast path or the Function), the same up to F.linear's fused bias.
    xm = x.clone().requires_grad_()
    y = lin(xm)
    y.backward(g)
    torch.testing.assert_close(y, want[0], rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(xm.grad, want[1], rtol=2**-7, atol=1e-2)


def test_takeable_shapes_are_quantized():
    """The comparison above can fail: at 32 tokens the same kind of layer runs FP8 and differs from bf16."""
    lin = _layer(64, 512, seed=1)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    g = torch.randn(32, 512, dtype=torch.bfloat16)
    got, want = _run(lin.layer_recipe, lin, x, g), _run(Recipe.bf16(), lin, x, g)
    for a, b in zip(got[:3], want[:3]):
        assert not torch.equal(a, b)
        assert ((a.double() - b.double()).norm() / b.double().norm()) < 0.06  # E4M3 x E4M3 (test_mx_linear)


@pytest.mark.parametrize("transpose", [False, True])
def test_quantize_pads_k_with_zeros(transpose):
    x = torch.randn(37, 21)
    d, s = quantize_rowwise(x, transpose=transpose)
    dp, sp = quantize_rowwise(x, transpose=transpose, k_multiple=16)
    k = d.shape[1]
    assert dp.shape == (d.shape[0], 48 if transpose else 32) and dp.dtype == d.dtype
    assert torch.equal(dp[:, :k].view(torch.uint8), d.view(torch.uint8))
    assert not dp[:, k:].view(torch.uint8).any()
    assert torch.equal(sp, s)
    with pytest.raises(ValueError, match="k_multiple"):
        quantize_rowwise(x, k_multiple=0)


@pytest.mark.parametrize("tokens", [17, 37, 100])
def test_padded_k_equals_unpadded(tokens):
    """wgrad's K is the token count: padding it to a multiple of 16 changes nothing but the sum's length."""
    dy, x = torch.randn(tokens, 48), torch.randn(tokens, 64)
    got = fp8_rowwise_mm(dy, x, a_t=True, b_t=True, out_dtype=torch.float32)  # dw [48, 64], K = tokens
    qa, sa = quantize_rowwise_reference(dy.t())
    qb, sb = quantize_rowwise_reference(x.t())
    want = scaled_mm_rowwise(qa, sa, qb, sb, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)  # fp32 sums of different lengths


def test_fallback_rule_and_errors():
    assert rowwise_fallback(64, 37, 48) is None  # K is padded
    assert "N=40" in rowwise_fallback(64, 64, 40)
    assert rowwise_fallback(4, 512, 512) is not None and rowwise_fallback(512, 4, 512) is not None
    a, b = torch.randn(8, 5), torch.randn(40, 5)
    # A shape _scaled_mm would refuse is an unquantized product, not an error.
    torch.testing.assert_close(fp8_rowwise_mm(a, b, out_dtype=torch.float32), a @ b.t())
    with pytest.raises(ValueError, match="K differs"):
        fp8_rowwise_mm(a, torch.randn(40, 6))


def test_op_schema_fake_and_dispatch():
    """``gem_precision::fp8_rowwise_mm`` passes torch.library's checks (schema, fake, dispatch)."""
    op = torch.ops.gem_precision.fp8_rowwise_mm.default
    for m, k, n, a_t in ((32, 48, 64, False), (4, 37, 16, True), (20, 21, 40, False)):
        a = torch.randn(k, m) if a_t else torch.randn(m, k)
        b = torch.randn(n, k)
        args = (
            a,
            b,
            a_t,
            False,
            torch.float8_e4m3fn,
            torch.float8_e4m3fn,
            torch.float32,
            True,
            "0.0",
            None,
            None,
        )
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    # With the roofline's per-call rule and a pre-quantized B (a cached weight cast). (test_schema compares
    # the inputs before and after with arithmetic that FP8 tensors do not have on the CPU.)
    a, b = torch.randn(32, 48), torch.randn(64, 48)
    qb, sb = quantize_rowwise(b, k_multiple=16)
    args = (a, b, False, False, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, True, "1.1", qb, sb)
    torch.library.opcheck(op, args, test_utils=("test_faketensor",))


def test_converted_model_with_odd_layers_trains():
    """A converted stack with odd widths and a 4-row input runs forward and backward under bf16 autocast."""
    model = nn.Sequential(nn.Linear(4, 512), nn.ReLU(), nn.Linear(512, 36), nn.ReLU(), nn.Linear(36, 64))
    convert(model, FP8, min_features=0)
    assert all(isinstance(m, MXFP8Linear) for m in model if isinstance(m, nn.Linear))
    for rows in (4, 37):
        x = torch.randn(rows, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        model.zero_grad()


def test_compiles_once_for_any_token_count():
    """Under ``torch.compile(dynamic=True)`` an fp8_rowwise stack is one graph for every token count (the
    per-call fallback is inside the custom op: no guard), without graph breaks, and gives the eager
    results bit for bit (aot_eager: the same kernels; 22 s on the loaded 2-core machine)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = convert(nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 48)), FP8, min_features=0)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, dynamic=True)
    for tokens in (40, 37, 4, 100):  # padded K, tiny M (bf16 per call), ...
        x = torch.randn(tokens, 64)
        out = []
        for fn in (compiled, model):
            xx = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = fn(xx)
            y.float().square().sum().backward()
            out.append((y.detach(), xx.grad, model[0].weight.grad.clone()))
            model.zero_grad()
        for a, b in zip(*out):
            assert torch.equal(a, b), tokens
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_shapes_scaled_mm_refuses_run():
    """On the GPU: the shapes ``torch._scaled_mm`` refuses (K = 4 seeds, K = 37 tokens, N = 40) run, padded
    K matches the CPU emulation, and the PMA-like layer (4 rows, 512 -> 512) equals its bf16 run."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < (8, 9):
        pytest.skip("torch._scaled_mm needs sm89+")
    dy, x = torch.randn(37, 48, device=dev), torch.randn(37, 64, device=dev)
    got = fp8_rowwise_mm(dy, x, a_t=True, b_t=True, out_dtype=torch.float32)
    want = fp8_rowwise_mm(dy.cpu(), x.cpu(), a_t=True, b_t=True, out_dtype=torch.float32)
    # Same quantized operands up to a rounding-midpoint flip (see _triton_interpret_checks), fp32 sums.
    assert ((got.cpu() - want).norm() / want.norm()) < 1e-2
    lin = _layer(512, 512, seed=0).to(dev)
    xs = torch.randn(4, 512, device=dev, dtype=torch.bfloat16)
    gs = torch.randn(4, 512, device=dev, dtype=torch.bfloat16)
    for a, b in zip(_run(lin.layer_recipe, lin, xs, gs), _run(Recipe.bf16(), lin, xs, gs)):
        assert torch.equal(a, b)
    odd = _layer(20, 36, seed=1).to(dev)
    y = odd(torch.randn(37, 20, device=dev, dtype=torch.bfloat16, requires_grad=True))
    y.float().sum().backward()
    assert odd.weight.grad is not None
    # A model-sized token count (not a multiple of 16) through a layer that stays FP8 on all three GEMMs.
    big = _layer(512, 1024, seed=2).to(dev)
    xb = torch.randn(3001, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
    yb = big(xb)
    yb.float().square().mean().backward()
    assert torch.isfinite(big.weight.grad).all() and torch.isfinite(xb.grad).all()


@pytest.mark.parametrize(
    ("tokens", "k", "n"),
    [
        (37, 64, 48),  # both backward GEMMs FP8 (wgrad K = 37 padded): dy's two copies from one pass
        (4, 64, 512),  # tiny M: dgrad (M = 4) and wgrad (K = 4) unquantized
        (37, 64, 40),  # N = 40: dgrad FP8 (K = 40 padded), wgrad's M = 40 FP8, N = 64
        (37, 20, 48),  # K_in = 20: both GEMMs' N is 20 -> unquantized
        (0, 64, 48),  # no tokens: dx empty, dw zeros
        (1, 16, 16),
    ],
)
def test_fused_backward_equals_two_gemms(tokens, k, n):
    """``fp8_rowwise_dgrad_wgrad`` = ``fp8_rowwise_mm`` for dgrad and for wgrad, bit for bit, fallbacks
    included; the layer's backward (which now calls it) gives the same gradients."""
    from gem_precision import fp8_rowwise_dgrad_wgrad

    torch.manual_seed(tokens + k + n)
    dy = torch.randn(tokens, n, dtype=torch.bfloat16) * 3
    w = torch.randn(n, k, dtype=torch.bfloat16)
    x = torch.randn(tokens, k, dtype=torch.bfloat16)
    dx, dw = fp8_rowwise_dgrad_wgrad(dy, w, x, grad_elem_dtype=torch.float8_e5m2)
    want_dx = fp8_rowwise_mm(dy, w, b_t=True, elem_dtype=torch.float8_e5m2, b_elem_dtype=torch.float8_e4m3fn)
    want_dw = fp8_rowwise_mm(dy, x, a_t=True, b_t=True, elem_dtype=torch.float8_e5m2,
                             b_elem_dtype=torch.float8_e4m3fn)  # fmt: skip
    assert dx.shape == (tokens, k) and dw.shape == (n, k)
    assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    lin = MXFP8Linear.from_linear(nn.Linear(k, n), Recipe.fp8_rowwise(grad_elem_dtype=torch.float8_e5m2))
    lin.weight.data = w.float()
    _, gx, gw, _ = _run(lin.layer_recipe, lin, x, dy)
    if lin.layer_recipe.gemms[1:] == ("fp8_rowwise", "fp8_rowwise"):  # the fused op's path
        assert torch.equal(gx, dx) and torch.equal(gw, dw.float())


def test_fused_backward_quantizes_when_it_can():
    """Not vacuous: where both GEMMs take FP8, the fused op differs from the bf16 products."""
    from gem_precision import fp8_rowwise_dgrad_wgrad

    dy, w, x = torch.randn(37, 48), torch.randn(48, 64), torch.randn(37, 64)
    dx, dw = fp8_rowwise_dgrad_wgrad(dy, w, x, out_dtype=torch.float32)
    assert not torch.equal(dx, dy @ w) and not torch.equal(dw, dy.t() @ x)
    assert (dx - dy @ w).norm() / (dy @ w).norm() < 0.06


def test_fused_backward_checks_and_opcheck():
    from gem_precision import fp8_rowwise_dgrad_wgrad, quantize_rowwise_both

    with pytest.raises(ValueError, match="not dy"):
        fp8_rowwise_dgrad_wgrad(torch.randn(8, 16), torch.randn(16, 32), torch.randn(8, 31))
    op = torch.ops.gem_precision.fp8_rowwise_dgrad_wgrad.default
    for m, n, k in ((37, 48, 64), (4, 16, 32), (20, 40, 21)):
        args = (torch.randn(m, n), torch.randn(n, k), torch.randn(m, k), torch.float8_e4m3fn,
                torch.float8_e4m3fn, torch.float32, True, "0.0")  # fmt: skip
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(37, 21)
    rd, rs, cd, cs = quantize_rowwise_both(x, torch.float8_e5m2, row_k_multiple=16, col_k_multiple=16)
    want = (
        *quantize_rowwise(x, torch.float8_e5m2, k_multiple=16),
        *quantize_rowwise(x, transpose=True, k_multiple=16),
    )
    for got, ref in zip((rd, rs, cd, cs), want):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert (
            torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
            if got.dtype.itemsize == 1
            else torch.equal(got, ref)
        )
    with pytest.raises(ValueError, match="k multiples"):
        quantize_rowwise_both(x, col_k_multiple=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_backward_equals_two_gemms():
    """On the GPU the two-copy kernel (dy's row and column copies in one pass) gives the bytes of the two
    separate quantizers, so the fused backward equals two ``fp8_rowwise_mm`` calls bit for bit."""
    from gem_precision import fp8_rowwise_dgrad_wgrad

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < (8, 9):
        pytest.skip("torch._scaled_mm needs sm89+")
    dy = torch.randn(3001, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    x = torch.randn(3001, 512, device=dev, dtype=torch.bfloat16)
    dx, dw = fp8_rowwise_dgrad_wgrad(dy, w, x)
    assert torch.equal(dx, fp8_rowwise_mm(dy, w, b_t=True))
    assert torch.equal(dw, fp8_rowwise_mm(dy, x, a_t=True, b_t=True))


@pytest.mark.parametrize("fused_backward", [True, False])
def test_fast_accumulation_only_in_the_forward_gemm_by_default(monkeypatch, fused_backward):
    """torchao's default: ``use_fast_accum`` for the output GEMM only; dgrad and wgrad (K = the tokens)
    accumulate in fp32 unless ``fp8_fast_accum_backward``. Every FP8 call is recorded with its flag."""
    import gem_precision.linear as lin_mod
    from gem_precision.rowwise import fp8_rowwise_dgrad_wgrad as real_both

    calls: list[tuple[str, bool]] = []

    def mm(a, b, *, a_t=False, b_t=False, use_fast_accum=True, **kw):
        calls.append(("wgrad" if a_t else "dgrad" if b_t else "forward", use_fast_accum))
        return fp8_rowwise_mm(a, b, a_t=a_t, b_t=b_t, use_fast_accum=use_fast_accum, **kw)

    def both(dy, w, x, *, use_fast_accum=True, **kw):
        calls.extend([("dgrad", use_fast_accum), ("wgrad", use_fast_accum)])
        return real_both(dy, w, x, use_fast_accum=use_fast_accum, **kw)

    monkeypatch.setattr(lin_mod, "fp8_rowwise_mm", mm)
    monkeypatch.setattr(lin_mod, "fp8_rowwise_dgrad_wgrad", both)
    layer = _layer(64, 48, seed=3)
    x, g = torch.randn(40, 64), torch.randn(40, 48)
    # Unfused: only dgrad in FP8 (wgrad bf16), so the layer calls fp8_rowwise_mm for it, not the fused op.
    recipe = FP8 if fused_backward else Recipe(forward="fp8_rowwise", dgrad="fp8_rowwise", wgrad="bf16")
    for backward_flag in (False, True):
        calls.clear()
        r = Recipe(**{**recipe.__dict__, "fp8_fast_accum_backward": backward_flag})
        _run(r, layer, x, g)
        fp8_backward = [("dgrad", backward_flag)] + ([("wgrad", backward_flag)] if fused_backward else [])
        assert sorted(calls) == sorted([("forward", True), *fp8_backward]), calls
    assert Recipe.fp8_rowwise().fp8_fast_accum and not Recipe.fp8_rowwise().fp8_fast_accum_backward
