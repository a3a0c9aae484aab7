"""``train.compile`` on GEM: per-layer compilation (gem-parallel's one compile path) keeps one graph per layer
kind whatever the jagged sizes of the batch."""

from __future__ import annotations

import pytest
import torch

from gem_parallel.compile import compile_counters, compile_layers


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_varying_batches_compile_each_layer_kind_once(backend):
    """7 batches with different B, event counts and longest histories: each layer kind compiles once.

    ``eager`` runs dynamo alone (its guards decide recompiles; 19 s for this test on the loaded 2-core
    machine); ``aot_eager`` also traces the backward through the ops' fakes (72 s there: slow).
    """
    import dataclasses

    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    import gem_model as gm

    torch._dynamo.reset()
    counters.clear()  # process-wide: earlier tests' compilations would count here too (reset keeps them)
    tiny = gm.get_config("tiny")
    config = dataclasses.replace(tiny, n_experts=2)  # 2 layers, of 2 kinds (full and window attention)
    assert len(set(config.attention_kind(i) for i in range(config.n_layers))) == 2
    model = gm.GemModel(config)
    counter = CompileCounterWithBackend(backend)
    compile_layers(model, backend=counter)
    seen = set()
    for i in range(7):
        batch = gm.random_batch(config.features, 6 + i % 3, seed=i)
        seq = next(iter(batch.sequences.values()))
        seen.add((batch.batch_size, seq.total, seq.max_len))
        gm.multitask_loss(model(batch), batch)[0].backward()
    assert len(seen) == 7  # every batch has new jagged sizes
    stats = compile_counters()
    assert stats["frames_ok"] == 2, stats  # one graph per layer kind, never recompiled
    assert stats["recompiles"] == 0 and stats["graph_breaks"] == 0, stats
    assert counter.frame_count >= 2
    torch._dynamo.reset()
