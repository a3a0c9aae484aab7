"""The whole model under ``torch.compile`` on the CPU: same logits and gradients as eager.

In the default run with the ``aot_eager`` backend: dynamo traces the whole model in one graph (the batch's
KJTs carry their per-key lengths on the host, so TorchRec's ``to_dict`` does not break the graph on
``.tolist()``; it broke it into 5 graphs before) and AOTAutograd builds the joint forward/backward graphs
through the ops' fake implementations, so a change that breaks tracing fails CI; measured 33 s wall (18 s CPU,
half of it imports) on the loaded 2-core machine. The same test with inductor (C++ code generation for every
graph) took 217 s wall / 87 s CPU there: it is marked slow, as is the per-layer compile of larger configs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gem_model as gm


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_whole_model_compiles_and_matches_eager_forward_and_backward(backend):
    tiny = gm.get_config("tiny")
    config = dataclasses.replace(tiny, n_layers=1, attention=tiny.attention[:1], n_experts=2)
    torch.manual_seed(0)
    eager = gm.GemModel(config)
    compiled_model = gm.GemModel(config)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, backend=backend)
    batch = gm.random_batch(config.features, 6, seed=3)  # ragged histories, including short ones

    want = eager(batch)
    got = compiled(batch)
    for task in want:
        # fp32 both ways; inductor fuses and reorders reductions: agreement to ~1e-6 of values ~1e-2.
        torch.testing.assert_close(got[task], want[task], rtol=1e-4, atol=1e-5)
    gm.multitask_loss(want, batch)[0].backward()
    gm.multitask_loss(got, batch)[0].backward()
    grads = dict(compiled_model.named_parameters())
    for name, p in eager.named_parameters():
        assert grads[name].grad is not None, name
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-3, atol=1e-6, msg=name)
    # The comparison can fail: a differently initialised model is far outside these tolerances.
    torch.manual_seed(1)
    other = gm.GemModel(config)(batch)
    assert any((other[t] - want[t]).abs().max() > 1e-3 for t in want)


def test_whole_model_has_no_graph_breaks():
    """No graph break (TorchRec's KJT ``length_per_key`` -> ``.tolist()`` was 4 of them, a host sync each on
    the GPU): the pooled-id KJT gets host lengths when the batch is built, the sequence KJT from shapes."""
    tiny = gm.get_config("tiny")
    config = dataclasses.replace(tiny, n_layers=1, attention=tiny.attention[:1], n_experts=2)
    model = gm.GemModel(config)
    batch = gm.random_batch(config.features, 6, seed=1)
    assert batch.sparse._length_per_key is not None  # cached at build time (torchrec's cache field)
    explained = torch._dynamo.explain(model)(batch)
    reasons = [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1
