"""Misconfigurations fail at once, with an error naming the culprit, on every rank, before any collective."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from dense_helpers import build_model, small_config

from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims, parallelize
from gem_parallel.testing import run_distributed


class _DropoutStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))})

    def forward(self, x):
        return self.layers["0"](x)


# case -> (model factory, ParallelDims kwargs, ParallelConfig kwargs, text the error must contain)
CASES = {
    "no_layers": (lambda: nn.Linear(4, 4), {}, {"activation_checkpointing": "full"}, "no `layers`"),
    "ep_does_not_divide_experts": (
        lambda: build_model(small_config(n_experts=3)), {"ep": 2}, {"expert_parallel": True},
        "ep=2 does not divide the ensemble's n_experts=3",
    ),
    "ep_without_expert_parallel": (
        lambda: build_model(small_config()), {"ep": 2}, {}, "expert_parallel=True",
    ),
    "single_expert_ensembles": (
        lambda: build_model(small_config(n_experts=1)), {"ep": 2}, {"expert_parallel": True},
        "does not divide",
    ),
    "mxfp8_unblockable": (
        lambda: build_model(small_config()), {}, {"all_gather": "mxfp8", "all_gather_min_numel": 1},
        "cannot be cut into whole 32-element MX blocks",
    ),
    "fp8_uneven_rows": (
        lambda: build_model(small_config()), {}, {"all_gather": "fp8", "all_gather_min_numel": 1},
        "do not split evenly over the 2 ranks",
    ),
    "budget_with_dropout": (
        _DropoutStack, {}, {"activation_checkpointing": "budget", "compile": True}, "pytorch#190758",
    ),
}  # fmt: skip


def _caught_worker(rank: int, world_size: int) -> dict:
    out = {}
    for name, (make, dims_kwargs, cfg_kwargs, _) in CASES.items():
        dims = ParallelDims(**dims_kwargs)
        mesh = dims.build_mesh("cpu")
        t0 = time.monotonic()
        try:
            parallelize(make(), dims, mesh, ParallelConfig(**cfg_kwargs))
            out[name] = ("no error", 0.0)
        except (ValueError, TypeError) as e:
            out[name] = (f"{type(e).__name__}: {e}", time.monotonic() - t0)
        torch.distributed.barrier()  # the ranks are still in step: nobody is stuck in a collective
    return out


def _uncaught_worker(rank: int, world_size: int) -> None:
    dims = ParallelDims(ep=2)
    mesh = dims.build_mesh("cpu")
    # The mesh's process groups are set up (a collective): let both ranks finish it before one raises.
    torch.distributed.barrier()
    parallelize(build_model(small_config(n_experts=3)), dims, mesh, ParallelConfig(expert_parallel=True))


@pytest.mark.distributed
def test_misconfigurations_fail_on_every_rank_at_once():
    results = run_distributed(__file__, "_caught_worker", world_size=2, timeout_s=60)
    for name, (*_, text) in CASES.items():
        for rank, r in enumerate(results):
            message, seconds = r[name]
            assert text in message, (name, rank, message)
            assert seconds < 20.0, (name, rank, seconds)  # decided locally, no collective timeout waited


@pytest.mark.distributed
def test_uncaught_misconfiguration_ends_every_rank():
    out = run_distributed(__file__, "_uncaught_worker", world_size=2, timeout_s=60, expect_failure=True)
    # Each rank raised by itself (a rank stuck on a peer would be killed at the deadline: returncode None).
    assert [o.returncode is not None and o.returncode != 0 for o in out] == [True, True]
    assert [o.error_type for o in out] == ["ValueError", "ValueError"], [o.stderr_tail[-2000:] for o in out]
    assert all("does not divide" in o.message for o in out)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"all_gather": "fp4"}, "ParallelConfig.all_gather"),
        ({"activation_checkpointing": "some"}, "ParallelConfig.activation_checkpointing"),
        ({"memory_budget": 0.0}, "ParallelConfig.memory_budget"),
        ({"memory_budget": 1.5}, "ParallelConfig.memory_budget"),
        ({"saved_activations": "fp4"}, "ParallelConfig.saved_activations"),
        ({"activation_checkpointing": "budget"}, "compile=True"),
        ({"embeddings": "3d"}, "ParallelConfig.embeddings"),
        ({"embedding_sync_every": 0}, "ParallelConfig.embedding_sync_every"),
        ({"all_gather_min_numel": 0}, "ParallelConfig.all_gather_min_numel"),
        ({"compile": "yes"}, "ParallelConfig.compile"),
        ({"fsdp": {"param_dtype": "int8"}}, "FSDPConfig.param_dtype"),
        ({"fsdp": {"prefetch": -1}}, "FSDPConfig.prefetch"),
        ({"fsdp": {"wrap_single_rank": 1}}, "FSDPConfig.wrap_single_rank"),
        ({"precision": "mxfp8"}, "ParallelConfig.precision"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ParallelConfig(**kwargs)


def test_config_normalises_dtypes():
    cfg = ParallelConfig(fsdp={"param_dtype": "bf16", "reduce_dtype": "fp32"}, memory_budget=1)
    assert cfg.fsdp == FSDPConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert cfg.memory_budget == 1.0 and isinstance(cfg.memory_budget, float)


def _single_rank_worker(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    """(DTensor parameters, quantized all-gather weights) after parallelize on one rank, per setting."""
    from torch.distributed.tensor import DTensor

    from gem_parallel import QuantizedAllGatherWeight

    dims = ParallelDims()
    mesh = dims.build_mesh("cpu")
    out = {}
    for name, fsdp in (("default", FSDPConfig()), ("wrapped", FSDPConfig(wrap_single_rank=True))):
        model = parallelize(
            build_model(small_config()), dims, mesh,
            ParallelConfig(fsdp=fsdp, all_gather="fp8", all_gather_min_numel=1),
        )  # fmt: skip
        params = [p for p in model.parameters()]
        dtensors = [p for p in params if isinstance(p, DTensor)]
        quantized = [p for p in dtensors if isinstance(p.to_local(), QuantizedAllGatherWeight)]
        out[name] = (len(dtensors), len(quantized))
        out[name + "_n"] = (len(params), 0)
    return out


@pytest.mark.distributed
def test_one_rank_mesh_skips_fsdp_unless_asked():
    (out,) = run_distributed(__file__, "_single_rank_worker", world_size=1, timeout_s=60)
    assert out["default"] == (0, 0), out  # nothing to shard on one rank: the model stays plain
    n_params = out["wrapped_n"][0]
    assert out["wrapped"][0] == n_params and out["wrapped"][1] > 0, out
