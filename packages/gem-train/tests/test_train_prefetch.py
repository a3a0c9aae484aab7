"""DevicePrefetcher: order, exactness, one-ahead fetching, errors at the right item, the host thread."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import gem_model as gm
from gem_train.loop.prefetch import DevicePrefetcher

SPEC = gm.get_config("tiny").features


@dataclasses.dataclass
class _Item:  # like gem_train.data.loader.LoadedBatch
    index: int
    batch: gm.GemBatch


def _items(n: int, fail_at: int | None = None, pulled: list[int] | None = None):
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"bad record in batch {i}")
        if pulled is not None:
            pulled.append(i)
        yield _Item(i, gm.random_batch(SPEC, 3 + i % 2, seed=i))


def _same(a: gm.GemBatch, b: gm.GemBatch) -> bool:
    ok = all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in ("dense", "request_time", "labels", "label_mask")
    )
    ok = ok and torch.equal(a.sparse.values(), b.sparse.values()) and a.sparse.keys() == b.sparse.keys()
    ok = ok and torch.equal(a.sparse.lengths(), b.sparse.lengths())
    for name, s in a.sequences.items():
        t = b.sequences[name]
        ok = ok and s.max_len == t.max_len
        ok = ok and all(
            torch.equal(getattr(s, f), getattr(t, f)) for f in ("offsets", "item_ids", "timestamps")
        )
    return ok


@pytest.mark.parametrize("host_ahead", [0, 2])
def test_order_and_exactness(host_ahead):
    want = list(_items(6))
    got = list(
        DevicePrefetcher(_items(6), torch.device("cpu"), select=lambda it: it.batch, host_ahead=host_ahead)
    )
    assert [item.index for item, _ in got] == list(range(6))
    for (item, batch), ref in zip(got, want):
        assert _same(batch, ref.batch) and _same(item.batch, ref.batch)
        assert batch.sparse._length_per_key == ref.batch.sparse._length_per_key  # host lengths kept


def test_fetches_one_item_ahead():
    pulled: list[int] = []
    it = DevicePrefetcher(_items(5, pulled=pulled), torch.device("cpu"), select=lambda x: x.batch)
    assert pulled == []  # nothing before the first request
    item, _ = next(it)
    assert item.index == 0 and pulled == [0, 1]  # batch 1 is on its way while step 0 runs
    next(it)
    assert pulled == [0, 1, 2]


@pytest.mark.parametrize("host_ahead", [0, 3])
def test_source_error_is_raised_at_its_item(host_ahead):
    it = DevicePrefetcher(
        _items(6, fail_at=3), torch.device("cpu"), select=lambda x: x.batch, host_ahead=host_ahead
    )
    assert [next(it)[0].index for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="batch 3"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_close_and_bad_arguments():
    it = DevicePrefetcher(_items(100), torch.device("cpu"), select=lambda x: x.batch, host_ahead=2)
    next(it)
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    it._ahead._thread.join(timeout=5)
    assert not it._ahead._thread.is_alive()  # the producer thread stopped, though the source had more
    with pytest.raises(ValueError, match="host_ahead"):
        DevicePrefetcher([], torch.device("cpu"), host_ahead=-1)
    assert list(DevicePrefetcher([], torch.device("cpu"))) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_copies_on_gpu():
    device = torch.device("cuda")
    want = list(_items(6))
    out = []
    for item, batch in DevicePrefetcher(_items(6), device, select=lambda x: x.batch, host_ahead=2):
        assert batch.dense.is_cuda
        out.append((batch.dense * 2).sum())  # consumed on the current stream right away
        assert _same(batch.to("cpu"), want[item.index].batch)
    torch.cuda.synchronize()
    assert len(out) == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_loop_with_the_host_thread_matches_without_it(tmp_path, small_config, monkeypatch):
    """The trainer on CUDA receives batches from loader workers and counts FLOPs in a host thread
    (``trainer.HOST_AHEAD``): same batches, same order, so the same losses as without the thread (up to
    the GPU's non-deterministic sums: atomics in embedding backward, ~1e-6 relative over 6 steps of the tiny
    model; 1e-4 still catches a skipped or reordered batch, which changes a loss by >= 1e-2)."""
    import gem_train.loop.trainer as trainer_mod

    extra = ("run.device=cuda", "data.num_workers=2", "train.steps=6", "train.log_every=3")
    with_thread = trainer_mod.Trainer(small_config(tmp_path / "a", *extra)).fit()
    monkeypatch.setattr(trainer_mod, "HOST_AHEAD", 0)
    without = trainer_mod.Trainer(small_config(tmp_path / "b", *extra)).fit()
    assert len(with_thread.losses) == 6
    assert with_thread.losses == pytest.approx(without.losses, rel=1e-4)
    rows = [r for r in map(json.loads, (with_thread.run_dir / "metrics.jsonl").read_text().splitlines())]
    assert all(r["model_tflops_per_s"] > 0 for r in rows if r["split"] == "train")  # FLOPs counted
