"""FP8 only where it pays: the roofline (``gem_precision.roofline``), the recipe's per-layer choice
(``Recipe.fp8_rowwise(auto_fallback=True)``), the per-call fallback of ``fp8_rowwise_mm`` and the cached
weight casts (``gem_precision.weight_cache``)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from gem_precision import MXFP8Linear, Recipe, convert
from gem_precision.roofline import H100, H200, DeviceRates, fp8_gemm_speedup, use_rates
from gem_precision.rowwise import FP8_ALIGN, fp8_rowwise_mm, quantize_rowwise, rowwise_fallback
from gem_precision.rowwise.ops import scaled_mm_rowwise
from gem_precision.weight_cache import cache_fp8_weights, cached_layers, invalidate_fp8_weights

# Rates under which FP8 pays at any size (free casts, FP8 twice as fast): the FP8 path at CPU-sized shapes.
FREE_CASTS = DeviceRates("test", bf16_flops=1e12, fp8_flops=2e12, fp8_flops_precise=2e12, copy_bytes=1e18,
                         cast_kernel_s=0.0, fp8_k_overhead=0, sms=1)  # fmt: skip


# An H200 whose FP8 GEMMs lose nothing to their epilogue or a partial wave: large-h200's up-projection pays as
# a layer at scale (never at a few dozen tokens).
PAYS_AT_SCALE = replace(H200, fp8_k_overhead=0, sms=1)


def test_roofline_grows_with_tokens_and_width():
    s = [fp8_gemm_speedup(m, 1024, 8192, rates=H100) for m in (256, 4096, 65536, 1 << 20)]
    assert s == sorted(s) and s[0] < 1 < s[-1]
    # At base-h200's width (512) no GEMM pays even with unlimited tokens; at 8192 all three do on an H200.
    for a_col, b_col in ((False, False), (False, True), (True, True)):
        assert fp8_gemm_speedup(1 << 24, 512, 512, a_col=a_col, b_col=b_col, rates=H200) < 1
    assert fp8_gemm_speedup(1 << 24, 8192, 8192, a_col=True, b_col=True, precise=True, rates=H200) > 1.1
    # More bandwidth, cheaper casts; column-wise casts cost more than row-wise ones; a cached B costs none.
    assert fp8_gemm_speedup(65536, 1024, 4096, rates=H200) > fp8_gemm_speedup(65536, 1024, 4096, rates=H100)
    assert fp8_gemm_speedup(4096, 1024, 1024, b_col=True) < fp8_gemm_speedup(4096, 1024, 1024)
    assert fp8_gemm_speedup(4096, 1024, 1024, b_cached=True) > fp8_gemm_speedup(4096, 1024, 1024)
    assert fp8_gemm_speedup(0, 1024, 1024) == 0.0


@pytest.mark.parametrize(
    ("i", "o", "gemms"),
    [
        # base-h200's layers: nothing pays. The SwiGLU up-projection's forward (K = 512) measured 0.89x on an
        # H100 (the FP8 epilogue's share at a short K), its down-projection's dgrad 0.73x.
        (512, 512, ("bf16", "bf16", "bf16")),
        (512, 4096, ("bf16", "bf16", "bf16")),
        (2048, 512, ("bf16", "bf16", "bf16")),
        # large-h200's up-projection: its forward pays (1.45x measured), the layer does not (1.07x predicted
        # over its three GEMMs, under AUTO_MIN_SPEEDUP): a plain F.linear.
        (1024, 8192, ("bf16", "bf16", "bf16")),
        (4096, 4096, ("fp8_rowwise", "fp8_rowwise", "bf16")),
        (8192, 8192, ("fp8_rowwise", "fp8_rowwise", "bf16")),  # wgrad's two column casts still cost too much
    ],
)
def test_recipe_auto_fallback_per_gemm(i, o, gemms):
    auto = Recipe.fp8_rowwise(auto_fallback=True)
    assert auto.fp8_min_speedup > 1.0
    assert auto.for_layer(i, o).gemms == gemms
    best = auto.gemm_speedups(i, o)
    paying = [g for g in ("forward", "dgrad", "wgrad") if best[g] >= auto.fp8_min_speedup]
    layer_pays = bool(paying) and Recipe.layer_speedup(best, paying) >= auto.fp8_min_speedup
    for name, fmt in zip(("forward", "dgrad", "wgrad"), gemms):
        assert (layer_pays and name in paying) == (fmt == "fp8_rowwise"), (name, best)
    assert Recipe.layer_speedup(best, []) == 1.0
    # Without auto_fallback every shape FP8 can take runs FP8, as before.
    assert Recipe.fp8_rowwise().for_layer(i, o).gemms == ("fp8_rowwise",) * 3


def test_recipe_rejects_a_negative_min_speedup():
    with pytest.raises(ValueError, match="fp8_min_speedup"):
        Recipe.fp8_rowwise(fp8_min_speedup=-1)


def test_per_call_fallback_by_tokens():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(512, 256, generator=g)
    why = rowwise_fallback(64, 256, 512, min_speedup=1.1)
    assert why is not None and "roofline predicts" in why and rowwise_fallback(64, 256, 512) is None
    # Predicted to lose on an H100 (the CPU's table): the unquantized product, bit for bit.
    auto = fp8_rowwise_mm(a, b, min_speedup=1.1, out_dtype=torch.float32)
    assert torch.equal(auto, a @ b.t())
    # Where it pays (free casts): the FP8 product, which is not the unquantized one.
    with use_rates(FREE_CASTS):
        assert rowwise_fallback(64, 256, 512, min_speedup=1.1) is None
        fp8 = fp8_rowwise_mm(a, b, min_speedup=1.1, out_dtype=torch.float32)
    qa, sa = quantize_rowwise(a, k_multiple=FP8_ALIGN)
    qb, sb = quantize_rowwise(b, k_multiple=FP8_ALIGN)
    assert torch.equal(fp8, scaled_mm_rowwise(qa, sa, qb, sb, out_dtype=torch.float32))
    assert not torch.equal(fp8, auto)


def test_auto_layer_that_never_pays_is_a_plain_linear():
    lin = nn.Linear(512, 512)
    conv = MXFP8Linear.from_linear(copy.deepcopy(lin), Recipe.fp8_rowwise(auto_fallback=True))
    assert conv.layer_recipe.gemms == ("bf16", "bf16", "bf16")
    x = torch.randn(32, 512)
    assert torch.equal(conv(x), lin(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 48))


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return float(loss), grads


@pytest.mark.parametrize("fused", [True, False])
def test_weight_cache_gives_the_uncached_steps(fused):
    """Cached and uncached layers step identically, bit for bit, across optimizer steps (fused AdamW moves no
    version counter: the optimizer hook must invalidate) and a load_state_dict."""
    recipe = Recipe.fp8_rowwise()
    plain = convert(_model(), recipe, min_features=0)
    cached = copy.deepcopy(plain)
    handle = cache_fp8_weights(cached, torch.bfloat16)
    assert handle is not None and len(cached_layers(cached)) == 2
    opts = [
        torch.optim.AdamW(m.parameters(), lr=0.05, fused=fused, foreach=not fused) for m in (plain, cached)
    ]
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(40, 64, generator=g)
        if step == 2:  # weights changed outside an optimizer step
            state = {k: v + 0.01 for k, v in plain.state_dict().items()}
            plain.load_state_dict(state)
            cached.load_state_dict(state)
        lp, gp = _step(plain, opts[0], x)
        lc, gc = _step(cached, opts[1], x)
        assert lp == lc and all(torch.equal(a, b) for a, b in zip(gp, gc)), step
        layer = cached_layers(cached)[0]
        # The cache holds the casts of the weight the step used (it went stale on opt.step()).
        w16 = layer.weight.detach().to(torch.bfloat16)
        assert layer.fp8_w_row is not None and layer.fp8_w_colt is not None
    # After the last step the cache is stale until the next forward refreshes it.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached(torch.randn(8, 64))
    row, _ = quantize_rowwise(w16, k_multiple=FP8_ALIGN)
    assert torch.equal(layer.fp8_w_row.view(torch.uint8), row.view(torch.uint8))
    invalidate_fp8_weights(cached)
    assert all(m.fp8_cache_key is None for m in cached_layers(cached))
    handle.remove()


def test_weight_cache_is_used_and_not_saved(monkeypatch):
    model = convert(_model(), Recipe.fp8_rowwise(), min_features=0)
    cache_fp8_weights(model, torch.bfloat16)
    x = torch.randn(40, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)  # fills the cache
    calls = []
    import gem_precision.rowwise.ops as rowwise_ops

    real = rowwise_ops.quantize_rowwise
    monkeypatch.setattr(
        rowwise_ops, "quantize_rowwise", lambda t, *a, **k: calls.append(t.shape) or real(t, *a, **k)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    # Only activations and gradients are cast now: x, h (forward), dy twice per layer (dgrad, wgrad), x.T.
    weights = {tuple(m.weight.shape) for m in cached_layers(model)} | {
        tuple(m.weight.shape[::-1]) for m in cached_layers(model)
    }
    assert calls and not any(tuple(s) in weights for s in calls), calls
    assert not any(k.startswith("fp8_w") or ".fp8_w" in k for k in model.state_dict())


def test_auto_recipe_and_cache_compile_without_recompiles():
    """Per-layer compile (dynamic token counts) of layers with the auto recipe and cached weight casts: one
    graph for every token count, no graph break, the eager results."""
    from torch._dynamo.testing import CompileCounter

    class Block(nn.Module):  # a block's forward is user code: dynamo traces it as one frame
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(1024, 8192), nn.Linear(8192, 1024)  # large-h200's SwiGLU

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.nn.functional.silu(self.up(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[0](x)

    torch.manual_seed(0)
    with use_rates(PAYS_AT_SCALE):
        model = convert(Model(), Recipe.fp8_rowwise(auto_fallback=True))
    assert model.layers[0].up.layer_recipe.forward == "fp8_rowwise"  # decided per call (few tokens: bf16)
    eager = copy.deepcopy(model)
    cache_fp8_weights(model, torch.bfloat16)
    counter = CompileCounter()
    model.layers[0].compile(backend=counter, dynamic=True)
    for tokens in (24, 40, 56):
        x = torch.randn(tokens, 1024)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = model(x), eager(x)
        assert torch.equal(got, want)
    assert counter.frame_count == 1
    assert model.layers[0].up.fp8_w_row is not None  # the cache was filled (and read) in the compiled block
