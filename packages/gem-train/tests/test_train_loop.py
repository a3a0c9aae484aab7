"""The training loop end to end on the CPU: the default command, exact resume, NaN policy, CLI errors."""

import json
import math
import os
import signal
import warnings

import pytest
import torch

from gem_train.checkpoint import list_checkpoints
from gem_train.cli import main
from gem_train.config import load_config
from gem_train.data.synthetic import SyntheticAds
from gem_train.loop.trainer import NonFiniteLossError, Trainer

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_default_command_end_to_end(tmp_path, capsys, small_overrides):
    # `gem-train` itself is `gem-train train` with tiny-cpu; here with a small step count.
    assert (
        main(["train", *small_overrides, "train.steps=4", "train.eval_every=2", f"run.out_dir={tmp_path}"])
        == 0
    )
    out = capsys.readouterr().out
    assert "ctr: NE" in out and "cvr: NE" in out and "ground-truth NE floor" in out
    run = next(tmp_path.iterdir())
    assert f"run directory: {run}" in out
    for f in (
        "config.toml",
        "metrics.jsonl",
        "eval.json",
        "plots/loss.png",
        "plots/ne.png",
        "plots/reliability.png",
    ):
        assert (run / f).is_file(), f
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [2, 4]
    assert all(r["examples_per_s"] > 0 and "ctr/ne" in r for r in train_rows)
    assert [r["step"] for r in rows if r["split"] == "test"] == [2, 4]
    summary = json.loads((run / "eval.json").read_text())
    assert set(summary["tasks"]) == {"ctr", "cvr"} and summary["ground_truth_ne"]["ctr"] < 1
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000004"]
    # The saved config re-loads as a run config.
    assert load_config(run / "config.toml").train.steps == 4


def test_resume_gives_exactly_the_same_losses(tmp_path, small_config):
    steps = ["train.steps=6", "checkpoint.every=0"]
    full = Trainer(small_config(tmp_path / "a", *steps)).fit()
    assert full.status == "completed" and len(full.losses) == 6

    first = Trainer(small_config(tmp_path / "b", *steps)).fit(stop_after=3)
    assert first.status == "stopped" and first.last_checkpoint.name == "step_00000003"
    # "latest": the newest checkpoint of this config's runs (a decoy run of another name is ignored).
    (tmp_path / "b" / "tiny-cpu-baseline-20991231-000000" / "checkpoints").mkdir(parents=True)
    second = Trainer(small_config(tmp_path / "b", *steps), resume="latest").fit()
    assert second.status == "completed" and second.run_dir == first.run_dir
    # Bit-for-bit: same data position, weights, optimizer states, LR schedule and RNG.
    assert first.losses + second.losses == full.losses
    a, b = full.final_eval.tasks["ctr"], second.final_eval.tasks["ctr"]
    assert a.ne == b.ne and a.auc == b.auc
    # The resumed run's metrics hold each step once.
    rows = [json.loads(x) for x in (second.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4, 6]


def _poison(monkeypatch, bad_index):
    orig = SyntheticAds.get

    def get(self, split, index, batch_size):
        lb = orig(self, split, index, batch_size)
        if split == "train" and index == bad_index:
            lb.batch.dense[0, 0] = float("nan")  # a corrupt record reaching the model
        return lb

    monkeypatch.setattr(SyntheticAds, "get", get)


def test_nan_loss_stops_naming_the_step_and_keeps_last_checkpoint(tmp_path, monkeypatch, small_config):
    _poison(monkeypatch, bad_index=3)
    tr = Trainer(small_config(tmp_path, "train.steps=6", "checkpoint.every=2"))
    with pytest.raises(
        NonFiniteLossError, match=r"loss nan at step 4.*last good checkpoint is .*step_00000002"
    ):
        tr.fit()
    assert [p.name for p in list_checkpoints(tr.run_dir.checkpoints)] == ["step_00000002"]


def test_nan_loss_skip_policy(tmp_path, monkeypatch, small_config):
    _poison(monkeypatch, bad_index=1)
    res = Trainer(small_config(tmp_path, "train.steps=4", "train.nan_policy=skip")).fit()
    assert res.status == "completed" and len(res.losses) == 3 and all(math.isfinite(x) for x in res.losses)


def test_cli_errors(tmp_path, capsys):
    assert main(["train", "train.stepz=3"]) == 2
    assert "config error: unknown config key 'train.stepz'" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 1
    assert "not a complete gem-train checkpoint" in capsys.readouterr().err
    assert main(["config", "train.steps=9"]) == 0
    assert "steps = 9" in capsys.readouterr().out


def test_eval_command_on_a_checkpoint(tmp_path, capsys, small_config):
    res = Trainer(small_config(tmp_path, "train.steps=2")).fit()
    assert main(["eval", "--checkpoint", str(res.last_checkpoint)]) == 0
    out = capsys.readouterr().out
    # The same numbers as the run's own final evaluation.
    assert f"NE {res.final_eval.tasks['ctr'].ne:.4f}" in out


def test_after_divergence_the_last_good_checkpoint_predates_it_and_resumes(tmp_path, small_config):
    """The update of step 4 leaves an infinite weight; step_4 holds it and step 5's loss is not finite. The
    last good checkpoint is step_2 (kept although keep_last=1), step_4 is set aside, and resuming the run
    takes step_2 and reproduces the clean run exactly."""
    steps = ["train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=1"]
    clean = Trainer(small_config(tmp_path / "clean", *steps)).fit()
    tr = Trainer(small_config(tmp_path / "run", *steps))
    adamw = tr.optimizers[0]
    real_step, calls = adamw.step, [0]

    def diverging_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 4:
            with torch.no_grad():
                adamw.param_groups[0]["params"][0].fill_(float("inf"))
        return out

    adamw.step = diverging_step
    with pytest.raises(
        NonFiniteLossError,
        match=r"at step 5: .*last good checkpoint is \S*step_00000002 .*set aside as nonfinite-step_00000004",
    ):
        tr.fit()
    assert [p.name for p in list_checkpoints(tr.run_dir.checkpoints)] == ["step_00000002"]
    resumed = Trainer(small_config(tmp_path / "run", *steps), resume=str(tr.run_dir.root)).fit()
    assert resumed.status == "completed" and resumed.losses == clean.losses[2:]


class _SignalNotHandled(Exception):
    pass


def _signal_on_batch(monkeypatch, split, index, times=1):
    """A real SIGTERM to this process (``times`` of them) while the loader fetches batch ``index`` of
    ``split``; outside the trainer's handlers, SIGTERM raises _SignalNotHandled instead of killing pytest.
    A training batch is fetched first by the dense-scale check before training (outside the loop): the
    signal comes at its second fetch, the training loop's."""
    orig = SyntheticAds.get
    sent = [False]
    fetches = [0]

    def get(self, s, i, batch_size):
        if s == split and i == index:
            fetches[0] += 1
        if s == split and i == index and not sent[0] and fetches[0] == (2 if split == "train" else 1):
            sent[0] = True
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGTERM)
        return orig(self, s, i, batch_size)

    def not_handled(signum, frame):
        raise _SignalNotHandled(f"{signal.Signals(signum).name} outside the trainer's signal handling")

    monkeypatch.setattr(SyntheticAds, "get", get)
    old = signal.signal(signal.SIGTERM, not_handled)
    return lambda: signal.signal(signal.SIGTERM, old)


def test_sigterm_during_the_final_evaluation_checkpoints_and_says_how_to_resume(
    tmp_path, capsys, monkeypatch, small_overrides
):
    restore = _signal_on_batch(monkeypatch, "test", 1)
    args = [*small_overrides, "train.steps=3", "data.eval_batch_size=32", f"run.out_dir={tmp_path}"]
    try:
        assert main(["train", *args]) == 0
    finally:
        restore()
    err = capsys.readouterr().err
    run = next(tmp_path.iterdir())
    ckpt = run / "checkpoints" / "step_00000003"
    assert f"SIGTERM received during the final evaluation: stopped after step 3; checkpoint {ckpt}" in err
    assert f"resume with: gem-train train --resume {ckpt}" in err
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == [ckpt.name]
    assert not (run / "eval.json").exists()
    # Resuming runs the final evaluation (and nothing else: no step, no second checkpoint of step 3).
    monkeypatch.undo()
    mtime = (ckpt / "manifest.json").stat().st_mtime_ns
    assert main(["train", "--resume", str(ckpt)]) == 0
    assert "evaluation after 3 steps" in capsys.readouterr().out and (run / "eval.json").is_file()
    assert (ckpt / "manifest.json").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_second_signal_stops_at_once(tmp_path, capsys, monkeypatch, small_overrides, split):
    restore = _signal_on_batch(monkeypatch, split, 2, times=2)
    args = [*small_overrides, "train.steps=4", "data.eval_batch_size=32", f"run.out_dir={tmp_path}"]
    if split == "train":  # no validation (and best checkpoint) before the signal at the second batch
        args.append("train.valid_every=0")
    try:
        assert main(["train", *args]) == 128 + signal.SIGTERM
    finally:
        restore()
    err = capsys.readouterr().err
    assert "SIGTERM: stopped at once" in err
    if split == "train":  # nothing was written yet: the run leaves no directory behind
        assert list(tmp_path.iterdir()) == [] and "removed the run directory" in err
        return
    # During the final evaluation the final checkpoint exists.
    ckpts = list_checkpoints(next(tmp_path.iterdir()) / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000004"]
