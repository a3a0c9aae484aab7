"""The model on CUDA: the Triton kernels agree with the PyTorch reference path through the whole model."""

import dataclasses

import pytest
import torch

import gem_kernels
import gem_model as gm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("pma_kind", "fused_ffn"), [("softmax", False), ("gdpa", False), ("softmax", True)])
def test_cuda_model_matches_reference_backend(pma_kind, fused_ffn):
    config = dataclasses.replace(
        gm.get_config("tiny"), n_layers=3, attention=("full", "window", "block"), pma_kind=pma_kind,
        fused_ffn=fused_ffn,
    )  # fmt: skip
    torch.manual_seed(0)
    model = gm.GemModel(config, device="cuda")
    batch = gm.random_batch(config.features, 32, seed=0, device="cuda")

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(batch)
        gm.multitask_loss(logits, batch)[0].backward()
        grads = torch.cat([p.grad.flatten() for p in model.dense_parameters()])
        return torch.stack(list(logits.values())), grads

    with gem_kernels.use_backend("reference"):
        ref_logits, ref_grads = run()
    logits, grads = run()
    # fp32 end to end; Triton's fp32 dots may run in TF32 (10-bit mantissa), so allow ~1e-2 relative.
    assert _rel(logits, ref_logits) < 1e-2
    assert _rel(grads, ref_grads) < 2e-2


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_autocast_step():
    config = gm.get_config("small")
    model = gm.GemModel(config, device="meta")
    model.to_empty(device="cuda")
    model.init_weights()
    batch = gm.random_batch(config.features, 64, seed=1).pin_memory().to("cuda", non_blocking=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(batch)
    loss, _ = gm.multitask_loss(logits, batch)
    loss.backward()
    assert all(v.dtype == torch.float32 for v in logits.values()) and torch.isfinite(loss)


@pytest.mark.gpu
@needs_cuda
def test_cuda_inference_mode_forward_matches_no_grad():
    """``gem-train predict`` forwards under ``torch.inference_mode``, where tensors have no version counter
    (the attention's schedule cache once read it and failed): twice, the same logits as under ``no_grad``."""
    config = dataclasses.replace(gm.get_config("tiny"), n_layers=3, attention=("full", "window", "block"))
    torch.manual_seed(0)
    model = gm.GemModel(config, device="cuda").eval()
    batch = gm.random_batch(config.features, 32, seed=2, device="cuda")
    with torch.no_grad():
        want = torch.stack(list(model(batch).values()))
    with torch.inference_mode():  # the batch made inside too, as predict moves it there
        batch = gm.random_batch(config.features, 32, seed=2, device="cuda")
        for _ in range(2):
            got = torch.stack(list(model(batch).values()))
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the same kernels, same inputs
