"""FSDP (1x4), HSDP (2x2) and expert parallelism (2-way, experts FSDP-sharded) against one process.

One 4-rank launch trains the same toy model (:mod:`gem_parallel.testing.toy_model`) for two optimizer steps
under each layout (one of them with full activation checkpointing, which replays the EP collectives in
backward) and compares losses, gradients (after step 1) and parameters (after step 2) with a single-process
run on the same global batch. The EP layouts give the ranks different local batch sizes (ragged, one of
them a single sample), so the EP padding path runs too.

Tolerances (fp32): the parallel runs reorder sums (reduce-scatter / all-reduce over ranks, batched
matmuls over other row counts), so they differ from the reference by float32 rounding only. Losses: 1e-5
relative (measured <= 1.4e-7 on the toy model; 1e-7 on GEM before). Gradients and parameters: 1e-4 of each
tensor's largest entry (measured <= 1.1e-6 on the toy model, on layer-norm gains; 2e-5 on GEM's near-zero
gate biases). A real bug is orders of magnitude above: a missed or doubled gradient share is an O(1) relative
error (this test caught expert gradients off by 4x, 0.75, in an HSDP + EP layout).

The EP layouts also count the functional-collective works in flight whenever an EP collective is issued: it
must be none. Two functional collectives in flight at once on one gloo group corrupt memory in torch 2.13: a
4-rank gem-train run crashed with SIGSEGV in malloc on a gloo thread about once in two 300-step runs on a
loaded 2-core machine, and a 2-rank loop of two concurrent funcol all-gathers crashed within one
20,000-iteration try, while the same loop with each one waited before the next passed 3 x 20,000.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dense_helpers import (
    build_model,
    full,
    max_rel_diff,
    rank_slices,
    reference_loss,
    small_config,
)

import gem_parallel.expert as expert_module
from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims, parallelize
from gem_parallel.testing import run_distributed
from gem_parallel.testing.toy_model import toy_batch, toy_loss

LOSS_TOL = 1e-5
TOL = 1e-4
LAYOUTS = {
    # name: (ParallelDims kwargs, per-rank batch sizes, other ParallelConfig fields)
    "fsdp_1x4": ({"dp_replicate": 1}, [2, 2, 2, 2], {}),
    "hsdp_2x2": ({"dp_replicate": 2}, [3, 1, 2, 2], {}),
    "ep2_fsdp4": ({"dp_replicate": 1, "ep": 2}, [3, 1, 2, 4], {}),  # experts FSDP-sharded over efsdp = 2
    "ep2_hsdp_2x2": ({"dp_replicate": 2, "ep": 2}, [2, 2, 1, 3], {}),  # experts replicated over dp_replicate
    # Full checkpointing recomputes the EP collectives in backward (the same order on every rank).
    "ep2_fsdp4_full_ac": ({"ep": 2}, [2, 3, 2, 1], {"activation_checkpointing": "full"}),
}


def _count_in_flight(record: list[int]):
    """Wrap the EP collectives: append the number of functional-collective works in flight in this process
    each time one is issued. Returns the undo function."""
    from torch._C._distributed_c10d import _get_work_registry_size

    originals = expert_module._all_gather, expert_module._reduce_scatter

    def counted(fn):
        def issue(*args, **kwargs):
            record.append(_get_work_registry_size())
            return fn(*args, **kwargs)

        return issue

    expert_module._all_gather, expert_module._reduce_scatter = (counted(f) for f in originals)

    def undo() -> None:
        expert_module._all_gather, expert_module._reduce_scatter = originals

    return undo


def _train(layout: str, rank: int, world_size: int, steps: int = 2) -> dict:
    in_flight: list[int] = []
    undo = _count_in_flight(in_flight)
    try:
        out = _train_layout(layout, rank, world_size, steps)
    finally:
        undo()
    out["ep_issues"], out["ep_max_in_flight"] = len(in_flight), max(in_flight, default=0)
    return out


def _train_layout(layout: str, rank: int, world_size: int, steps: int) -> dict:
    dims_kwargs, sizes, extra = LAYOUTS[layout]
    dims = ParallelDims(**dims_kwargs)
    mesh = dims.build_mesh("cpu")
    config = small_config(n_experts=2)
    ref = build_model(config)
    model = copy.deepcopy(ref)
    cfg = ParallelConfig(expert_parallel=dims.ep > 1, fsdp=FSDPConfig(reduce_dtype=None), **extra)
    model = parallelize(model, dims, mesh, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    out: dict = {"loss": [], "ref_loss": [], "grad": {}, "param": {}}
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        batch = toy_batch(config, sum(sizes), seed=100 + step)
        local = batch.select(rank_slices(sizes)[rank])
        loss = toy_loss(model(local), local)
        loss.backward()
        ref_l = reference_loss(ref, batch, sizes)
        ref_l.backward()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss)
        out["loss"].append(float(mean_loss) / world_size)
        out["ref_loss"].append(float(ref_l))
        if step == 0:
            for name, p in model.named_parameters():
                out["grad"][name] = max_rel_diff(full(p.grad), ref_params[name].grad)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in model.named_parameters():
        out["param"][name] = max_rel_diff(full(p.detach()), ref_params[name].detach())
    out["n_params"] = len(out["param"])
    out["n_ref_params"] = len(ref_params)
    out["experts"] = sorted({n.split(".experts.")[1].split(".")[0] for n in out["param"] if ".experts." in n})
    return out


def _layouts_worker(rank: int, world_size: int) -> dict:
    return {name: _train(name, rank, world_size) for name in LAYOUTS}


@pytest.mark.distributed
def test_fsdp_hsdp_ep_match_one_process():
    results = run_distributed(__file__, "_layouts_worker", world_size=4, timeout_s=150)
    for name in LAYOUTS:
        dims_kwargs = LAYOUTS[name][0]
        for rank, res in enumerate(results):
            r = res[name]
            for a, b in zip(r["loss"], r["ref_loss"]):
                assert abs(a - b) <= LOSS_TOL * abs(b), (name, rank, r["loss"], r["ref_loss"])
            worst_grad = max(r["grad"].items(), key=lambda kv: kv[1])
            worst_param = max(r["param"].items(), key=lambda kv: kv[1])
            assert worst_grad[1] <= TOL, (name, rank, worst_grad)
            assert worst_param[1] <= TOL, (name, rank, worst_param)
            if dims_kwargs.get("ep", 1) > 1:
                # Every EP collective was issued with none in flight (gloo corrupts memory otherwise).
                assert r["ep_issues"] > 0 and r["ep_max_in_flight"] == 0, (name, rank, r["ep_max_in_flight"])
                # Each EP rank holds one of the two experts of every layer (the other's names are absent).
                ep_rank = rank % 2
                assert r["experts"] == [str(ep_rank)], (name, rank, r["experts"])
                n_expert_params = r["n_ref_params"] - r["n_params"]
                assert n_expert_params > 0
            else:
                assert r["n_params"] == r["n_ref_params"]
