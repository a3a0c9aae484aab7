"""Own data, safely (issue 34): a validation split by default (the latest training rows by time for Parquet),
validation and early stopping on, a best checkpoint always, ``train.epochs`` and the passes in the log."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gem_train.cli import main
from gem_train.config import ConfigError, ParquetConfig, config_from_dict, load_config
from gem_train.data.loader import make_eval_loader, make_train_loader
from gem_train.data.parquet.errors import ParquetDataError
from gem_train.data.parquet.reader import ParquetSource
from gem_train.loop.metrics_log import read_metrics
from gem_train.loop.schedule import resolve_schedule

sys.path.insert(0, str(Path(__file__).parent))
from own_data_table import ads_section, ads_toml, write_ads_table

SMALL_GEM = ["model.overrides.n_layers=1", 'model.overrides.attention="full"', "train.progress_bar=false"]


def _source(root: Path, **over) -> ParquetSource:
    return ParquetSource(config_from_dict(ParquetConfig, ads_section(root, **over)), seed=0)


def _times(loader) -> list[int]:
    return [t for lb in loader for t in lb.batch.request_time.tolist()]


def _two_files(tmp_path: Path) -> np.ndarray:
    """277 training rows in two files of several row groups, times shuffled; returns the times."""
    a = write_ads_table(tmp_path / "train" / "a.parquet", 200, shuffle_time=True, row_group=30)
    b = write_ads_table(tmp_path / "train" / "b.parquet", 77, start=200, shuffle_time=True, row_group=25)
    write_ads_table(tmp_path / "test" / "t.parquet", 50, start=1000)
    return np.concatenate([a, b])


@pytest.mark.parametrize("shuffle", ["buffer", "global", "none"])
def test_validation_split_is_the_latest_rows_by_request_time_in_every_shuffle_mode(tmp_path, shuffle):
    ts = _two_files(tmp_path)
    src = _source(tmp_path, valid_fraction=0.2, shuffle=shuffle, shuffle_buffer=50)
    n_valid = round(0.2 * 277)  # 55
    latest = set(np.sort(ts)[-n_valid:].tolist())
    assert src.rows("valid") == n_valid and src.rows("train") == 277 - n_valid
    assert set(_times(make_eval_loader(src, 16, split="valid"))) == latest
    # One epoch of the training stream (222 = 6 x 37 rows): every other row, exactly once.
    train = _times(x for _, x in zip(range(6), make_train_loader(src, 37), strict=False))
    assert sorted(train) == sorted(set(ts.tolist()) - latest)
    assert (
        f"{n_valid} of the 277 training rows" in src.valid_note
        and "request_time column 'ts'" in src.valid_note
    )
    assert "(2023-11-15 01:55:20 UTC)" in src.valid_note  # the cut as a date too


def test_without_request_time_the_latest_history_event_orders_and_without_time_file_order(tmp_path):
    _two_files(tmp_path)
    table = pa.concat_tables([pq.read_table(tmp_path / "train" / f) for f in ("a.parquet", "b.parquet")])
    last = np.array([max(h) if h else 0 for h in table.column("hist_ts").to_pylist()])
    src = _source(tmp_path, valid_fraction=0.1, request_time="")
    n_valid = round(0.1 * 277)
    # The batches' request time is the row's latest event (as the converter makes it).
    got = sorted(_times(make_eval_loader(src, 16, split="valid")))
    assert got == sorted(last[np.argsort(last, kind="stable")[-n_valid:]].tolist())
    assert "latest history timestamp ('hist_ts')" in src.valid_note
    seq = dict(ads_section(tmp_path)["sequences"]["history"], timestamps="")
    src = _source(tmp_path, valid_fraction=0.1, request_time="", sequences={"history": seq})
    assert "file order" in src.valid_note
    # No time at all: the last rows of the last file (77 rows) are the validation split.
    users = table.column("user_id").to_numpy()[-n_valid:]
    got_users = [
        u for lb in make_eval_loader(src, 8, split="valid") for u in lb.batch.sparse["user_id"].values()
    ]
    assert [int(u) for u in got_users] == users.tolist()


def test_row_groups_without_a_kept_row_are_dropped_and_errors_name_the_files_row(tmp_path):
    ts = write_ads_table(tmp_path / "train" / "a.parquet", 100, row_group=20)  # time order: the last group
    write_ads_table(tmp_path / "test" / "t.parquet", 20, start=500)
    src = _source(tmp_path, valid_fraction=0.2)
    assert len(src.files["valid"].group_rows) == 1 and len(src.files["train"].group_rows) == 4
    assert src.rows("valid") == 20 and set(_times(make_eval_loader(src, 8, split="valid"))) == set(ts[80:])
    # A bad row among the training rows of a file whose rows are split: the error names its place in the
    # file (row group 2, row 7), not its place in the split.
    ts = write_ads_table(tmp_path / "train" / "a.parquet", 100, row_group=50, shuffle_time=True)
    table = pq.read_table(tmp_path / "train" / "a.parquet")
    order = np.argsort(ts, kind="stable")
    bad = int(order[0])  # the earliest row: a training row
    users = table.column("user_id").to_numpy().copy()
    users[bad] = 999
    table = table.set_column(0, "user_id", pa.array(users, pa.int64()))
    pq.write_table(table, tmp_path / "train" / "a.parquet", row_group_size=50)
    src = _source(tmp_path, valid_fraction=0.3, shuffle="none")
    with pytest.raises(ParquetDataError, match=f"row group {bad // 50}, row {bad % 50}: sparse feature"):
        next(iter(make_train_loader(src, 70)))


class _Rows:
    """A finite source for the schedule: ``rows`` training rows, a validation split or none."""

    def __init__(self, rows: int, valid: bool = True) -> None:
        self.rows_, self.valid = rows, valid

    def rows(self, split):
        return self.rows_

    def num_batches(self, split, b):
        return max(1, self.rows_ // b) if split == "train" else (1 if self.valid else 0)

    valid_note = "validation split: test"


def test_schedule_epochs_auto_validation_and_its_errors():
    cfg = load_config("movielens-parquet", ["data.batch_size=64", "train.epochs=2.5"])
    s = resolve_schedule(cfg, _Rows(1000), world_size=2)
    assert s.steps == 19  # ceil(2.5 x 15 batches / 2 ranks)
    assert s.describe() == "19 steps = 2.43 passes over 1,000 training rows (64 per step x 2 ranks)"
    cfg = load_config("movielens-parquet", ["train.steps=95", "train.valid_every=auto"])
    assert resolve_schedule(cfg, _Rows(100_000), 1).valid_every == 10  # ceil(95 / 10): ~10 validations
    assert resolve_schedule(cfg, _Rows(1000), 1).valid_every == 3  # and at least once per pass (3 batches)
    cfg.train.valid_every = 0
    s = resolve_schedule(cfg, _Rows(1000), 1)
    assert s.valid_every == 95 and s.describe_validation().startswith("validation at the last step")
    s = resolve_schedule(cfg, _Rows(1000, valid=False), 1)
    assert not s.validates and s.early_stop_patience == 0
    cfg.train.valid_every = 5
    with pytest.raises(ConfigError, match=r"train\.valid_every = 5 needs a validation split"):
        resolve_schedule(cfg, _Rows(1000, valid=False), 1)
    cfg = load_config("tiny-cpu", ["train.epochs=1"])
    with pytest.raises(ConfigError, match=r"train\.epochs = 1 needs a finite training set"):
        resolve_schedule(cfg, None, 1)
    cfg = load_config("tiny-cpu", ["train.epochs=1", "data.synthetic.train_examples_per_epoch=2560"])
    from gem_train.data.synthetic import SyntheticAds

    assert resolve_schedule(cfg, SyntheticAds(cfg.data.synthetic), 1).steps == 10


def _run_dir(err: str) -> Path:
    return Path(err.split("gem-train: run directory ", 1)[1].splitlines()[0])


def test_new_user_scenario_pyarrow_table_default_config_best_checkpoint_eval(tmp_path, capsys):
    """The README's path: a table written with pyarrow, a config without valid files or any [train] key,
    train, then ``eval --checkpoint <run>/checkpoints/best`` works; resuming on another data root is refused
    unless allowed by name."""
    write_ads_table(tmp_path / "data" / "train" / "part-0.parquet", 600)
    write_ads_table(tmp_path / "data" / "test" / "part-0.parquet", 200, start=5000)
    toml = tmp_path / "my-ads.toml"
    toml.write_text(ads_toml(tmp_path / "data"))
    argv = ["train", "--config", str(toml), f"run.out_dir={tmp_path / 'runs'}", "train.epochs=2", *SMALL_GEM]
    assert main(argv) == 0
    err = capsys.readouterr().err
    # data.parquet.valid_fraction = 0.1 by default: 540 training rows, 8 batches of 64 per pass.
    assert "gem-train: 16 steps = 1.90 passes over 540 training rows (64 per step x 1 rank)" in err
    assert "validation split: 60 of the 600 training rows" in err
    assert "validation every 2 steps and at the last step" in err
    run = _run_dir(err)
    best = run / "checkpoints" / "best"
    assert best.exists()
    summary = json.loads((run / "eval.json").read_text())
    assert summary["best"]["step"] > 0 and summary["schedule"]["passes"] == pytest.approx(16 * 64 / 540)
    assert {p.name for p in (run / "plots").iterdir()} >= {"loss.png", "ne.png", "reliability.png"}
    valid_steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["split"] == "valid"]
    assert valid_steps == list(range(2, 17, 2)) or summary.get("early_stop", {}).get("stopped")
    assert main(["eval", "--checkpoint", str(best)]) == 0
    out = capsys.readouterr().out
    best_step = summary["best"]["step"]
    assert re.search(rf"checkpoint \S+ \(step {best_step}\), test split:", out), out
    assert main(["eval", "--checkpoint", str(best), "--split", "valid"]) == 0
    capsys.readouterr()
    # The same table under another root: a resume there is refused (exit 2), naming the key and both values;
    # named with --allow-change it continues the run.
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "data", other)
    resume = ["train", "--resume", str(run), f"data.parquet.root={other}", "train.epochs=3"]
    written = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert main(resume) == 2
    err = capsys.readouterr().err
    assert "data.parquet.root" in err and str(tmp_path / "data") in err and str(other) in err, err
    assert "(--allow-change data.parquet.root)" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == written  # nothing written
    assert main([*resume[:3], "--allow-change", "data.parquet.root", *resume[3:]]) == 0
    err = capsys.readouterr().err
    assert f"gem-train: resuming {run.name} from step " in err, err
    assert "allowed (--allow-change): data.parquet.root" in err, err


def test_a_validation_split_set_to_zero_warns_and_writes_no_best(tmp_path, capsys, small_config):
    from gem_train.loop.trainer import Trainer

    cfg = small_config(tmp_path, "train.steps=4", "data.synthetic.valid_examples=0")
    res = Trainer(cfg).fit()
    err = capsys.readouterr().err
    assert "no validation split (data.synthetic.valid_examples = 0)" in err
    assert "warning: no validation split: no model selection happens, no checkpoints/best" in err
    assert res.best_checkpoint is None and not (res.run_dir / "checkpoints" / "best").exists()
    assert "best" not in json.loads((res.run_dir / "eval.json").read_text())


def test_every_run_validates_at_its_end_also_with_valid_every_0(tmp_path, small_config):
    from gem_train.loop.trainer import Trainer

    for every, expected in (("0", [3]), ("auto", [1, 2, 3])):
        cfg = small_config(
            tmp_path, "train.steps=3", f"train.valid_every={every}", "train.early_stop_patience=0"
        )
        res = Trainer(cfg).fit()
        rows = read_metrics(res.run_dir / "metrics.jsonl")
        assert [r["step"] for r in rows if r["split"] == "valid"] == expected
        assert (res.run_dir / "checkpoints" / "best").exists()
        # config.toml keeps what the user wrote; the loop ran by the resolved schedule.
        written = "valid_every = 0" if every == "0" else 'valid_every = "auto"'
        assert written in (res.run_dir / "config.toml").read_text()
