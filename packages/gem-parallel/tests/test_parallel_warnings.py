"""gem-parallel's own calls raise no warning on 2 ranks (issue 34): FSDP on the flattened ``dp_shard`` mesh
(torch warns "Slicing a flattened dim from root mesh" for a slice of the root mesh) and expert parallelism's
batch-size exchange (torch 2.13 deprecates ``all_gather_into_tensor`` with a warning per call), on the toy
model, forward and backward.

FSDP2's "returned a view tensor" is about the model's own outputs, not gem-parallel's calls: it is left out
here (GEM's case is tested in gem-train's ``tests/test_train_fsdp_outputs.py``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dense_helpers import build_model, rank_slices, small_config

from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims, parallelize
from gem_parallel.testing import run_distributed
from gem_parallel.testing.toy_model import toy_batch, toy_loss

SIZES = [3, 2]
LAYOUTS = {"fsdp_1x2": {"dp_replicate": 1}, "ep2": {"dp_replicate": 1, "ep": 2}}


def _warnings_of_layouts(rank: int, world_size: int) -> dict[str, list[str]]:
    out = {}
    for name, dims_kwargs in LAYOUTS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the harness sets PYTHONWARNINGS=ignore
            dims = ParallelDims(**dims_kwargs)
            config = small_config(n_experts=2)
            cfg = ParallelConfig(expert_parallel=dims.ep > 1, fsdp=FSDPConfig(reduce_dtype=None))
            model = parallelize(build_model(config), dims, dims.build_mesh("cpu"), cfg)
            batch = toy_batch(config, sum(SIZES), seed=3).select(rank_slices(SIZES)[rank])
            toy_loss(model(batch), batch).backward()
        messages = {f"{w.category.__name__}: {w.message}"[:300] for w in caught}
        out[name] = sorted(m for m in messages if "returned a view tensor" not in m)
    return out


@pytest.mark.distributed
def test_fsdp_and_expert_parallel_raise_no_warning():
    results = run_distributed(__file__, "_warnings_of_layouts", world_size=2, timeout_s=240)
    for rank, r in enumerate(results):
        for name in LAYOUTS:
            assert r[name] == [], (rank, name, r[name])
