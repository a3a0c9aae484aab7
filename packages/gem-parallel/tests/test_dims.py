"""ParallelDims: degrees, errors naming the axis, rank layouts, network tiers, and the meshes on 4 ranks."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from gem_parallel import ParallelDims
from gem_parallel.testing import DistributedRunError, run_distributed


def test_fill_and_derived_degrees():
    d = ParallelDims(dp_replicate=2, ep=2, sparse_group=4, world_size=8)
    assert (d.dp_shard, d.dp, d.efsdp, d.sparse_group, d.sparse_replicas) == (4, 8, 2, 4, 2)
    one = ParallelDims(world_size=1)
    assert (one.dp_replicate, one.dp_shard, one.ep, one.sparse_group) == (1, 1, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "axis"),
    [
        ({"dp_replicate": 3, "world_size": 8}, "dp_replicate"),
        ({"dp_replicate": 2, "dp_shard": 2, "world_size": 8}, "dp_shard"),
        ({"ep": 3, "world_size": 8, "dp_replicate": 2}, "ep"),
        ({"sparse_group": 3, "world_size": 8}, "sparse_group"),
        ({"dp_shard": 0, "world_size": 8}, "dp_shard"),
        ({"ep": -1, "world_size": 8}, "ep"),
        ({"world_size": 0}, "world_size"),
        ({"ranks_per_host": 3, "world_size": 8}, "ranks_per_host"),
    ],
)
def test_bad_sizes_name_the_axis(kwargs, axis):
    with pytest.raises(ValueError, match=axis):
        ParallelDims(**kwargs)


def test_dense_layout_ep_innermost_replicas_outermost():
    d = ParallelDims(dp_replicate=2, ep=2, world_size=8, ranks_per_host=4)
    assert d.dense_coordinates(5) == {"dp_replicate": 1, "efsdp": 0, "ep": 1, "dp_shard": 1}
    # EP and the shard group stay inside a host of 4; replicas cross hosts.
    assert d.axis_tiers(5) == {
        "ep": "host", "dp_shard": "host", "dp_replicate": "cluster",
        "sparse_shard": "cluster", "sparse_replicate": "host",
    }  # fmt: skip
    zoned = ParallelDims(dp_replicate=2, world_size=16, ranks_per_host=4, hosts_per_zone=2)
    assert zoned.tier(list(range(8))) == "zone" and zoned.tier([0, 8]) == "cluster"


def test_sparse_layout_replicas_on_one_host():
    d = ParallelDims(sparse_group=4, world_size=8)  # 2 replicas of each shard
    assert d.sparse_sharding_group(0) == [0, 2, 4, 6] and d.sparse_sharding_group(3) == [1, 3, 5, 7]
    assert d.sparse_replica_group(5) == [4, 5]
    assert d.sparse_coordinates(5) == {"sparse_shard": 2, "sparse_replicate": 1}


def _mesh_worker(rank: int, world_size: int) -> dict:
    d = ParallelDims(dp_replicate=2, ep=2, sparse_group=2)
    mesh = d.build_mesh("cpu")
    sparse = d.build_sparse_mesh("cpu")
    out = {}
    for name in ("dp_replicate", "efsdp", "ep", "dp_shard", "dp", "expert_dp"):
        group = mesh[name].get_group()
        ranks = torch.zeros(world_size, dtype=torch.int64)
        ranks[rank] = 1
        dist.all_reduce(ranks, group=group)  # which ranks share this rank's group on that axis
        out[name] = ranks.nonzero().flatten()
    for name in ("sparse_shard", "sparse_replicate"):
        ranks = torch.zeros(world_size, dtype=torch.int64)
        ranks[rank] = 1
        dist.all_reduce(ranks, group=sparse[name].get_group())
        out[name] = ranks.nonzero().flatten()
    return out


@pytest.mark.distributed
def test_meshes_on_four_ranks():
    out = run_distributed(__file__, "_mesh_worker", world_size=4, timeout_s=120)
    d = ParallelDims(dp_replicate=2, ep=2, sparse_group=2, world_size=4)
    for rank, groups in enumerate(out):
        c = d.dense_coordinates(rank)
        base = c["dp_replicate"] * 2
        assert groups["ep"].tolist() == [base, base + 1]
        assert groups["dp_shard"].tolist() == [base, base + 1]
        assert groups["efsdp"].tolist() == [rank]  # dp_shard // ep == 1
        assert groups["dp_replicate"].tolist() == [rank % 2, rank % 2 + 2]
        assert groups["expert_dp"].tolist() == groups["dp_replicate"].tolist()
        assert groups["dp"].tolist() == [0, 1, 2, 3]
        assert groups["sparse_shard"].tolist() == d.sparse_sharding_group(rank)
        assert groups["sparse_replicate"].tolist() == d.sparse_replica_group(rank)


def _failing_worker(rank: int, world_size: int) -> None:
    # Every rank makes the same (bad) plan, so every rank fails at once: no one waits on a collective.
    ParallelDims(dp_replicate=3)


def _hanging_worker(rank: int, world_size: int) -> None:
    if rank == 0:
        raise RuntimeError("rank 0 gives up")
    dist.barrier()  # rank 1 waits for a peer that is gone: the collective timeout must end it


def _crashing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # a crash in native code: no Python exception, no error file
    dist.barrier()  # rank 0 then fails on the closed connection


def _atexit_worker(rank: int, world_size: int, marker_dir: str) -> int:
    import atexit
    from pathlib import Path

    # Interpreter finalization would run this; the harness ends a rank without it (a gloo worker thread
    # still releasing a finished work aborts the process there: pytorch/pytorch#190489).
    atexit.register(lambda: (Path(marker_dir) / f"finalized_{rank}").touch())
    dist.barrier()
    return rank


@pytest.mark.distributed
def test_harness_ends_ranks_without_interpreter_finalization(tmp_path):
    assert run_distributed(
        __file__, "_atexit_worker", world_size=2, kwargs={"marker_dir": str(tmp_path)}
    ) == [0, 1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed
def test_harness_reports_every_rank_and_never_hangs():
    out = run_distributed(__file__, "_failing_worker", world_size=2, timeout_s=30, expect_failure=True)
    assert [o.error_type for o in out] == ["ValueError", "ValueError"]
    assert all("dp_replicate=3" in o.message for o in out)
    out = run_distributed(__file__, "_hanging_worker", world_size=2, timeout_s=5, expect_failure=True)
    assert out[0].error_type == "RuntimeError"
    assert out[1].returncode != 0  # failed (timeout / connection closed) or killed at the deadline


@pytest.mark.distributed
def test_harness_names_the_crashed_rank_with_its_python_stack():
    with pytest.raises(DistributedRunError) as err:
        run_distributed(__file__, "_crashing_worker", world_size=2, timeout_s=20)
    msg = str(err.value)
    assert "rank 1: killed by SIGSEGV" in msg
    # The crashed rank's output is the one shown, with faulthandler's stack naming the function.
    assert "--- rank 1 output (tail) ---" in msg and "_crashing_worker" in msg
