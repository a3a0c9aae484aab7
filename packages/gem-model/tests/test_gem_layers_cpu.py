"""CPU forms of gem-model's layers against PyTorch's own: ``RMSNorm``'s three-pass CPU path, the Wukong
FM block's ``Y^T X`` and the SwiGLU's ``fused`` flag.

Tolerances: the RMSNorm path takes the mean square as the squared norm (one extra rounding of the
accumulation dtype) and multiplies by the inverse in another order than PyTorch's composite, so the two
differ by a few ulps of the dtype: fp64 < 1e-14 relative (eps 2.2e-16), fp32 < 2e-6 (eps 1.2e-7)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gem_model.interaction import WukongLayer
from gem_model.layers import RMSNorm

TOL = {torch.float64: 1e-14, torch.float32: 2e-6}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("shape", ((37, 16), (5, 3, 2, 8), (1, 32)))
def test_rms_norm_cpu_matches_pytorch_values_and_gradients(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    base = torch.randn(*shape[:-1], 3 * shape[-1], generator=g, dtype=dtype) * 3
    x = base[..., : shape[-1]].detach().requires_grad_()  # strided: a slice of a wider projection
    norm = RMSNorm(shape[-1], eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    go = torch.randn(shape, generator=g, dtype=dtype)
    out = norm(x)
    ref = F.rms_norm(x, (shape[-1],), norm.weight, 1e-5)
    assert out.dtype == dtype and out.shape == ref.shape
    assert _rel(out, ref) < TOL[dtype]
    got = torch.autograd.grad(out, (x, norm.weight), go)
    want = torch.autograd.grad(ref, (x, norm.weight), go)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) < 10 * TOL[dtype]
    with torch.no_grad():  # the in-place form: the same values, bit for bit
        assert torch.equal(norm(x), out.detach())
    with torch.inference_mode():
        assert torch.equal(norm(x), out.detach())


def test_rms_norm_cpu_without_weight_and_default_eps():
    x = torch.randn(9, 12, dtype=torch.float64)
    norm = RMSNorm(12, elementwise_affine=False, dtype=torch.float64)
    assert _rel(norm(x), F.rms_norm(x, (12,), None, None)) < 1e-14
    zeros = torch.zeros(2, 12)
    assert torch.equal(RMSNorm(12)(zeros), zeros)  # eps keeps the zero row finite


def test_wukong_layer_matches_its_einsum_form():
    """The layer's forward against the textbook form of its FM block (``X^T Y`` as an einsum)."""
    g = torch.Generator().manual_seed(0)
    layer = WukongLayer(n_in=7, n_out=5, n_fm=3, d_model=8, rank=4, hidden=16, eps=1e-5).double()
    x = torch.randn(6, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    b = x.shape[0]
    z = torch.bmm(x, torch.einsum("bnd,nk->bdk", x, layer.fm_y))
    fm = layer.fm_down(F.silu(layer.fm_up(layer.fm_norm(z.reshape(b, -1))))).view(b, 3, 8)
    assert layer.lcb is not None
    ref = layer.norm(torch.cat([fm, layer.lcb(x)], dim=1) + layer.residual(x))
    out = layer(x)
    assert _rel(out, ref) < 1e-14
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (x, layer.fm_y), go)
    want = torch.autograd.grad(ref, (x, layer.fm_y), go)
    for a, w in zip(got, want, strict=True):
        assert _rel(a, w) < 1e-13


class _ReplacedLinear(torch.nn.Linear):
    """Stands for a linear another package swapped in (an FP8 linear): counts its calls."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


def test_swiglu_fused_flag_same_values_and_replaced_projections_are_called():
    from gem_model.layers import SwiGLU

    g = torch.Generator().manual_seed(0)
    plain, fused = SwiGLU(8, 12), SwiGLU(8, 12, fused=True)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 8, generator=g)
    # On the CPU gem_kernels.swiglu_ffn is the composition (autograd's own nodes, not the fused function):
    # the same values and gradients (to MKL's run-to-run rounding: 1e-6 relative).
    out_plain, out_fused = plain(x), fused(x)
    assert "SwiGLU" not in out_fused.grad_fn.name()
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-6, atol=1e-7)
    out_plain.square().sum().backward()
    out_fused.square().sum().backward()
    for a, b in zip(plain.parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    # A projection replaced by another module is called as a module, not bypassed through its weight.
    swapped = _ReplacedLinear(8, 24, bias=False)
    swapped.load_state_dict(fused.w13.state_dict())
    fused.w13 = swapped
    torch.testing.assert_close(fused(x), out_plain.detach(), rtol=1e-6, atol=1e-7)
    assert _ReplacedLinear.calls == 1


@pytest.fixture
def empty_is_nan():
    """Deterministic mode fills ``torch.empty``'s memory with NaN: an uninitialised parameter shows."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.empty(4).isnan().all()
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def test_modules_built_on_a_device_are_initialised_and_meta_ones_wait(empty_is_nan):
    """Every gem-model module with a ``torch.empty`` parameter of its own is usable as built (a piece
    lifted into another stack has no ``GemModel.init_weights``), as ``nn.Linear`` is; on meta nothing runs."""
    from gem_model import FeatureSpec, SequenceFeature, SparseFeature, get_config
    from gem_model.attention import PoolingAttention
    from gem_model.layers import TokenLinear
    from gem_model.model import InputEncoder
    from gem_model.target import TargetAttention

    def built(device: str) -> list[torch.nn.Module]:
        pma = dict(kind="softmax", activation="silu", max_history_len=8, qk_norm=True)
        spec = FeatureSpec(
            n_dense=4,
            sparse=(SparseFeature("user", 40),),
            sequences=(SequenceFeature("hist", 60, 4, 24), SequenceFeature("ads", 20, 3, 12)),
        )  # two sequences: InputEncoder has its seq_type parameter
        config = dataclasses.replace(get_config("tiny"), features=spec)
        return [
            WukongLayer(n_in=7, n_out=5, n_fm=3, d_model=8, rank=4, hidden=16, eps=1e-5, device=device),
            PoolingAttention(8, 2, 4, 3, **pma, device=device),  # type: ignore[arg-type]
            TargetAttention(8, 6, 2, 4, num_actions=3, qk_norm=True, rotary_base=1e4, device=device),
            TokenLinear(7, 5, device=device),
            InputEncoder(config, device=device),
        ]

    for module in built("cpu"):
        for name, p in module.named_parameters():
            assert p.isfinite().all(), f"{type(module).__name__}.{name} left uninitialised"
    for module in built("meta"):
        assert all(p.is_meta for p in module.parameters())
