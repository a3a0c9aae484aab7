"""GEM's own layers under gem-parallel's memory-budget activation checkpointing (compiled), end to end.

gem-parallel's tests run the budget policy on their own toy model; this is the same check on GEM's layers
(jagged attention, Wukong ensembles), moved here from gem-parallel's tests/test_checkpointing.py so that
gem-parallel's tests do not import gem-model. Same gradients as eager without checkpointing (compiled vs
eager fp32: fused kernels round differently, ~1e-8; bound 1e-5), and the budget keeps well under the
compiled model's own activation memory.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import gem_model as gm
from gem_parallel import retained_bytes
from gem_parallel.activation_checkpoint import apply_activation_checkpointing, has_region_budgets


def _small_config() -> gm.GemConfig:
    """``tiny`` with small features (short histories, small vocabularies) and 2 experts."""
    spec = gm.FeatureSpec(
        n_dense=4,
        sparse=(gm.SparseFeature("user", 50), gm.SparseFeature("ad", 40, max_ids=2)),
        sequences=(gm.SequenceFeature("history", 60, 4, 12),),
    )
    return dataclasses.replace(gm.get_config("tiny"), features=spec, n_experts=2)


def _grads_and_memory(model: nn.Module, batch: gm.GemBatch) -> tuple[dict, int]:
    model.zero_grad(set_to_none=True)
    logits, held = retained_bytes(lambda: model(batch))
    loss, _ = gm.multitask_loss(logits, batch)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, held


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor compiles both layer kinds twice: ~2 min idle, 8 on a loaded machine
@pytest.mark.skipif(not has_region_budgets(), reason="per-region budgets need torch >= 2.13")
def test_budget_on_gem_model():
    # ~2 min on the CPU (inductor compiles both layer kinds twice): the GEM layers under a 0.3 budget.
    config = _small_config()
    batch = gm.random_batch(config.features, 32, seed=3)
    torch.manual_seed(0)
    base = gm.GemModel(config)
    ref_grads, ref_held = _grads_and_memory(base, batch)
    compiled = copy.deepcopy(base)
    apply_activation_checkpointing(compiled, "none", compile=True)
    _, compiled_held = _grads_and_memory(compiled, batch)
    model = copy.deepcopy(base)
    info = apply_activation_checkpointing(model, "budget", compile=True, memory_budget=0.3)
    for _ in range(3):
        grads, held = _grads_and_memory(model, batch)
    assert info["planner"].ready and set(info["planner"].budgets) == {"layers.0", "layers.1"}
    assert max(_max_rel_diff(grads[n], ref_grads[n]) for n in grads) <= 1e-5
    assert held < 0.6 * compiled_held < ref_held, (held, compiled_held, ref_held)
