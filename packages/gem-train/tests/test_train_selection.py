"""Model selection: validation every N steps, checkpoints/best at the argmin validation NE, its test
metrics."""

import json
import warnings

import numpy as np
import pytest

import gem_train.evaluation.selection as selection_mod
from gem_train.checkpoint import read_trainer_state
from gem_train.cli import main
from gem_train.config import ConfigError
from gem_train.loop.trainer import Trainer

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# On top of the conftest's small run: a validation stream and smaller evaluation splits, no periodic
# checkpoints (the best checkpoint is written by the selection itself).
SELECTION = (
    "data.eval_batch_size=64",
    "data.synthetic.eval_examples=96",
    "data.synthetic.valid_examples=96",
    "checkpoint.every=0",
)


@pytest.fixture
def selection_config(small_config):
    return lambda out_dir, *extra: small_config(out_dir, *SELECTION, *extra)


def _rows(run_dir, split):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def test_best_checkpoint_is_the_argmin_of_a_controlled_validation_metric(
    tmp_path, monkeypatch, capsys, selection_config
):
    # The selection value is controlled (a tie at step 4 keeps the earlier step 2); the real validation
    # metrics are still computed and logged, which shows that checkpoints/best holds the weights of step 2.
    values = {1: 0.9, 2: 0.7, 3: 0.8, 4: 0.7, 5: 0.95}
    monkeypatch.setattr(selection_mod, "selection_value", lambda ev, task: values[ev.step])
    res = Trainer(selection_config(tmp_path, "train.steps=5", "train.valid_every=1")).fit()
    assert res.best_step == 2 and res.best_valid_ne == 0.7
    ck = res.run_dir / "checkpoints"
    assert res.best_checkpoint == ck / "best" and (ck / "best").resolve().name == "best_step_00000002"
    assert sorted(p.name for p in ck.iterdir()) == ["best", "best_step_00000002", "step_00000005"]
    valid = _rows(res.run_dir, "valid")
    assert [r["step"] for r in valid] == [1, 2, 3, 4, 5]
    assert [r["select_ne"] for r in valid] == [values[s] for s in range(1, 6)]
    # The test metrics of the selected checkpoint (loaded from disk) are reported next to the final ones.
    assert res.best_eval.step == 2 and res.final_eval.step == 5
    summary = json.loads((res.run_dir / "eval.json").read_text())
    assert summary["best"]["step"] == 2 and summary["best"]["valid_ne"] == 0.7
    assert summary["best"]["tasks"]["ctr"]["ne"] == res.best_eval.tasks["ctr"].ne
    assert summary["best"]["valid"]["ctr"]["ne"] == valid[1]["ctr/ne"]
    assert _rows(res.run_dir, "best_test")[0]["best_step"] == 2
    # `gem-train eval` on checkpoints/best: the validation split gives step 2's logged validation NE, the test
    # split the reported test NE of the best checkpoint.
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ck / "best"), "--split", "valid"]) == 0
    out = capsys.readouterr().out
    assert "(step 2), valid split" in out and f"NE {valid[1]['ctr/ne']:.4f}" in out
    assert main(["eval", "--checkpoint", str(ck / "best")]) == 0
    out = capsys.readouterr().out
    assert "test split" in out and f"NE {res.best_eval.tasks['ctr'].ne:.4f}" in out


def test_selection_on_the_mean_ne_picks_the_argmin_of_the_logged_values(tmp_path, selection_config):
    res = Trainer(
        selection_config(tmp_path, "train.steps=6", "train.valid_every=2", "train.select_task=mean")
    ).fit()
    valid = _rows(res.run_dir, "valid")
    assert [r["step"] for r in valid] == [2, 4, 6]
    means = [(r["ctr/ne"] + r["cvr/ne"]) / 2 for r in valid]
    np.testing.assert_allclose([r["select_ne"] for r in valid], means, rtol=1e-12)
    k = int(np.argmin(means))
    assert res.best_step == valid[k]["step"] and res.best_valid_ne == pytest.approx(means[k], rel=1e-12)
    assert read_trainer_state(res.best_checkpoint)["step"] == res.best_step


def test_resume_keeps_the_best_checkpoint_and_the_same_selection(tmp_path, selection_config):
    steps = ["train.steps=6", "train.valid_every=2"]
    full = Trainer(selection_config(tmp_path / "a", *steps)).fit()
    first = Trainer(selection_config(tmp_path / "b", *steps)).fit(stop_after=3)
    assert first.best_step == 2 and first.best_eval is None
    second = Trainer(selection_config(tmp_path / "b", *steps), resume="latest").fit()
    assert first.losses + second.losses == full.losses
    assert (second.best_step, second.best_valid_ne) == (full.best_step, full.best_valid_ne)
    assert second.best_eval.tasks["ctr"].ne == full.best_eval.tasks["ctr"].ne


def test_selection_config_errors(tmp_path, capsys, selection_config, small_overrides):
    with pytest.raises(ConfigError, match=r"train.valid_every = 2 needs a validation split.*valid_examples"):
        Trainer(selection_config(tmp_path, "train.valid_every=2", "data.synthetic.valid_examples=0"))
    with pytest.raises(ConfigError, match=r"train.select_task = 'clicks' is not a task.*ctr, cvr"):
        Trainer(selection_config(tmp_path, "train.valid_every=2", "train.select_task=clicks"))
    assert (
        main(
            [
                "train",
                *small_overrides,
                *SELECTION,
                f"run.out_dir={tmp_path}",
                "train.valid_every=1",
                "train.select_task=x",
            ]
        )
        == 2
    )
    assert "config error: train.select_task = 'x'" in capsys.readouterr().err
    # Without a validation split no selection happens; with one (the default) even a 1-step run validates
    # at its end and has a best checkpoint.
    res = Trainer(selection_config(tmp_path, "train.steps=1", "data.synthetic.valid_examples=0")).fit()
    assert res.best_step is None and res.best_eval is None
    res = Trainer(selection_config(tmp_path, "train.steps=1")).fit()
    assert res.best_step == 1 and res.best_eval is not None
    assert main(["eval", "--checkpoint", str(res.last_checkpoint), "--split", "valid"]) == 0
    assert main(["eval", "--checkpoint", str(res.last_checkpoint), "--split", "valid",
                 "data.synthetic.valid_examples=0"]) == 2  # fmt: skip
    assert "has no validation split" in capsys.readouterr().err


def test_resume_before_the_best_step_drops_that_best_and_finds_it_again(tmp_path, selection_config):
    steps = ["train.steps=6", "train.valid_every=3", "checkpoint.every=2"]
    full = Trainer(selection_config(tmp_path / "a", *steps)).fit()
    first = Trainer(selection_config(tmp_path / "b", *steps)).fit(stop_after=3)
    assert first.best_step == 3
    # Resuming at step 2: the best of step 3 belongs to the future this run recomputes; it is dropped.
    tr = Trainer(
        selection_config(tmp_path / "b", *steps), resume=first.run_dir / "checkpoints" / "step_00000002"
    )
    assert tr.best is None and not (first.run_dir / "checkpoints" / "best").exists()
    second = tr.fit()
    assert (second.best_step, second.best_valid_ne) == (full.best_step, full.best_valid_ne)
    assert second.best_eval.tasks["ctr"].ne == full.best_eval.tasks["ctr"].ne


def test_early_stopping_ends_the_run_patience_validations_after_the_best(
    tmp_path, monkeypatch, capsys, selection_config
):
    # Controlled validation values: the best is step 2; steps 3 and 4 do not beat it, so patience 2 ends the
    # run at step 4 (of 10), and the best checkpoint (step 2) is what the test split reports.
    values = {1: 0.9, 2: 0.7, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.5}
    monkeypatch.setattr(selection_mod, "selection_value", lambda ev, task: values[ev.step])
    cfg = selection_config(tmp_path, "train.steps=10", "train.valid_every=1", "train.early_stop_patience=2")
    res = Trainer(cfg).fit()
    assert res.status == "completed" and res.early_stopped
    assert res.step == 4 and res.best_step == 2 and len(res.losses) == 4
    assert res.final_eval.step == 4 and res.best_eval.step == 2
    assert "early stop at step 4 of 10" in capsys.readouterr().err
    assert [r["step"] for r in _rows(res.run_dir, "valid")] == [1, 2, 3, 4]
    assert _rows(res.run_dir, "early_stop")[0]["best_step"] == 2
    summary = json.loads((res.run_dir / "eval.json").read_text())
    assert summary["early_stop"] == {
        "patience": 2, "stopped": True, "step": 4, "max_steps": 10, "best_step": 2,
    }  # fmt: skip
    assert summary["best"]["step"] == 2 and summary["step"] == 4


def test_early_stopping_counts_validations_not_steps_and_is_on_by_default(
    tmp_path, monkeypatch, selection_config
):
    # valid_every=2: validations at steps 2, 4, 6, 8; best at 2, so patience 2 stops at step 6.
    values = {2: 0.7, 4: 0.8, 6: 0.9, 8: 0.6}
    monkeypatch.setattr(selection_mod, "selection_value", lambda ev, task: values[ev.step])
    res = Trainer(
        selection_config(
            tmp_path / "a", "train.steps=8", "train.valid_every=2", "train.early_stop_patience=2"
        )
    ).fit()
    assert res.early_stopped and res.step == 6 and res.best_step == 2
    # A new best resets the count: patience 3 reaches step 8, whose value is the new best.
    res = Trainer(
        selection_config(
            tmp_path / "b", "train.steps=8", "train.valid_every=2", "train.early_stop_patience=3"
        )
    ).fit()
    assert not res.early_stopped and res.step == 8 and res.best_step == 8
    # On by default with patience 3 (the same run as above); 0 turns it off: the run goes to train.steps
    # whatever the validation does.
    cfg = selection_config(tmp_path / "c", "train.steps=8", "train.valid_every=2")
    assert cfg.train.early_stop_patience == 3
    cfg.train.early_stop_patience = 0
    res = Trainer(cfg).fit()
    assert not res.early_stopped and res.step == 8
    assert "early_stop" not in json.loads((res.run_dir / "eval.json").read_text())


def test_early_stopping_survives_a_resume(tmp_path, monkeypatch, selection_config):
    # Stopped after step 3 (best 2, one validation without improvement), resumed: one more is enough.
    values = {1: 0.9, 2: 0.7, 3: 0.8, 4: 0.75, 5: 0.1}
    monkeypatch.setattr(selection_mod, "selection_value", lambda ev, task: values[ev.step])
    cfg = selection_config(tmp_path, "train.steps=10", "train.valid_every=1", "train.early_stop_patience=2")
    first = Trainer(cfg).fit(stop_after=3)
    assert first.status == "stopped" and first.step == 3
    res = Trainer(cfg, resume=first.last_checkpoint).fit()
    assert res.early_stopped and res.step == 4 and res.best_step == 2


def test_early_stopping_without_periodic_validation_never_stops_a_run(
    tmp_path, monkeypatch, selection_config
):
    # valid_every = 0 validates only at the last step, and without a validation split nothing is validated:
    # the default patience is then moot, not an error.
    values = {4: 0.9}
    monkeypatch.setattr(selection_mod, "selection_value", lambda ev, task: values[ev.step])
    for extra in ("train.valid_every=0", "data.synthetic.valid_examples=0"):
        res = Trainer(selection_config(tmp_path, "train.steps=4", "train.early_stop_patience=1", extra)).fit()
        assert not res.early_stopped and res.step == 4
        assert [r["step"] for r in _rows(res.run_dir, "valid")] == ([4] if "every" in extra else [])
