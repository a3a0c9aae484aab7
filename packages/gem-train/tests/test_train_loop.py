"""The training loop end to end on the CPU: the default command, exact resume, NaN policy, CLI errors."""

import json
import math
import warnings

import pytest

from gem_train.checkpoint import list_checkpoints
from gem_train.cli import main
from gem_train.config import load_config
from gem_train.data.synthetic import SyntheticAds
from gem_train.trainer import NonFiniteLossError, Trainer

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
    assert [r["step"] for r in rows if r["split"] == "eval"] == [2, 4]
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
    assert [p.name for p in list_checkpoints(tr.run.checkpoints)] == ["step_00000002"]


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
