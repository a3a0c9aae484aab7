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


def test_compiles_each_layer_in_place_and_keeps_keys():
    model = _Layered()
    keys = list(model.state_dict())
    assert apply_compile(model) is model
    assert list(model.state_dict()) == keys  # no "_orig_mod." prefix: checkpoints stay compatible
    assert all(layer._compiled_call_impl is not None for layer in model.layers.values())
    assert model._compiled_call_impl is None  # the embeddings/inputs/heads stay eager
    assert model.inp._compiled_call_impl is None


def test_whole_model_without_layers():
    model = nn.Sequential(nn.Linear(4, 4))
    keys = list(model.state_dict())
    apply_compile(model)
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
