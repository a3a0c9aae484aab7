"""``parallel.balancer = "base_batch_shuffling"``: the balanced training stream (gem_train.data.balance)
and the trainer with it: conservation of samples, exact resume, lower cost spread on a skewed stream."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from gem_parallel.balance import default_pool_batches, get_cost_model
from gem_train.checkpoint import read_trainer_state
from gem_train.config import load_config
from gem_train.data.balance import (
    POLICY,
    BalancedTrainStream,
    balanced_stream,
    calibration_batches,
    common_level,
    concat_batches,
    reshard_balancer,
    sample_lengths,
)
from gem_train.data.balance_state import BalancerPosition
from gem_train.data.loader import LoadedBatch
from gem_train.data.synthetic import SyntheticAds
from gem_train.loop.trainer import Trainer

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

BS = 16


def _tagged_stream(n_batches: int, skew: bool) -> list[LoadedBatch]:
    """Synthetic training batches whose dense feature 0 is a unique sample id; with ``skew``, sorted by
    total sequence length and dealt out heavy, light, heavy, light, ... (a worst case for step time)."""
    src = SyntheticAds(load_config("tiny-cpu").data.synthetic, seed=3)
    batches = [src.get("train", i, BS) for i in range(n_batches)]
    for i, lb in enumerate(batches):
        lb.batch.dense[:, 0] = torch.arange(i * BS, (i + 1) * BS, dtype=torch.float32)
    if not skew:
        return batches
    every = concat_batches([lb.batch for lb in batches])
    order = torch.argsort(sample_lengths(every).sum(1), descending=True, stable=True)
    chunks = [order[k * BS : (k + 1) * BS] for k in range(n_batches)]
    dealt = [chunks[k // 2] if k % 2 == 0 else chunks[n_batches - 1 - k // 2] for k in range(n_batches)]
    return [LoadedBatch(every.select(c), i, None) for i, c in enumerate(dealt)]


def _stream(
    batches: list[LoadedBatch], seed: int = 0, policy: str = POLICY, level: float | None = None
) -> BalancedTrainStream:
    def open_stream(pos: int):
        return iter(batches[pos:])

    return BalancedTrainStream(
        open_stream, base=0, world_size=1, batch_size=BS, seed=seed, policy=policy, mean_cost=level
    )


def _level_of(batches: list[LoadedBatch]) -> float:
    """A plain float64 mean of the mix cost over the batches (the level a calibration of them gives)."""
    return float(_batch_costs(batches).sum()) / (BS * len(batches))


def _rows(b) -> dict[int, tuple]:
    """Sample id -> everything of the sample (dense, labels, time, its sequences and sparse ids)."""
    out = {}
    for k in range(b.batch_size):
        s = b.select([k])
        seqs = tuple((n, q.item_ids.tolist(), q.action_ids.tolist(), q.timestamps.tolist())
                     for n, q in sorted(s.sequences.items()))  # fmt: skip
        sparse = tuple((key, s.sparse[key].values().tolist()) for key in s.sparse.keys())  # noqa: SIM118 (a KJT)
        out[int(s.dense[0, 0])] = (s.dense.tolist(), s.labels.tolist(), s.label_mask.tolist(),
                                   int(s.request_time[0]), seqs, sparse)  # fmt: skip
    return out


def _batch_costs(batches) -> torch.Tensor:
    cost = get_cost_model("mix")
    per_batch = [cost.sample_costs(sample_lengths(b.batch).sum(1).double()).sum() for b in batches]
    return torch.tensor([float(c) for c in per_batch])


@pytest.mark.parametrize("policy,common", [("capped", True), ("capped", False), ("sliding", False)])
def test_every_sample_is_emitted_once_and_unchanged(policy, common):
    src = _tagged_stream(24, skew=True)  # longer than the pool (16 batches of 16): it refills
    want: dict[int, tuple] = {}
    for lb in src:
        want.update(_rows(lb.batch))
    got: dict[int, tuple] = {}
    out = list(_stream(src, policy=policy, level=_level_of(src[:4]) if common else None))
    for lb in out:
        rows = _rows(lb.batch)
        assert not set(rows) & set(got), "a sample emitted twice"
        got.update(rows)
    assert got == want  # each sample exactly once, every field of it intact
    assert [lb.index for lb in out] == list(range(len(out)))
    assert all(lb.batch.batch_size == BS for lb in out[:-1])
    spec = SyntheticAds(load_config("tiny-cpu").data.synthetic).spec
    for lb in out:
        lb.batch.validate(spec)  # the concatenated, re-selected batches are well-formed


def test_cost_spread_is_lower_than_without_the_balancer():
    src = _tagged_stream(24, skew=True)
    plain = _batch_costs(src)
    balanced = _batch_costs(list(_stream(src))[:-2])  # the last batches of a finite stream are its rest
    assert plain.std() > 0
    # Heavy and light batches alternate: the pool (16 batches of 16: at least 256 samples) mixes them. The
    # ratio of the coefficients of variation was 0.052 (deterministic: fixed seeds; 0.457 with the earlier
    # sliding policy and a pool of 4 batches).
    ratio = float(balanced.std() / balanced.mean()) / float(plain.std() / plain.mean())
    print(f"coefficient of variation of batch cost: balanced / plain = {ratio:.3f}")
    assert ratio < 0.2, (plain, balanced)


@pytest.mark.parametrize("policy,common", [("capped", True), ("capped", False), ("sliding", False)])
@pytest.mark.parametrize("cut", [2, 12])
def test_the_stream_resumes_exactly_from_any_state(policy, common, cut):
    src = _tagged_stream(24, skew=True)
    level = _level_of(src[:4]) if common else None
    full = [_rows(lb.batch) for lb in _stream(src, seed=5, policy=policy, level=level)]
    first = _stream(src, seed=5, policy=policy, level=level)
    it = iter(first)
    head = [_rows(next(it).batch) for _ in range(cut + 1)]
    state = first.state_after(cut)
    assert state["policy"] == policy
    second = _stream(src, seed=5, policy=policy, level=level)
    second.load_state_dict(state)
    tail = [_rows(lb.batch) for lb in second]
    assert head + tail == full
    assert [lb.index for lb in _resumed(src, state, policy, level)] == list(range(cut + 1, len(full)))


def _resumed(src, state, policy, level=None):
    s = _stream(src, seed=5, policy=policy, level=level)
    s.load_state_dict(state)
    return list(s)


def test_a_checkpoint_of_the_sliding_policy_resumes_with_it():
    """A state written before the switch to "capped" names "sliding": the position resumes with that policy
    (exactly), and a fresh stream uses the new default."""
    src = _TaggedSource()
    old = balanced_stream(src, rank=0, world_size=1, batch_size=BS, seed=1, policy="sliding")
    it = iter(old)
    head = [next(it).batch.dense[:, 0].long().tolist() for _ in range(3)]
    rest = [next(it).batch.dense[:, 0].long().tolist() for _ in range(3)]
    pos = BalancerPosition()
    pos.resume({"base": 0, "world_size": 1, "batch_size": BS, "carry": [[]], "ranks": [old.state_after(2)]},
               0, 1, BS)  # fmt: skip
    stream = pos.stream(src, rank=0, world=1, batch_size=BS, seed=1, base=0, num_workers=0, pin=False)
    assert stream.shuffler.policy == "sliding"
    assert pos.level is None and stream.shuffler.mean_cost is None  # no level saved: its running mean
    it2 = iter(stream)
    assert [next(it2).batch.dense[:, 0].long().tolist() for _ in range(3)] == rest
    fresh = BalancerPosition(calibration_samples=64).stream(
        src, rank=0, world=1, batch_size=BS, seed=1, base=0, num_workers=0, pin=False
    )
    assert head and fresh.shuffler.policy == POLICY == "capped"
    assert fresh.shuffler.mean_cost == common_level(src, 64)


def test_the_common_level_is_the_same_on_every_rank_and_a_plain_mean():
    """Every rank of 3 (and of 1) computes the same level, bit for bit: the mean mix cost of the first rows
    of the training split (global batches 0, 1, ... of the calibration read size), against a plain float64
    reference; a ragged read (100 rows in reads of 7) is the same rows' mean."""
    src = _TaggedSource()
    rows = src.get("train", 0, 1024).batch
    reference = float(get_cost_model("mix").sample_costs(sample_lengths(rows).sum(1).double())[:100].mean())
    levels = []
    for world in (3, 1):
        for r in range(world):
            pos = BalancerPosition(calibration_samples=100)
            s = pos.stream(src, rank=r, world=world, batch_size=BS, seed=1, base=0, num_workers=0, pin=False)
            assert s.shuffler.mean_cost == pos.level
            levels.append(pos.level)
    assert len(set(levels)) == 1 and levels[0] == pytest.approx(reference, rel=1e-12)
    ragged = torch.cat([sample_lengths(src.get("train", k, 7).batch) for k in range(15)])[:100]
    want = float(get_cost_model("mix").sample_costs(ragged.sum(1).double()).mean())
    assert common_level(src, 100, read_batch=7) == pytest.approx(want, rel=1e-12)  # endless: batches 0..14


def test_the_level_is_saved_and_a_resume_uses_the_saved_one():
    """A fresh position computes the level once; its checkpoint entry holds it; a resume (same world size)
    takes the saved level (not recomputed: a changed saved value is what the resumed stream aims at) and
    continues the stream exactly; a checkpoint written before the first batch (no level, no rank state)
    computes it as a fresh stream does."""
    src = _TaggedSource()
    pos = BalancerPosition(calibration_samples=64)
    first = pos.stream(src, rank=0, world=1, batch_size=BS, seed=1, base=0, num_workers=0, pin=False)
    it = iter(first)
    [next(it) for _ in range(3)]
    rest = [next(it).batch.dense[:, 0].long().tolist() for _ in range(3)]
    saved = pos.saved([first.state_after(2)], 1, BS, 0)
    assert saved["level"] == common_level(src, 64) and isinstance(saved["level"], float)
    again = BalancerPosition(calibration_samples=1)  # would give another level if it recomputed
    again.resume(saved, 0, 1, BS)
    stream = again.stream(src, rank=0, world=1, batch_size=BS, seed=1, base=0, num_workers=0, pin=False)
    assert stream.shuffler.mean_cost == saved["level"]
    it2 = iter(stream)
    assert [next(it2).batch.dense[:, 0].long().tolist() for _ in range(3)] == rest
    moved = BalancerPosition()
    moved.resume({**saved, "level": 2.5 * saved["level"]}, 0, 1, BS)
    assert moved.stream(src, rank=0, world=1, batch_size=BS, seed=1, base=0, num_workers=0,
                        pin=False).shuffler.mean_cost == 2.5 * saved["level"]  # fmt: skip
    early = BalancerPosition(calibration_samples=64)
    early.resume({**saved, "ranks": [None], "level": None}, 0, 1, BS)
    early.stream(src, rank=0, world=1, batch_size=BS, seed=1, base=0, num_workers=0, pin=False)
    assert early.level == saved["level"]


def test_training_with_the_balancer_resumes_bit_identically(tmp_path, small_config):
    steps = ["train.steps=6", "checkpoint.every=0", "parallel.balancer=base_batch_shuffling",
             "parallel.balancer_calibration=4096"]  # fmt: skip
    full = Trainer(small_config(tmp_path / "a", *steps)).fit()
    assert full.status == "completed" and len(full.losses) == 6
    plain = Trainer(small_config(tmp_path / "p", "train.steps=6", "checkpoint.every=0")).fit()
    assert plain.losses != full.losses  # the balancer changed which samples each step saw
    first = Trainer(small_config(tmp_path / "b", *steps)).fit(stop_after=3)
    assert first.status == "stopped"
    second = Trainer(small_config(tmp_path / "b", *steps), resume="latest").fit()
    assert first.losses + second.losses == full.losses


class _TaggedSource:
    """SyntheticAds whose training sample ``(b, j)`` carries the id ``b * BS + j`` in dense feature 0."""

    def __init__(self) -> None:
        self.inner = SyntheticAds(load_config("tiny-cpu").data.synthetic, seed=3)
        self.spec = self.inner.spec

    def get(self, split, index, batch_size):
        lb = self.inner.get(split, index, batch_size)
        lb.batch.dense[:, 0] = torch.arange(index * batch_size, (index + 1) * batch_size, dtype=torch.float32)
        return lb

    def num_batches(self, split, batch_size):
        return self.inner.num_batches(split, batch_size)


def _run_ranks(src, world, counts, base=0, carries=None):
    """``world`` ranks' balanced streams, rank ``r`` emitting ``counts[r]`` batches: (ids, saved state)."""
    carries = carries or [[] for _ in range(world)]
    ids, states = [], []
    for r in range(world):
        s = balanced_stream(src, rank=r, world_size=world, batch_size=BS, seed=1, base=base, carry=carries[r])
        it = iter(s)
        for _ in range(counts[r]):
            ids += next(it).batch.dense[:, 0].long().tolist()
        states.append(s.state_after(counts[r] - 1) if counts[r] else None)
    saved = {"base": base, "world_size": world, "batch_size": BS, "carry": carries, "ranks": states}
    return ids, saved


def test_balanced_stream_resharded_4_to_2_to_1_trains_every_sample_once():
    """The pools of 4 ranks (one rank a batch ahead: an unread gap below the others' frontier) carried onto
    2 ranks, then onto 1: no sample emitted twice, and every sample below the final plain-stream position is
    emitted or still waiting in the final state."""
    src = _TaggedSource()
    ids4, saved4 = _run_ranks(src, 4, [3, 3, 4, 3])
    base2, carry2 = reshard_balancer(saved4, 2)
    # Rank 2 read pool + 3 sub-batches (`pool` to fill its pool, then one per later batch), the others
    # pool + 2: the plain stream restarts at 4 * (pool + 3), and rank r's last, unread by ranks 0, 1 and 3, is
    # carried whole.
    pool = default_pool_batches(BS)
    assert base2 == 4 * (pool + 3)
    assert abs(len(carry2[0]) - len(carry2[1])) <= 1
    ids2, saved2 = _run_ranks(src, 2, [5, 5], base2, carry2)
    base1, carry1 = reshard_balancer(saved2, 1)
    ids1, saved1 = _run_ranks(src, 1, [7], base1, carry1)
    frontier, waiting = reshard_balancer(saved1, 1)
    emitted = ids4 + ids2 + ids1
    assert len(set(emitted)) == len(emitted), "a sample emitted twice"
    rest = [b * BS + j for b, j in waiting[0]]
    assert sorted(emitted + rest) == list(range(frontier * BS))
    assert any(i < base2 * BS for i in ids2)  # the carried samples are trained on the new ranks


def test_a_stream_with_a_carry_resumes_exactly():
    src = _TaggedSource()
    _, saved = _run_ranks(src, 2, [2, 2])
    base, carry = reshard_balancer(saved, 1)
    full, _ = _run_ranks(src, 1, [6], base, carry)
    head, mid = _run_ranks(src, 1, [2], base, carry)
    s = balanced_stream(src, rank=0, world_size=1, batch_size=BS, seed=1, base=base, carry=carry[0])
    s.load_state_dict(mid["ranks"][0])
    it = iter(s)
    tail = [i for _ in range(4) for i in next(it).batch.dense[:, 0].long().tolist()]
    assert head + tail == full


@pytest.mark.slow  # 85 s on the 2 shared cores (two torchrun launches): past the fast suite's budget
@pytest.mark.distributed
def test_two_processes_balanced_resume_is_exact(tmp_path):
    """torchrun, 2 gloo ranks, balancer on: every rank's shuffler state is in the checkpoint, and a resume
    from step 2 logs the same per-step losses (mean over the ranks) at steps 3 and 4."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "gem_train.cli", "train", "parallel.balancer=base_batch_shuffling",
        "parallel.balancer_calibration=4096",
        "data.batch_size=16", "data.eval_batch_size=64", "data.synthetic.eval_examples=64",
        "data.synthetic.max_len=8", "data.synthetic.num_users=300", "data.synthetic.num_items=200",
        "model.overrides.n_layers=1", 'model.overrides.attention="full"',
        "train.steps=4", "train.log_every=1", "train.progress_bar=false",
        "checkpoint.every=2", f"run.out_dir={tmp_path}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=200)
    assert done.returncode == 0, done.stderr[-4000:]
    (run,) = tmp_path.iterdir()

    def losses() -> dict[int, float]:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}

    full = losses()
    assert sorted(full) == [1, 2, 3, 4]
    ckpt = run / "checkpoints" / "step_00000002"
    saved = read_trainer_state(ckpt)["balancer"]
    assert saved["world_size"] == 2 and saved["base"] == 0 and len(saved["ranks"]) == 2
    assert [s["emitted"] for s in saved["ranks"]] == [2, 2]
    assert saved["ranks"][0] != saved["ranks"][1]  # each rank balances its own stream
    assert isinstance(saved["level"], float) and saved["level"] > 0  # the common level, saved once
    resume = [*cmd[:8], "--resume", str(ckpt), *cmd[8:]]
    done = subprocess.run(resume, capture_output=True, text=True, env=env, timeout=200)
    assert done.returncode == 0, done.stderr[-4000:]
    again = losses()
    assert again == full  # steps 1-2 kept, steps 3-4 recomputed bit-identically


class _Finite(_TaggedSource):
    def num_batches(self, split, batch_size):
        return 1000 // batch_size  # one pass: 142 batches of 7 rows


def test_the_calibration_sample_is_spread_over_one_pass():
    """With a pass of 142 batches, 15 reads of 7 rows (100 samples) take every 9th batch (0, 9, ..., 126)."""
    src = _Finite()
    assert calibration_batches(src, 100, 7) == [9 * k for k in range(15)]
    assert calibration_batches(src, 10_000, 7) == list(range(1429))  # more than a pass: consecutive
    assert calibration_batches(_TaggedSource(), 100, 7) == list(range(15))  # endless: the first
    ragged = torch.cat([sample_lengths(src.get("train", 9 * k, 7).batch) for k in range(15)])[:100]
    want = float(get_cost_model("mix").sample_costs(ragged.sum(1).double()).mean())
    assert common_level(src, 100, read_batch=7) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="samples"):
        common_level(src, 0)
