"""GEM under gem-parallel's FSDP2 on 2 ranks (here, not in gem-parallel, whose tests use a toy model of
their own): where GEM's FSDP units return views, nothing modifies them in place, and the gradients
equal one process's; the model's own outputs are tensors of their own; no other warning is raised.

FSDP2 registers its pre-backward hook on each unit's outputs; an in-place op on an output that is a view would
drop that hook and skip the parameters' all-gather in backward (wrong gradients or a failure), so FSDP2 warns
whenever a wrapped module returns a view. Two of GEM's units did:

- the root (``GemModel``): the task heads returned ``squeeze(-1)`` of the ``[B, 1]`` linear output (and
  ``float()`` of an fp32 tensor is the tensor itself). They now return a copy (``B`` floats per task), so the
  root returns no view and says nothing;
- ``GemEmbeddings``, when FSDP owns the tables: its outputs are views of the lookups' outputs (the pooled
  ``[B, F, d]`` and every history event's embedding). A copy would cost a pass over the whole history's
  embeddings every step; nothing in gem-model, gem-parallel or gem-train writes into them (they are only read:
  ``item + action``, the projections, ``cat``), and the gradients of every parameter below, the tables'
  included, match the one-process model. gem-train filters this one warning (docs/reliability.md, "Known
  warnings").

Tolerance: 1e-4 of each tensor's largest entry, as gem-parallel's ``test_dense_parallel.py`` (fp32: the
reduce-scatter reorders sums; a missed or doubled gradient share is an O(1) error).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor

import gem_model as gm
from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims, parallelize
from gem_parallel.testing import run_distributed

TOL = 1e-4
SIZES = [3, 2]  # per-rank batch sizes: ragged


def small_config(n_experts: int = 2) -> gm.GemConfig:
    """``tiny`` with small features (short histories, small vocabularies): a step costs tens of ms."""
    spec = gm.FeatureSpec(
        n_dense=4,
        sparse=(gm.SparseFeature("user", 50), gm.SparseFeature("ad", 40, max_ids=2)),
        sequences=(gm.SequenceFeature("history", 60, 4, 12),),
    )
    return dataclasses.replace(gm.get_config("tiny"), features=spec, n_experts=n_experts)


def build_model(config: gm.GemConfig, seed: int = 0) -> gm.GemModel:
    torch.manual_seed(seed)
    return gm.GemModel(config)


def rank_slices(sizes: list[int]) -> list[list[int]]:
    """Sample indices of each rank's slice of a global batch of ``sum(sizes)``."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]


def reference_loss(model: gm.GemModel, batch: gm.GemBatch, sizes: list[int]) -> torch.Tensor:
    """The objective data parallelism optimises: the mean over ranks of each rank's own loss (one forward
    of the whole global batch, its logits split by rank)."""
    logits = model(batch)
    losses = []
    for idx in rank_slices(sizes):
        sel = torch.tensor(idx)
        losses.append(gm.multitask_loss({t: v[sel] for t, v in logits.items()}, batch.select(idx))[0])
    return torch.stack(losses).mean()


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one whole tensor (collective for a DTensor: call on every rank in order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-6): a relative error that ignores tiny entries' noise."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


def _fsdp_two_ranks(rank: int, world_size: int) -> dict:
    config = small_config()
    ref = build_model(config)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dims = ParallelDims(dp_replicate=1)
        model = parallelize(
            model, dims, dims.build_mesh("cpu"), ParallelConfig(fsdp=FSDPConfig(reduce_dtype=None))
        )
        batch = gm.random_batch(config.features, sum(SIZES), seed=7)
        local = batch.select(rank_slices(SIZES)[rank])
        logits = model(local)
        loss, _ = gm.multitask_loss(logits, local)
        loss.backward()
    reference_loss(ref, batch, SIZES).backward()
    ref_params = dict(ref.named_parameters())
    grads = {name: max_rel_diff(full(p.grad), ref_params[name].grad) for name, p in model.named_parameters()}
    messages = [f"{w.category.__name__}: {w.message}" for w in caught]
    return {
        "views": [t for t, v in logits.items() if v._base is not None],
        "view_warnings": [m.split(" returned")[0] for m in messages if "returned a view tensor" in m],
        "other_warnings": [m for m in messages if "returned a view tensor" not in m],
        "grads": grads,
        "n_grads": len(grads),
        "n_params": len(ref_params),
    }


@pytest.mark.distributed
def test_fsdp2_views_are_read_only_gradients_match_one_process_and_the_root_returns_no_view():
    results = run_distributed(__file__, "_fsdp_two_ranks", world_size=2, timeout_s=150)
    for rank, r in enumerate(results):
        assert r["views"] == [], (rank, r["views"])
        assert r["other_warnings"] == [], (rank, r["other_warnings"])
        # Only the embeddings unit (FSDP owns the tables here) returns views: read, never written in place.
        assert set(r["view_warnings"]) <= {"UserWarning: FSDP2-wrapped module (FSDPGemEmbeddings)"}, r
        assert r["n_grads"] == r["n_params"] > 0
        worst = max(r["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, (rank, worst)
