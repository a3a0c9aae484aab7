"""Activation checkpointing policies: same gradients, less activation memory; the budget planner; the
pytorch#190758 guard.

Activation memory is measured twice (:mod:`gem_parallel.activation_memory`): bytes the allocator still
holds after the forward (what backward will need, whoever keeps it) and, as a cross-check where it is
exact (plain autograd), the bytes autograd's saved-tensor hooks see.

The model is gem-parallel's toy model (:mod:`gem_parallel.testing.toy_model`).

FP8 tolerance: E4M3 stores each saved element with a relative error <= 2^-4 (6.25%), spread evenly inside
that bound by rounding to nearest (RMS <= 2^-4 / sqrt(3), 3.6%). A weight gradient sums saved values times
output gradients over the samples; where those terms have random signs (the toy's head weight, 3/4 of the
gradient norm) the rounding errors add up as the terms do, so the whole keeps the elements' relative error
instead of averaging it down: over all parameters the gradient moves by 3.0% (norm of the difference over
norm of the gradient, measured with fp8 and mxfp8) and every tensor keeps its direction (cosine >= 0.997
measured). The bounds, 2^-4 and 0.98, are the per-element bound and 8x the measured angle error; a lost
scale or tensor is an O(1) error. (Per-entry bounds do not work here: small gradients that are sums with
cancellation have large relative errors under any quantization.)
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from dense_helpers import build_model, max_rel_diff, small_config

from gem_parallel import allocate_region_budgets, retained_bytes, saved_tensor_bytes
from gem_parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    apply_saved_activation_compression,
    check_no_dropout,
    has_region_budgets,
)
from gem_parallel.testing.toy_model import ToyBatch, toy_batch, toy_loss


def _assert_fp8_close(grads: dict, ref: dict) -> None:
    num = sum(float((grads[n] - ref[n]).square().sum()) for n in ref)
    den = sum(float(ref[n].square().sum()) for n in ref)
    assert (num / den) ** 0.5 <= 2.0**-4, (num / den) ** 0.5
    cos = min(
        (float(F.cosine_similarity(grads[n].flatten(), ref[n].flatten(), dim=0)), n)
        for n in ref
        if ref[n].abs().max() > 0
    )
    assert cos[0] >= 0.98, cos


def _grads_and_memory(model: nn.Module, batch: ToyBatch) -> tuple[dict, int, float]:
    model.zero_grad(set_to_none=True)
    logits, held = retained_bytes(lambda: model(batch))
    loss = toy_loss(logits, batch)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, held, float(loss)


@pytest.fixture(scope="module")
def toy_setup():
    config = small_config()
    # 128 samples: activations ~30x the weights. (saved_tensor_bytes counts the transposed weight views that
    # matmuls save, 0.12 MB here, as activations; retained_bytes does not: they must stay a small share.)
    batch = toy_batch(config, 128, seed=3)
    return build_model(config), batch


def test_measurements_agree_for_plain_autograd(toy_setup):
    model, batch = toy_setup
    _, held = retained_bytes(lambda: model(batch))
    _, saved = saved_tensor_bytes(lambda: model(batch))
    # The allocator also holds the logits and a few autograd buffers: within 10% of what autograd saved.
    assert saved > 0 and abs(held - saved) <= 0.1 * saved, (held, saved)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("saved", ["bf16", "fp8", "mxfp8"])
def test_policies_same_gradients_less_memory(toy_setup, policy, saved):
    base, batch = toy_setup
    ref_grads, ref_held, ref_loss = _grads_and_memory(base, batch)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, policy)
    if saved != "bf16":
        apply_saved_activation_compression(model, saved)
    for _ in range(2):  # twice: the policy holds across steps (no state left from the first)
        grads, held, loss = _grads_and_memory(model, batch)
    assert grads.keys() == ref_grads.keys()
    assert loss == ref_loss  # the forward itself is unchanged
    if saved == "bf16":
        bad = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
        assert not bad, bad  # recomputation replays the same ops: bit-identical gradients
    else:
        _assert_fp8_close(grads, ref_grads)
    assert held < ref_held, (held, ref_held)
    if policy == "full":
        assert held < 0.5 * ref_held, (held, ref_held)  # only the layers' inputs stay


@pytest.mark.parametrize("saved", ["fp8", "mxfp8"])
def test_fp8_saved_activations_alone(toy_setup, saved):
    base, batch = toy_setup
    ref_grads, ref_held, _ = _grads_and_memory(base, batch)
    model = copy.deepcopy(base)
    apply_saved_activation_compression(model, saved)
    grads, held, _ = _grads_and_memory(model, batch)
    _assert_fp8_close(grads, ref_grads)
    assert held < 0.75 * ref_held, (held, ref_held)  # fp32 -> ~1 byte for most of what is saved


def test_allocate_region_budgets_frees_the_cheapest_bytes_first():
    # (recompute cost, bytes): b is cheapest per byte, then a; c is expensive.
    costs = {"a": (20.0, 10.0), "b": (5.0, 10.0), "c": (1000.0, 10.0)}
    budgets = allocate_region_budgets(costs, 0.5)  # free 15 of 30 bytes
    assert budgets == {"a": 0.5, "b": 0.0, "c": 1.0}
    kept = sum(budgets[n] * costs[n][1] for n in costs)
    assert kept == pytest.approx(0.5 * 30)
    assert allocate_region_budgets(costs, 1.0) == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert allocate_region_budgets(costs, 0.0) == {"a": 0.0, "b": 0.0, "c": 0.0}


class _Block(nn.Module):
    def __init__(self, d: int, h: int, p_drop: float = 0.0) -> None:
        super().__init__()
        self.norm, self.up, self.down, self.p_drop = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d), p_drop

    def forward(self, x):
        h = F.gelu(self.up(self.norm(x))) * torch.sigmoid(self.up(x))
        if self.p_drop:
            h = F.dropout(h, self.p_drop, training=True)  # functional: invisible to a module scan
        return x + self.down(h)


class _Stack(nn.Module):
    """Three MLP blocks of different widths (different recompute cost per byte), in a ``layers`` dict."""

    def __init__(self, p_drop: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Block(64, 128 * (i + 1), p_drop) for i in range(3)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x.square().mean()


def _stack_step(model: nn.Module, x: torch.Tensor) -> tuple[dict, int]:
    model.zero_grad(set_to_none=True)
    loss, held = retained_bytes(lambda: model(x))
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, held


@pytest.mark.skipif(not has_region_budgets(), reason="per-region budgets need torch >= 2.13")
def test_budget_regions_calibrate_then_compile():
    torch.manual_seed(0)
    base = _Stack()
    x = torch.randn(256, 64)
    ref_grads, ref_held = _stack_step(base, x)
    model = copy.deepcopy(base)
    info = apply_activation_checkpointing(model, "budget", compile=True, memory_budget=0.3)
    planner = info["planner"]
    from gem_parallel.compile import compile_counters

    steps = [_stack_step(model, x) for _ in range(2)]  # 1: calibration (eager, full AC); 2: compiled
    compiled = compile_counters()
    steps += [_stack_step(model, x) for _ in range(2)]  # 3-4: compiled, nothing new
    assert planner.ready
    budgets = planner.budgets
    assert set(budgets) == {"layers.0", "layers.1", "layers.2"}
    # The allocation keeps 30% of the calibrated bytes, freeing whole regions first.
    kept = sum(budgets[n] * planner.costs[n][1] for n in budgets)
    assert kept == pytest.approx(0.3 * sum(c[1] for c in planner.costs.values()), rel=1e-9)
    assert sum(0.0 < b < 1.0 for b in budgets.values()) <= 1
    for grads, held in steps:
        # Compiled (inductor) vs eager fp32: fused kernels round differently, ~1e-8 here.
        assert max(max_rel_diff(grads[n], ref_grads[n]) for n in grads) <= 1e-5
        assert held < 0.5 * ref_held, (held, ref_held)  # the compiler's default alone saves ~25%
    # No recompilation after the first compiled step (with dynamic sizes the first compiled step holds a few
    # bytes more than the later ones: 24 B here, an allocation made once), and the later steps agree.
    assert compile_counters()["frames_ok"] == compiled["frames_ok"]
    assert compile_counters()["recompiles"] == compiled["recompiles"]
    assert steps[2][1] == steps[3][1]


def test_budget_guards_random_ops():
    # Dropout modules: refused when the policy is applied (pytorch#190758).
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))})
    with pytest.raises(ValueError, match="190758"):
        apply_activation_checkpointing(model, "budget", compile=True)
    check_no_dropout(nn.Sequential(nn.Dropout(0.0)))  # p = 0 is no random op
    # Functional dropout: caught by the calibration forward, before anything is compiled.
    stack = _Stack(p_drop=0.1)
    if has_region_budgets():
        apply_activation_checkpointing(stack, "budget", compile=True, memory_budget=0.5)
        with pytest.raises(RuntimeError, match="190758"):
            stack(torch.randn(8, 64))


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor compiles the blocks, twice: ~100 s on a loaded 2-core machine
@pytest.mark.skipif(not has_region_budgets(), reason="per-region budgets need torch >= 2.13")
def test_budget_on_toy_model(toy_setup):
    # The toy's blocks (an expert ensemble, a jagged sequence of dynamic length) under a 0.3 budget, compiled.
    # (gem-train's tests run GEM's own layers under a budget.)
    base, batch = toy_setup
    ref_grads, ref_held, _ = _grads_and_memory(base, batch)
    compiled = copy.deepcopy(base)
    apply_activation_checkpointing(compiled, "none", compile=True)
    _, compiled_held, _ = _grads_and_memory(compiled, batch)
    model = copy.deepcopy(base)
    info = apply_activation_checkpointing(model, "budget", compile=True, memory_budget=0.3)
    for _ in range(3):
        grads, held, _ = _grads_and_memory(model, batch)
    assert info["planner"].ready and set(info["planner"].budgets) == {"layers.0", "layers.1"}
    assert max(max_rel_diff(grads[n], ref_grads[n]) for n in grads) <= 1e-5
    assert held < 0.6 * compiled_held < ref_held, (held, compiled_held, ref_held)
