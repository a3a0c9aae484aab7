"""Overlapped steps (BuiltRun.queue_step): a step's loss is read after the next step is queued, non-finite
steps are skipped on the device (found_inf) — the same losses, skips and errors as the synchronous loop.

On the CPU the overlap runs with ``optim.adamw_impl=fused`` (CUDA's default); ``train.overlap_steps=false``
is the synchronous reference with the same fused optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gem_train.data.synthetic import SyntheticAds
from gem_train.loop.optim import RowWiseAdagrad
from gem_train.loop.step import BuiltRun, PendingStep
from gem_train.loop.trainer import NonFiniteLossError, Trainer

# Log every 4 steps: steps 1-3 of each window are read one step late.
# valid_every=0: validation (a boundary: its step is read at once) only at the last step.
FUSED = ("optim.adamw_impl=fused", "train.log_every=4", "checkpoint.every=0", "train.valid_every=0")


def _record_calls(monkeypatch) -> list[str]:
    """Wrap BuiltRun.queue_step, BuiltRun.train_step and PendingStep.result: the order of the calls."""
    calls: list[str] = []
    q, t, r = BuiltRun.queue_step, BuiltRun.train_step, PendingStep.result

    def queue_step(self, batch, step):
        calls.append("queue")
        return q(self, batch, step)

    def train_step(self, batch, step):
        calls.append("train")
        return t(self, batch, step)

    def result(self):
        calls.append("read")
        return r(self)

    monkeypatch.setattr(BuiltRun, "queue_step", queue_step)
    monkeypatch.setattr(BuiltRun, "train_step", train_step)
    monkeypatch.setattr(PendingStep, "result", result)
    return calls


def _poison(monkeypatch, bad_index: int) -> None:
    orig = SyntheticAds.get

    def get(self, split, index, batch_size):
        lb = orig(self, split, index, batch_size)
        if split == "train" and index == bad_index:
            lb.batch.dense[0, 0] = float("nan")
        return lb

    monkeypatch.setattr(SyntheticAds, "get", get)


def test_overlapped_loop_equals_the_synchronous_loop(tmp_path, monkeypatch, small_config):
    calls = _record_calls(monkeypatch)
    sync = Trainer(small_config(tmp_path / "s", "train.steps=8", *FUSED, "train.overlap_steps=false")).fit()
    assert calls.count("queue") == 8 and calls.count("train") == 8  # train_step = queue_step + read
    calls.clear()
    over = Trainer(small_config(tmp_path / "o", "train.steps=8", *FUSED)).fit()
    assert "train" not in calls and calls.count("queue") == 8 and calls.count("read") == 8
    # Steps 1-3 and 5-7 are read after the next one was queued; 4 and 8 (logged) at once.
    assert calls[:8] == ["queue", "queue", "read", "queue", "read", "queue", "read", "read"]
    assert over.status == sync.status == "completed"
    assert over.losses == sync.losses and len(over.losses) == 8  # bit for bit
    a, b = over.final_eval.tasks["ctr"], sync.final_eval.tasks["ctr"]
    assert a.ne == b.ne and a.auc == b.auc


def test_foreach_adamw_keeps_the_synchronous_step(tmp_path, monkeypatch, small_config):
    calls = _record_calls(monkeypatch)
    res = Trainer(small_config(tmp_path, "train.steps=3", "optim.adamw_impl=foreach")).fit()
    assert res.status == "completed" and set(calls) == {"train"}


def test_a_non_finite_step_read_late_is_skipped_on_the_device(tmp_path, monkeypatch, small_config):
    _poison(monkeypatch, bad_index=1)  # step 2: read after step 3 was queued
    extra = ("train.steps=6", *FUSED, "train.nan_policy=skip")
    over = Trainer(small_config(tmp_path / "o", *extra)).fit()
    sync = Trainer(small_config(tmp_path / "s", *extra, "train.overlap_steps=false")).fit()
    assert over.status == sync.status == "completed"
    assert len(over.losses) == 5 and all(math.isfinite(x) for x in over.losses)
    # The steps after the skipped one start from the same weights, moments and step counts.
    assert over.losses == sync.losses


def test_nan_stop_policy_names_the_step_read_late(tmp_path, monkeypatch, small_config):
    _poison(monkeypatch, bad_index=2)  # step 3, read after step 4 was queued
    tr = Trainer(small_config(tmp_path, "train.steps=8", *FUSED))
    with pytest.raises(NonFiniteLossError, match=r"loss nan at step 3"):
        tr.fit()


@pytest.mark.parametrize("sparse", [False, True])
def test_rowwise_adagrad_found_inf_leaves_tables_and_accumulators(sparse):
    gen = torch.Generator().manual_seed(3)
    if sparse:
        bag = nn.EmbeddingBag(6, 4, mode="sum", sparse=True)
        w = bag.weight
    else:
        w = nn.Parameter(torch.randn(6, 4, generator=gen))
    opt = RowWiseAdagrad([w], lr=0.1)

    def grad(scale: float) -> None:
        if sparse:
            w.grad = None
            (bag(torch.tensor([0, 2, 5]), torch.tensor([0, 2])).sum() * scale).backward()
        else:
            w.grad = torch.randn(6, 4, generator=gen) * scale

    grad(1.0)
    opt.step()  # one ordinary step: the accumulator is non-zero
    w1, s1 = w.detach().clone(), opt.state[w]["sum"].clone()
    opt.found_inf = torch.ones(())
    grad(float("nan"))
    opt.step()
    assert torch.equal(w.detach(), w1) and torch.equal(opt.state[w]["sum"], s1)
    opt.found_inf = torch.zeros(())
    grad(1.0)
    g = w.grad.to_dense() if sparse else w.grad
    opt.step()
    want_s = s1 + g.square().mean(1)
    torch.testing.assert_close(opt.state[w]["sum"], want_s)
    rows = g.abs().sum(1) > 0
    want_w = w1 - 0.1 * g / (want_s.sqrt() + 1e-8)[:, None]
    torch.testing.assert_close(w.detach()[rows], want_w[rows])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlapped_loop_matches_the_synchronous_one_and_skips_on_the_device(
    tmp_path, monkeypatch, small_config
):
    """On CUDA fused AdamW is the default, so the loop overlaps steps; the same losses as with
    ``train.overlap_steps=false`` up to the GPU's non-deterministic sums (embedding backward atomics: ~1e-6
    relative over a few tiny steps; 1e-4 still catches a lost or repeated update, >= 1e-2), a poisoned step
    read late skipped in both."""
    calls = _record_calls(monkeypatch)
    _poison(monkeypatch, bad_index=1)
    extra = (
        "run.device=cuda",
        "train.steps=8",
        "train.log_every=4",
        "checkpoint.every=0",
        "train.nan_policy=skip",
    )
    over = Trainer(small_config(tmp_path / "o", *extra)).fit()
    assert "train" not in calls and calls.count("queue") == 8
    sync = Trainer(small_config(tmp_path / "s", *extra, "train.overlap_steps=false")).fit()
    assert len(over.losses) == len(sync.losses) == 7
    assert over.losses == pytest.approx(sync.losses, rel=1e-4)
