"""gem_parallel.compile: per-layer compilation that leaves parameter names (checkpoint keys) unchanged; the
compile caches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_parallel import compile as gc
from gem_parallel.compile import compile_layers


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
    assert compile_layers(model, cache_dir=tmp_path) is model
    assert list(model.state_dict()) == keys  # no "_orig_mod." prefix: checkpoints stay compatible
    assert all(layer._compiled_call_impl is not None for layer in model.layers.values())
    assert model._compiled_call_impl is None  # the embeddings/inputs/heads stay eager
    assert model.inp._compiled_call_impl is None


def test_whole_model_without_layers(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4))
    keys = list(model.state_dict())
    compile_layers(model, cache_dir=tmp_path)
    assert model._compiled_call_impl is not None
    assert list(model.state_dict()) == keys


@pytest.mark.slow
def test_compiled_layers_match_eager():
    torch.manual_seed(0)
    eager = _Layered()
    compiled = _Layered()
    compiled.load_state_dict(eager.state_dict())
    compile_layers(compiled)
    x = torch.randn(16, 4)
    a, b = eager(x), compiled(x)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    a.sum().backward()
    b.sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compile_cache_dir_resolution_and_configuration(tmp_path, monkeypatch):
    import os

    env = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", gc.COMPILE_CACHE_ENV)
    for var in env:
        monkeypatch.setenv(var, "")  # records the original state, so teardown restores it
        monkeypatch.delenv(var)
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
    # gem-kernels' tuning choices have their own cache (gem_kernels.tune_cache): nothing of Triton's
    # autotuners is switched here.
    assert "TRITON_CACHE_AUTOTUNING" not in os.environ
