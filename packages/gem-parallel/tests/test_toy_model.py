"""The toy model the other tests run on (``gem_parallel.testing.toy_model``): what they rely on holds."""

from __future__ import annotations

import copy

import pytest
import torch

from gem_parallel.expert import expert_ensembles
from gem_parallel.testing.toy_model import ToyConfig, ToyModel, toy_batch, toy_loss


def test_selected_samples_give_the_same_logits_and_every_parameter_a_gradient():
    config = ToyConfig()
    model = ToyModel(config, seed=0)
    batch = toy_batch(config, 8, seed=1)
    # Ragged: an empty and a length-1 history, and an empty bag, in every batch.
    lengths = batch.sequences["history"].lengths()
    assert lengths[0] == 0 and lengths[-1] == 1 and batch.bags["user"].lengths()[0] == 0
    logits = model(batch)
    assert logits.shape == (8,) and logits.dtype == torch.float32
    # A rank's slice of a global batch is the same samples: per-sample logits do not depend on the others.
    idx = [5, 0, 7]
    torch.testing.assert_close(model(batch.select(idx)), logits[idx], rtol=1e-6, atol=1e-6)
    toy_loss(logits, batch).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, no_grad


def test_structure_parallelize_acts_on():
    config = ToyConfig(n_layers=3, n_experts=4)
    model = ToyModel(config)
    assert list(model.layers) == ["0", "1", "2"]
    assert [n for n, _ in expert_ensembles(model)] == [f"layers.{i}.mixer" for i in range(3)]
    sparse = set(model.sparse_parameters())
    assert sparse == set(model.embeddings.parameters()) and len(sparse) == 3  # t_user, t_ad, t_history
    assert sparse.isdisjoint(model.dense_parameters())
    assert len(sparse) + len(list(model.dense_parameters())) == len(list(model.parameters()))
    # The ensemble's halves give its forward: every expert weighed by the gate.
    mixer = model.layers["0"].mixer
    x = torch.randn(5, config.n_tokens, config.d_model)
    weights = mixer.gate_weights(x)
    assert weights.shape == (5, 4) and torch.allclose(weights.sum(-1), torch.ones(5))
    partial = mixer.expert_sum(x, weights, [(0, mixer.experts[0]), (2, mixer.experts[2])])
    rest = mixer.expert_sum(x, weights, [(1, mixer.experts[1]), (3, mixer.experts[3])])
    torch.testing.assert_close(partial + rest, mixer(x))


def test_seeds_decide_the_model_and_the_batch():
    config = ToyConfig()
    a, b, c = ToyModel(config, seed=0), ToyModel(config, seed=0), ToyModel(config, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.head.weight, c.head.weight)
    copy.deepcopy(a)  # tests copy the model for their single-process reference
    x, y = toy_batch(config, 4, seed=3), toy_batch(config, 4, seed=3)
    assert torch.equal(x.sequences.values(), y.sequences.values()) and torch.equal(x.dense, y.dense)


def test_config_errors():
    with pytest.raises(ValueError, match="sequence feature"):
        ToyConfig(sequence_features=())
    with pytest.raises(ValueError, match="distinct"):
        ToyConfig(bag_features=(("history", 3),))
    with pytest.raises(ValueError, match="n_experts"):
        ToyConfig(n_experts=0)
