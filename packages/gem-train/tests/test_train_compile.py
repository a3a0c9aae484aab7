"""``train.compile``: per-layer compilation that leaves parameter names (checkpoint keys) unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_train.compile import apply_compile


class _Layered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for i in range(3)})
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers.values():
            x = x + layer(x)
        return self.out(x)


def test_compiles_each_layer_in_place_and_keeps_keys(tmp_path):
    model = _Layered()
    keys = list(model.state_dict())
    assert apply_compile(model, cache_dir=tmp_path) is model
    assert list(model.state_dict()) == keys  # no "_orig_mod." prefix: checkpoints stay compatible
    assert all(layer._compiled_call_impl is not None for layer in model.layers.values())
    assert model._compiled_call_impl is None  # the embeddings/inputs/heads stay eager
    assert model.inp._compiled_call_impl is None


def test_whole_model_without_layers(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4))
    keys = list(model.state_dict())
    apply_compile(model, cache_dir=tmp_path)
    assert model._compiled_call_impl is not None
    assert list(model.state_dict()) == keys


@pytest.mark.slow
def test_compiled_layers_match_eager():
    torch.manual_seed(0)
    eager = _Layered()
    compiled = _Layered()
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled)
    x = torch.randn(16, 4)
    a, b = eager(x), compiled(x)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    a.sum().backward()
    b.sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


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
    from gem_train.compile import compile_counters

    torch._dynamo.reset()
    counters.clear()  # process-wide: earlier tests' compilations would count here too (reset keeps them)
    tiny = gm.get_config("tiny")
    config = dataclasses.replace(tiny, n_experts=2)  # 2 layers, of 2 kinds (full and window attention)
    assert len(set(config.attention_kind(i) for i in range(config.n_layers))) == 2
    model = gm.GemModel(config)
    counter = CompileCounterWithBackend(backend)
    apply_compile(model, backend=counter)
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


def test_compile_cache_dir_resolution_and_configuration(tmp_path, monkeypatch):
    import os

    pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner

    from gem_kernels.triton_kernels import attention as triton_attention
    from gem_train import compile as gc

    env = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", gc.COMPILE_CACHE_ENV)
    for var in env:
        monkeypatch.setenv(var, "")  # records the original state, so teardown restores it
        monkeypatch.delenv(var)
    tuned = [v for v in vars(triton_attention).values() if isinstance(v, Autotuner)]
    for t in tuned:
        monkeypatch.setattr(t, "cache_results", t.cache_results)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gc.compile_cache_dir() == tmp_path / "xdg" / "gem" / "compile"
    monkeypatch.setenv(gc.COMPILE_CACHE_ENV, str(tmp_path / "env"))
    assert gc.compile_cache_dir() == tmp_path / "env"
    assert gc.compile_cache_dir(tmp_path / "arg") == tmp_path / "arg"  # an explicit folder wins

    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    root = gc.configure_compile_cache()
    assert root == tmp_path / "env" and root.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    assert inductor_config.fx_graph_cache and inductor_config.autotune_local_cache
    # A folder the user already chose for inductor is kept.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    gc.configure_compile_cache(tmp_path / "other")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    # gem_kernels' attention autotuners (created at import) now keep their choices on disk.
    assert tuned and all(t.cache_results for t in tuned)
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"  # autotuners created later cache too
