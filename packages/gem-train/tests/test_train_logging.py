"""Run directory, metrics.jsonl + TensorBoard, PNG plots."""

import datetime as dt
import math

import numpy as np

from gem_train.evaluation.plots import plot_curves, plot_reliability
from gem_train.loop.metrics_log import MetricsLogger, read_metrics, truncate_metrics
from gem_train.loop.run_dir import create_run_dir


def test_run_dir_layout_and_unique_names(tmp_path):
    now = dt.datetime(2026, 12, 2, 10, 0, 0, tzinfo=dt.UTC)
    a = create_run_dir(tmp_path, "x", now)
    b = create_run_dir(tmp_path, "x", now)
    assert a.root.name == "x-20261202-100000" and b.root.name == "x-20261202-100000-1"
    for d in (a.tensorboard, a.checkpoints, a.plots):
        assert d.is_dir()


def test_metrics_jsonl_tensorboard_and_plots(tmp_path):
    run = create_run_dir(tmp_path, "r")
    log = MetricsLogger(run.metrics, run.tensorboard)
    for s in (10, 20, 30):
        log.log(s, "train", {"loss": 1.0 / s, "ctr/ne": 0.9, "mfu": float("nan")})
    log.log(30, "eval", {"ctr/ne": 0.8, "ctr/auc": 0.7})
    log.close()
    rows = read_metrics(run.metrics)
    assert [r["step"] for r in rows] == [10, 20, 30, 30]
    assert rows[0]["loss"] == 0.1 and math.isnan(rows[0]["mfu"])
    assert any(p.name.startswith("events.out.tfevents") for p in run.tensorboard.iterdir())

    truncate_metrics(run.metrics, 20)
    assert [r["step"] for r in read_metrics(run.metrics)] == [10, 20]

    written = plot_curves(rows, run.plots, ("ctr",))
    rng = np.random.default_rng(0)
    p = rng.uniform(size=500)
    y = (rng.uniform(size=500) < p).astype(float)
    written.append(plot_reliability({"ctr": (p, y)}, run.plots / "reliability.png"))
    for f in written:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "m.jsonl", tmp_path / "tb", enabled=False)
    log.log(1, "train", {"loss": 1.0})
    log.close()
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "tb").exists()
