"""The Triton paths on a CUDA device in bf16/fp16 (skipped without one): block attention with and without
rotary, apply_rotary and the jagged helpers, against fp32 references on the same inputs."""

from __future__ import annotations

import pytest
import torch

from gem_kernels import (
    Rotary,
    apply_rotary,
    block_attention,
    jagged_mean,
    jagged_to_padded,
    padded_to_jagged,
    use_backend,
)
from gem_kernels.block.reference import (
    block_attention_backward_reference,
    block_attention_reference,
    rotary_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _offsets(lengths):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary_kind", ["none", "default", "float"])
def test_block_attention_cuda(dtype, block_size, causal, rotary_kind):
    torch.manual_seed(block_size)
    lengths = [0, 1, 63, 64, 65, 1000, 130]
    total = sum(lengths)
    offsets = _offsets(lengths)
    q, k, v, do = (torch.randn(total, 4, 128, device="cuda", dtype=dtype) for _ in range(4))
    rotary = {
        "none": None,
        "default": Rotary(),
        "float": Rotary(torch.log1p(torch.rand(total, device="cuda") * 1e4) * 20, 500.0),
    }[rotary_kind]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = block_attention(
        *leaves, offsets, max_seq_len=1000, block_size=block_size, causal=causal, rotary=rotary
    )
    grads = torch.autograd.grad(out, leaves, do)
    args = (
        offsets,
        block_size,
        causal,
        128**-0.5,
        *((rotary.positions, rotary.base) if rotary else (None, 1e4)),
    )
    f32 = [t.float() for t in (q, k, v)]
    ref = block_attention_reference(*f32, *args, rotary is not None)
    ref_grads = block_attention_backward_reference(do.float(), *f32, *args, rotary is not None)
    # Bound: 4x the error of rounding the fp32 result to the dtype (the kernel rounds the rotated q/k,
    # P and dS once more than the reference).
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert got.dtype == dtype
        assert _rel(got, want) < 4 * _rel(want.to(dtype), want) + 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_and_jagged_helpers_cuda(dtype):
    torch.manual_seed(0)
    lengths = [0, 1, 63, 64, 65, 1000, 3]
    total = sum(lengths)
    offsets = _offsets(lengths)
    x = torch.randn(total, 4, 64, device="cuda", dtype=dtype)
    for pos in (None, torch.rand(total, device="cuda") * 100):
        got = apply_rotary(x, offsets, positions=pos)
        want = rotary_reference(x.float(), offsets, pos)
        assert _rel(got, want) < 4 * _rel(want.to(dtype), want) + 1e-6
    with use_backend("reference"):
        padded_ref = jagged_to_padded(x, offsets, 700, padding_value=2.0)
        back_ref = padded_to_jagged(padded_ref, offsets, total)
        mean_ref = jagged_mean(x.double(), offsets)
    with use_backend("triton"):
        padded = jagged_to_padded(x, offsets, 700, padding_value=2.0)
        back = padded_to_jagged(padded, offsets, total)
        mean = jagged_mean(x, offsets)
    assert torch.equal(padded, padded_ref) and torch.equal(back, back_ref)
    assert _rel(mean, mean_ref) < 4 * _rel(mean_ref.to(dtype), mean_ref) + 1e-6
