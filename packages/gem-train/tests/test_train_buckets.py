"""Bucketed jagged sizes for CUDA graphs (``gem_train.data.buckets``, ``gem_train.loop.cuda_graph``), on the
CPU.

- the ladder learned from a few batches holds the shipped configs' batches with little padding (reported);
- a padded batch gives the unpadded batch's loss and gradients: the dummies add exact zeros to the loss and
  get exactly zero gradient; what differs is the order of floating-point sums over more rows (fp32 here), so
  losses agree to 1e-6 relative and gradients to 1e-5 relative / 1e-7 absolute;
- the whole step (forward, loss, backward, clipping, fused AdamW with a tensor learning rate, row-wise
  Adagrad, the non-finite skip) on a padded batch runs without an op that reads device values on the host or
  has a data-dependent output size: what capturing it into a CUDA graph needs;
- a batch copied into a bucket's static inputs is that batch, field by field.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import GemBatch, multitask_loss
from gem_train.config import load_config
from gem_train.data.buckets import BucketLadder, pad_batch, padded_fraction, sequence_totals
from gem_train.data.synthetic import SyntheticAds
from gem_train.loop.build import build_run
from gem_train.loop.cuda_graph import GraphedSteps, _Graph, copy_batch_into, make_capturable
from gem_train.loop.step import StepPipeline

SMALL = [
    "data.batch_size=24", "model.overrides.n_layers=1", 'model.overrides.attention="full"',
    "data.synthetic.max_len=32", "data.synthetic.num_users=500", "data.synthetic.num_items=300",
    "data.synthetic.history_lognormal_mu=2.5", "optim.adamw_impl=fused", "optim.grad_clip=0.5",
    "train.progress_bar=false", "run.cpu_threads=1",
]  # fmt: skip


def _batches(name: str, start: int, n: int, overrides=()):
    cfg = load_config(name, list(overrides))
    src = SyntheticAds(cfg.data.synthetic, seed=0)
    return cfg, src, [src.get("train", i, cfg.data.batch_size).batch for i in range(start, start + n)]


@pytest.mark.parametrize(("name", "n_learn", "n_measure"), [("base-h200", 8, 16), ("large-h200", 8, 48)])
def test_ladder_pads_the_shipped_distributions_little(name, n_learn, n_measure):
    cfg, src, batches = _batches(name, 0, n_learn + n_measure)
    ladder = BucketLadder.from_sample(
        src.spec, cfg.data.batch_size, [sequence_totals(b) for b in batches[:n_learn]]
    )
    report = padded_fraction(ladder, batches[n_learn:])
    caps = ladder.seq_capacities["history"]
    dummies = ladder.batch_capacity - cfg.data.batch_size
    print(f"\n{name}: {len(caps)} buckets {caps}, {dummies} dummy examples; {report}")
    # A ladder of ratio 1.08 pads a batch by less than 1 - 1/1.08 = 7.4% of its capacity (plus alignment).
    assert report["padded_events"] < 0.08
    assert report["overflow_batches"] <= 1 / n_measure  # the sample's range, widened, holds the rest
    assert len(caps) <= 8  # few graphs to capture
    assert report["dummy_examples"] < 0.1


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss, _ = multitask_loss(model(batch), batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_padded_batch_gives_the_same_loss_and_gradients():
    cfg = load_config("tiny-cpu", SMALL)
    run = build_run(cfg)
    model = run.model
    src = run.source
    batches = [src.get("train", i, cfg.data.batch_size).batch for i in range(3)]
    ladder = BucketLadder.from_sample(src.spec, cfg.data.batch_size, [sequence_totals(b) for b in batches])
    for batch in batches:
        bucket = ladder.bucket(sequence_totals(batch), batch.batch_size)
        assert bucket is not None
        padded = pad_batch(batch, ladder, bucket)
        assert padded.batch_size == ladder.batch_capacity and padded.sequences["history"].total == bucket[0]
        assert not padded.label_mask[batch.batch_size :].any()
        assert int(padded.sequences["history"].lengths.max()) <= padded.sequences["history"].max_len
        loss, grads = _loss_and_grads(model, batch)
        ploss, pgrads = _loss_and_grads(model, padded)
        assert torch.allclose(ploss, loss, rtol=1e-6, atol=0), (float(ploss), float(loss))
        assert grads.keys() == pgrads.keys()
        for n, g in grads.items():
            assert torch.allclose(pgrads[n], g, rtol=1e-5, atol=1e-7), n


class _NoHostReads(TorchDispatchMode):
    """Records ops a CUDA graph cannot capture: a device value read on the host, an output whose size
    depends on device values. gem-kernels' value checks of offsets (``gem_kernels/checks.py``) read values on
    the CPU only (on CUDA they run in its debug mode alone), so their reads are not counted."""

    UNSAFE = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero", "bincount")

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        unsafe = any(u in name for u in self.UNSAFE) or (
            "repeat_interleave" in name and kwargs.get("output_size") is None and len(args) < 3
        )
        if unsafe:
            stack = traceback.extract_stack()
            if not any(f.filename.endswith("gem_kernels/checks.py") for f in stack):
                where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in stack if "gem_" in f.filename]
                self.bad.append(f"{name} at {' <- '.join(reversed(where[-3:]))}")
        return func(*args, **kwargs)


def test_whole_step_on_a_padded_batch_is_capture_safe():
    from gem_kernels.checks import debug_enabled

    assert not debug_enabled()
    cfg = load_config("tiny-cpu", SMALL)
    run = build_run(cfg)
    assert run.can_queue_steps  # fused AdamW + row-wise Adagrad skip on the device
    lr = torch.tensor(cfg.optim.lr)
    for opt in run.optimizers:
        make_capturable(opt, lr)
    src = run.source
    batches = [src.get("train", i, cfg.data.batch_size).batch for i in range(4)]
    ladder = BucketLadder.from_sample(src.spec, cfg.data.batch_size, [sequence_totals(b) for b in batches])
    padded = [pad_batch(b, ladder, ladder.bucket(sequence_totals(b), b.batch_size)) for b in batches]
    run.set_step_lr(0)
    run.device_step(padded[0])  # lazy state (optimizer moments, Adagrad sums), as the warm-up does
    for step, batch in enumerate(padded[1:], start=1):
        with _NoHostReads() as mode:
            run.set_step_lr(step)
            values, _ = run.device_step(batch)
        assert mode.bad == [], mode.bad
        assert torch.isfinite(values).all() and float(lr) == pytest.approx(
            run.dense_opt.param_groups[0]["lr"]
        )
    # A non-finite loss is skipped on the device, inside the step: parameters unchanged.
    before = [p.detach().clone() for p in run.model.parameters()]
    bad = copy.copy(padded[1])
    bad.dense = padded[1].dense.clone()
    bad.dense[0, 0] = float("nan")
    with _NoHostReads() as mode:
        values, _ = run.device_step(bad)
    assert mode.bad == [] and not torch.isfinite(values).all()
    assert all(torch.equal(a, p) for a, p in zip(before, run.model.parameters()))


def test_batch_copied_into_static_inputs():
    cfg, src, batches = _batches("tiny-cpu", 0, 6, SMALL)
    ladder = BucketLadder.from_sample(src.spec, cfg.data.batch_size, [sequence_totals(b) for b in batches])
    by_bucket: dict = {}
    for b in batches:
        by_bucket.setdefault(ladder.bucket(sequence_totals(b), b.batch_size), []).append(b)
    key, same = max(by_bucket.items(), key=lambda kv: len(kv[1]))
    assert len(same) >= 2, by_bucket.keys()
    static, other = pad_batch(same[0], ladder, key), pad_batch(same[1], ladder, key)
    copy_batch_into(static, other)
    assert torch.equal(static.dense, other.dense) and torch.equal(static.labels, other.labels)
    assert torch.equal(static.sparse.values(), other.sparse.values())
    assert torch.equal(static.sparse.lengths(), other.sparse.lengths())
    s, o = static.sequences["history"], other.sequences["history"]
    for f in ("offsets", "item_ids", "action_ids", "timestamps"):
        assert torch.equal(getattr(s, f), getattr(o, f)), f
    with pytest.raises(ValueError, match="shapes differ"):
        copy_batch_into(static, same[0])


def test_cuda_graphs_flag_is_ignored_on_the_cpu():
    cfg = load_config("tiny-cpu", [*SMALL, "train.cuda_graphs=true"])
    run = build_run(cfg)
    assert StepPipeline(run, True).graphs is None


class _FakeGraph:
    """Stands in for a captured graph on the CPU: a replay runs the captured step on the static inputs and
    writes its outputs where the graph's outputs live (what a replay of the real graph does). A real replay
    recomputes everything the capture computed from the inputs (the KJT's offsets too); an eager rerun would
    reuse the KJT's cached offsets, so each replay gets a KJT made anew from the static tensors."""

    def __init__(self, run, batch):
        self.run, self.batch, self.replays = run, batch, 0
        self.values, self.per_task = None, None

    def replay(self):
        b, k = self.batch, self.batch.sparse
        kjt = KeyedJaggedTensor(
            keys=k.keys(), values=k.values(), lengths=k.lengths(), stride=k.stride(),
            length_per_key=k.length_per_key(), offset_per_key=k.offset_per_key(),
        )  # fmt: skip
        fresh = GemBatch(b.dense, kjt, b.sequences, b.request_time, b.labels, b.label_mask)
        values, per_task = self.run.device_step(fresh)
        self.values.copy_(values)
        for k, v in per_task.items():
            self.per_task[k].copy_(v)
        self.replays += 1


class _CpuGraphedSteps(GraphedSteps):
    def _check_device(self, run):
        pass

    def _device_handles(self, run):
        return None, None

    def _capture(self, batch):
        g = _FakeGraph(self.run, batch)
        spec_loss = torch.zeros(2)
        g.values, g.per_task = spec_loss, {t: torch.zeros(()) for t in self.run.tasks}
        self.stats.captures += 1
        return _Graph(g, batch, g.values, g.per_task)


def test_graphed_steps_bookkeeping_on_the_cpu():
    """GraphedSteps' path on the CPU with a stand-in graph: the ladder from the first batches, one eager
    warm-up per bucket, then a capture and replays that copy each batch into the bucket's static inputs; the
    losses follow the plain steps' to fp32 summation order (the same model, the same batches), the learning
    rate each step's, and a batch out of every bucket runs eagerly."""
    overrides = [*SMALL, "data.synthetic.history_lognormal_sigma=0.3"]
    cfg = load_config("tiny-cpu", overrides)
    plain, graphed_run = build_run(cfg), build_run(cfg)
    graphed_run.model.load_state_dict(plain.model.state_dict())
    graphs = _CpuGraphedSteps(graphed_run, ladder_batches=3)
    lr = graphed_run.dense_opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)
    for opt in plain.optimizers:  # the same optimizer numerics: capturable AdamW with a tensor lr
        make_capturable(opt, torch.tensor(cfg.optim.lr))
    src = plain.source
    batches = [src.get("train", i % 4, cfg.data.batch_size).batch for i in range(14)]
    for step, batch in enumerate(batches):
        want = plain.queue_step(batch, step).result()
        got = graphs.queue_step(batch, step).result()
        assert got.loss == pytest.approx(want.loss, rel=1e-5), step
        assert float(lr) == pytest.approx(plain.dense_opt.param_groups[0]["lr"].item())
    s = graphs.stats
    assert graphs.ladder is not None
    n_buckets = len(s.per_bucket)
    assert s.captures == n_buckets and s.replays == 14 - 3 - n_buckets, s
    assert s.eager_steps == 3 + n_buckets and s.overflow_steps == 0
    assert 0 < s.as_dict()["padded_fraction"] < 0.6  # tiny batches (~300 events) and capacities in 256s
    # A batch with far more events than the ladder's last capacity runs eagerly, unpadded.
    big = load_config("tiny-cpu", [*overrides, "data.synthetic.history_lognormal_mu=3.4"])
    huge = SyntheticAds(big.data.synthetic, seed=1).get("train", 0, cfg.data.batch_size).batch
    assert graphs.ladder.bucket(sequence_totals(huge), huge.batch_size) is None
    graphs.queue_step(huge, 14).result()
    assert graphs.stats.overflow_steps == 1
