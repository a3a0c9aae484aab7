"""``parallelize`` on one rank (no process group) and on a model without blocks (DDP on several ranks): the
same entry point prepares every model for training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_parallel import ParallelConfig, ParallelDims, parallelize
from gem_parallel.testing import run_distributed


class _Blocks(nn.Module):
    """Two blocks between an input and an output projection: what parallelize works on, block by block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 256)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for i in range(2)})
        self.out = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers.values():
            x = x + layer(x)
        return self.out(x)


class _Mlp(nn.Module):
    """No ``layers``: a plain MLP (gem-train's baseline is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_one_rank_without_process_group_applies_precision_and_compile():
    pytest.importorskip("gem_precision")
    from gem_precision import MXFP8Linear, Recipe

    assert not torch.distributed.is_initialized()
    model = _Blocks()
    keys = list(model.state_dict())
    config = ParallelConfig(precision=Recipe.fp8_rowwise(), precision_min_features=128, compile=True)
    out = parallelize(model, None, None, config)
    assert out is model  # in place, nothing wrapped
    assert list(model.state_dict()) == keys
    # Every linear at least 128 wide is converted (the 8-wide input and 1-wide output are not).
    assert [type(m) is MXFP8Linear for m in (model.inp, model.layers["0"][0], model.out)] == [
        False,
        True,
        False,
    ]
    assert all(layer._compiled_call_impl is not None for layer in model.layers.values())
    assert model._compiled_call_impl is None  # the parts around the blocks stay eager


def test_one_rank_checkpointing_and_keep_last_blocks():
    pytest.importorskip("gem_precision")
    from gem_precision import MXFP8Linear, Recipe

    model = _Blocks()
    parallelize(
        model,
        ParallelDims(world_size=1),
        config=ParallelConfig(
            precision=Recipe.fp8_rowwise(), precision_keep_last_blocks=1, activation_checkpointing="full"
        ),
    )
    assert type(model.layers["0"][0]) is MXFP8Linear and type(model.layers["1"][0]) is nn.Linear
    assert type(model.layers["0"]).__name__.startswith("Region")  # the checkpointing region
    x = torch.randn(4, 8)
    model(x).sum().backward()
    assert model.inp.weight.grad is not None


def test_model_without_blocks_takes_only_whole_model_options():
    model = _Mlp()
    assert parallelize(model, config=ParallelConfig(compile=False)) is model
    for bad, text in (
        ({"activation_checkpointing": "selective"}, "activation_checkpointing='selective'"),
        ({"all_gather": "fp8"}, "all_gather='fp8'"),
        ({"expert_parallel": True}, "expert_parallel=True"),
    ):
        with pytest.raises(ValueError, match="no `layers`") as info:
            parallelize(_Mlp(), config=ParallelConfig(**bad))
        assert text in str(info.value)


def _ddp_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _Mlp()
    wrapped = parallelize(model, ParallelDims(), config=ParallelConfig())
    x = torch.randn(2 * world_size, 8, generator=torch.Generator().manual_seed(1))
    # Each rank its own half of the batch; DDP averages the gradients.
    wrapped(x[rank * 2 : rank * 2 + 2]).square().mean().backward()
    return {
        "wrapper": type(wrapped).__name__,
        "grads": [p.grad.clone() for p in model.parameters()],
    }


@pytest.mark.distributed
def test_model_without_blocks_is_data_parallel_on_several_ranks():
    results = run_distributed(__file__, "_ddp_worker", world_size=2, timeout_s=120)
    torch.manual_seed(0)
    ref = _Mlp()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    # The mean of the two ranks' mean losses = the mean loss over the whole batch (equal halves).
    ref(x).square().mean().backward()
    for r in results:
        assert r["wrapper"] == "DistributedDataParallel"
        for g, p in zip(r["grads"], ref.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
