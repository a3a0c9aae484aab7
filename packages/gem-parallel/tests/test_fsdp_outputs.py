"""FSDP2 on 2 ranks: where GEM's FSDP units return views, nothing modifies them in place, and the gradients
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
  included, match the one-process model. gem-train filters this one warning (README, "Known warnings").

Tolerance: 1e-4 of each tensor's largest entry, as in ``test_dense_parallel.py`` (fp32: the reduce-scatter
reorders sums; a missed or doubled gradient share is an O(1) error).
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dense_helpers import build_model, full, max_rel_diff, rank_slices, reference_loss, small_config

import gem_model as gm
from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims, parallelize
from gem_parallel.testing import run_distributed

TOL = 1e-4
SIZES = [3, 2]  # per-rank batch sizes: ragged


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
