"""Resume that cannot mix runs (issue 34): the run records its data's identity and every setting; a resume
that changes the data or a setting that changes the run's meaning is refused (exit 2) unless named with
``--allow-change``; every resume says what it resumes and what changed; the config history is appended."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gem_train.checkpoint import CheckpointError, list_checkpoints, read_trainer_state
from gem_train.cli import main
from gem_train.config import ConfigError, dumps_toml
from gem_train.data.identity import DataDifference, identity_differences
from gem_train.data.parquet.identity import footer_digest
from gem_train.loop.resume_check import NO_EFFECT, covers
from gem_train.loop.run_dir import pick_latest
from gem_train.loop.run_history import HISTORY_FILE, append_history, read_history
from gem_train.loop.trainer import Trainer

# ----------------------------------------------------------------------------------------------------------
# A table written with pyarrow, as a user would, and a config of it
# ----------------------------------------------------------------------------------------------------------


def write_ads(path: Path, n: int, seed: int) -> None:
    """``n`` rows: two dense floats, a user id, a ragged history (lengths 0..6) and a click."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 7, n)
    pq.write_table(
        pa.table({
            "age": pa.array(rng.normal(size=n), pa.float32()),
            "price": pa.array(rng.normal(size=n), pa.float32()),
            "user": pa.array(rng.integers(0, 40, n), pa.int64()),
            "items": pa.array([rng.integers(0, 60, k).tolist() for k in lengths], pa.list_(pa.int64())),
            "click": pa.array(rng.integers(0, 2, n), pa.int8()),
        }),
        path,
        row_group_size=64,
    )  # fmt: skip


def make_table(root: Path, seed: int = 0) -> Path:
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    write_ads(root / "train" / "a.parquet", 160, seed)
    write_ads(root / "test" / "t.parquet", 48, seed + 100)
    return root


def write_config(path: Path, root: Path, out: Path) -> Path:
    cfg = {
        "run": {"name": "my-ads", "out_dir": str(out), "device": "cpu"},
        "model": {"name": "tiny", "overrides": {"n_layers": 1, "attention": "full"}},
        "data": {
            "source": "parquet", "batch_size": 16, "eval_batch_size": 32,
            "parquet": {
                "root": str(root), "train": ["train/*.parquet"], "test": ["test/*.parquet"],
                "dense": {"columns": ["age", "price"]},
                "sparse": {"user": {"num_embeddings": 40}},
                "sequences": {"history": {"items": "items", "num_items": 60, "max_len": 8}},
                "labels": {"ctr": "click"},
            },
        },
        "optim": {"warmup_steps": 1},
        "train": {"steps": 2, "log_every": 1, "progress_bar": False, "autocast": "none"},
    }  # fmt: skip
    path.write_text(dumps_toml(cfg))
    return path


def _history(run: Path) -> list[dict]:
    return read_history(run)


# ----------------------------------------------------------------------------------------------------------
# The user's story: another data root, files rewritten in place
# ----------------------------------------------------------------------------------------------------------


def test_resume_on_other_data_is_refused_unless_allowed_and_the_history_keeps_both(tmp_path, capsys):
    a = make_table(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)  # the same rows, other files
    out = tmp_path / "runs"
    cfg = write_config(tmp_path / "my-ads.toml", a, out)
    assert main(["train", "--config", str(cfg)]) == 0
    (run,) = out.iterdir()
    first_config = (run / "config.toml").read_bytes()
    state = read_trainer_state(list_checkpoints(run / "checkpoints")[-1])
    ident = state["data_identity"]
    assert ident["source"] == "parquet" and state["config"]["data"]["parquet"]["root"] == str(a)
    (entry,) = ident["content"]["splits"]["train"]["files"]
    assert entry["path"] == str((a / "train" / "a.parquet").resolve()) and entry["rows"] == 160
    assert (entry["size"], entry["footer_sha256"]) == footer_digest(a / "train" / "a.parquet")
    assert ident["settings"]["columns"]["items"] == "list<element: int64>"
    capsys.readouterr()

    # Another root: refused, exit 2, naming the key, both values and what differs in the files; nothing
    # is written (no history entry, no checkpoint, the same config.toml).
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert main(["train", "--resume", str(run), f"data.parquet.root={b}", "train.steps=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gem-train: config error: cannot resume ") and "from step 2" in err
    assert f'data.parquet.root: "{a}" -> "{b}"' in err
    assert "data.parquet.train: files differ: no longer read: " in err and str(b / "train") in err
    assert "(--allow-change data.parquet.root)" in err  # the root explains the files
    assert len(_history(run)) == 1 and (run / "config.toml").read_bytes() == first_config
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before

    # --resume latest with --config: the same comparison, and which run it picked.
    args = ["--config", str(cfg), f"data.parquet.root={b}", "train.steps=3"]
    assert main(["train", "--resume", "latest", *args]) == 2
    err = capsys.readouterr().err
    assert f"--resume latest: {run.name} is the newest run named 'my-ads' under {out}" in err
    assert f'data.parquet.root: "{a}" -> "{b}"' in err

    # Allowed by name: resumed, said on stderr (progress_bar = false), the history grows.
    assert main(["train", "--resume", "latest", "--allow-change", "data.parquet.root", *args]) == 0
    err = capsys.readouterr().err
    ckpt = run / "checkpoints" / "step_00000002"
    assert f"gem-train: resuming {run.name} from step 2 (checkpoint {ckpt})" in err
    assert f'allowed (--allow-change): data.parquet.root: "{a}" -> "{b}"' in err
    assert "allowed (--allow-change): data.parquet.train: files differ" in err
    assert "train.steps: 2 -> 3 (the run continues" in err
    start, resume = _history(run)
    assert start["event"] == "start" and start["config"]["data"]["parquet"]["root"] == str(a)
    assert (
        resume["event"] == "resume"
        and resume["step"] == 2
        and resume["allow_change"] == ["data.parquet.root"]
    )
    assert resume["allowed"] == [{"key": "data.parquet.root", "old": str(a), "new": str(b)}]
    assert resume["config"]["data"]["parquet"]["root"] == str(b) and "data_identity" in resume
    assert (run / "config.toml").read_bytes() == first_config  # the run's first config, kept
    new_state = read_trainer_state(list_checkpoints(run / "checkpoints")[-1])
    assert new_state["step"] == 3 and new_state["data_identity"]["settings"]["root"] == str(b.resolve())

    # The same config, a file rewritten in place (other rows): refused, naming the file.
    write_ads(b / "train" / "a.parquet", 170, seed=7)
    assert main(["train", "--resume", str(run), "train.steps=4"]) == 2
    err = capsys.readouterr().err
    rewritten = str((b / "train" / "a.parquet").resolve())
    assert f"data.parquet.train: files differ: rows 144 -> 153; rewritten: {rewritten} (size " in err
    assert "rows 160 -> 170, footer differs)" in err and "(--allow-change data.parquet.train)" in err
    assert len(_history(run)) == 2
    assert main(["train", "--resume", str(run), "--allow-change", "data.parquet.train", "train.steps=4"]) == 0
    err = capsys.readouterr().err
    assert "allowed (--allow-change): data.parquet.train: files differ: rows 144 -> 153" in err
    assert [e["step"] for e in _history(run)] == [0, 2, 3]


def test_a_new_validation_cut_is_refused_unless_valid_fraction_is_allowed(tmp_path, capsys):
    """With no valid files the validation split is cut from the training files (data.parquet.valid_fraction):
    another cut changes both splits' rows, one change of meaning that allowing valid_fraction accepts."""
    a = make_table(tmp_path / "a")
    out = tmp_path / "runs"
    assert main(["train", "--config", str(write_config(tmp_path / "my-ads.toml", a, out))]) == 0
    (run,) = out.iterdir()
    capsys.readouterr()
    argv = ["train", "--resume", str(run), "data.parquet.valid_fraction=0.2", "train.steps=3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "data.parquet.valid_fraction: 0.1 -> 0.2" in err
    assert "data.parquet.train: files differ: rows 144 -> 128" in err
    assert "data.parquet.valid: files differ: rows 16 -> 32" in err
    assert "(--allow-change data.parquet.valid_fraction)" in err  # the one flag that explains all three
    assert main([*argv[:3], "--allow-change", "data.parquet.valid_fraction", *argv[3:]]) == 0
    err = capsys.readouterr().err
    assert "allowed (--allow-change): data.parquet.train: files differ: rows 144 -> 128" in err
    assert read_trainer_state(list_checkpoints(run / "checkpoints")[-1])["step"] == 3


def test_cli_allow_change_needs_resume_and_a_real_key(tmp_path, capsys, small_overrides):
    assert main(["train", "--allow-change", "optim.lr", *small_overrides]) == 2
    assert "--allow-change names what a resume may change: it needs --resume" in capsys.readouterr().err
    out = [*small_overrides, "train.steps=1", "checkpoint.keep_last=1", f"run.out_dir={tmp_path}"]
    assert main(["train", *out]) == 0
    (run,) = tmp_path.iterdir()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--allow-change", "optim.learning_rate"]) == 2
    assert "--allow-change optim.learning_rate: no such setting" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# Settings: which changes are refused, allowed, continued, or of no effect
# ----------------------------------------------------------------------------------------------------------


def test_a_changed_setting_is_refused_and_a_longer_run_is_not(tmp_path, small_config, capsys):
    first = Trainer(small_config(tmp_path, "train.steps=2")).fit()
    ckpt = first.last_checkpoint
    with pytest.raises(ConfigError, match=r"1 difference\(s\)[^\n]*\n  optim.lr: 0.002 -> 0.01\n"):
        Trainer(small_config(tmp_path, "train.steps=3", "optim.lr=0.01"), resume=ckpt)
    # A changed architecture: refused by name; allowed, the checkpoint still does not load into it.
    with pytest.raises(ConfigError, match=r"model.overrides.n_layers: 1 -> 2"):
        Trainer(small_config(tmp_path, "model.overrides.n_layers=2"), resume=ckpt)
    with pytest.raises(CheckpointError, match=r"cannot load checkpoint .* into this model"):
        Trainer(small_config(tmp_path, "model.overrides.n_layers=2"), resume=ckpt, allow_changes=["model"])
    assert len(read_history(first.run_dir)) == 1  # refusals wrote nothing
    capsys.readouterr()

    # A longer run, other logging and checkpointing, and an allowed optimizer change that takes effect
    # (the checkpoint's hyper-parameters would otherwise be restored).
    cfg = small_config(
        tmp_path, "train.steps=3", "train.log_every=1", "checkpoint.keep_last=5", "optim.weight_decay=0.5"
    )
    tr = Trainer(cfg, resume=ckpt, allow_changes=["optim.weight_decay", "optim.eps"])
    err = capsys.readouterr().err
    assert f"gem-train: resuming {first.run_dir.name} from step 2 (checkpoint {ckpt})" in err
    assert "  train.steps: 2 -> 3 (the run continues to its new length" in err
    assert "  allowed (--allow-change): optim.weight_decay: 0.01 -> 0.5" in err
    assert "without effect on the run's meaning: checkpoint.keep_last: 2 -> 5; train.log_every: 2 -> 1" in err
    assert "--allow-change optim.eps: nothing under it changed" in err
    assert tr.optimizers[0].param_groups[0]["weight_decay"] == 0.5
    assert tr.optimizers[0].param_groups[1]["weight_decay"] == 0.0  # the no-decay group stays so
    assert tr.fit().status == "completed"
    entry = read_history(first.run_dir)[-1]
    assert entry["continues"] == [{"key": "train.steps", "old": 2, "new": 3}]
    assert entry["allowed"] == [{"key": "optim.weight_decay", "old": 0.01, "new": 0.5}]
    assert {c["key"] for c in entry["no_effect"]} == {"checkpoint.keep_last", "train.log_every"}
    assert "data_identity" not in entry  # unchanged: its digest only
    assert entry["data_identity_sha256"] == read_history(first.run_dir)[0]["data_identity_sha256"]


def test_resume_latest_says_which_run_and_why(tmp_path, small_config, capsys):
    first = Trainer(small_config(tmp_path, "train.steps=1")).fit()
    older = tmp_path / "tiny-cpu-20000101-000000"  # an older run of the name, with no checkpoint
    newer = tmp_path / "tiny-cpu-20991231-000000"  # a newer one, crashed before its first checkpoint
    for d in (older, newer):
        (d / "checkpoints").mkdir(parents=True)
    (tmp_path / "tiny-cpu-baseline-20991231-000001" / "checkpoints").mkdir(parents=True)  # another name
    ckpt, note = pick_latest("tiny-cpu", tmp_path)
    assert ckpt == first.last_checkpoint
    assert note == (
        f"--resume latest: {first.run_dir.name} is the newest run named 'tiny-cpu' under {tmp_path} with a "
        f"complete checkpoint ({ckpt.name}); 2 other run(s) of that name, 1 newer without one"
    )
    capsys.readouterr()
    Trainer(small_config(tmp_path, "train.steps=2"), resume="latest")
    err = capsys.readouterr().err
    resuming = f"gem-train: resuming {first.run_dir.name} from step 1"
    assert err.index(f"gem-train: {note}") < err.index(resuming)


def test_check_resume_prefixes_suggestions_and_an_old_checkpoint(small_config, tmp_path):
    """The comparison alone (no training): a prefix allows its subkeys, the refusal suggests the fewest
    flags, and a checkpoint without a data identity (an older gem-train) is said, not refused."""
    from gem_train.config import config_to_dict
    from gem_train.loop.resume_check import check_resume

    old = small_config(tmp_path)
    ident = {"source": "synthetic", "settings": {}, "content": {}}
    state = {"step": 7, "config": config_to_dict(old), "data_identity": ident}
    ckpt = tmp_path / "r-20260101-000000" / "checkpoints" / "step_00000007"
    new = small_config(tmp_path, "optim.lr=0.5", "optim.weight_decay=0.5", "run.seed=3", "data.num_workers=2")
    with pytest.raises(ConfigError) as e:
        check_resume(state, new, ident, ["optim.lr"], ckpt)
    msg = str(e.value)
    assert msg.startswith("cannot resume r-20260101-000000 from step 7 (") and "2 difference(s)" in msg
    assert "\n  optim.weight_decay: 0.01 -> 0.5\n  run.seed: 0 -> 3\n" in msg and "optim.lr:" not in msg
    assert "(--allow-change optim.weight_decay --allow-change run.seed)" in msg
    plan = check_resume(state, new, ident, ["optim", "run.seed"], ckpt)
    assert [c.key for c in plan.allowed] == ["optim.lr", "optim.weight_decay", "run.seed"]
    assert [c.key for c in plan.no_effect] == ["data.num_workers"] and plan.changes_optimizer
    plan = check_resume({"step": 7, "config": config_to_dict(old)}, old, ident, [], ckpt)
    assert "records no data identity" in plan.message() and not plan.allowed
    # A data difference explained by an allowed change of what locates the data; else refused by its key.
    other = {"source": "movielens-100k", "settings": {}, "content": {}}
    ml = small_config(tmp_path, "data.source=movielens-100k")
    with pytest.raises(ConfigError, match=r"data.source: \"synthetic\" -> \"movielens-100k\""):
        check_resume(state, ml, other, [], ckpt)
    assert [d.key for d in check_resume(state, ml, other, ["data.source"], ckpt).data_allowed] == [
        "data.source"
    ]


def test_no_effect_keys_name_real_settings(small_config, tmp_path):
    """Every key of the no-effect table is a setting of the config (a renamed key would silently turn into
    one that needs allowing)."""
    from gem_train.config import config_to_dict
    from gem_train.loop.resume_check import flatten

    keys = set(flatten(config_to_dict(small_config(tmp_path))))
    for prefix in NO_EFFECT:
        assert any(covers(prefix, k) for k in keys), prefix


# ----------------------------------------------------------------------------------------------------------
# The identity records and the history file
# ----------------------------------------------------------------------------------------------------------


def test_the_footer_digest_is_the_footer_pyarrow_wrote(tmp_path):
    path = tmp_path / "x.parquet"
    write_ads(path, 100, seed=1)
    size, digest = footer_digest(path)
    raw = path.read_bytes()
    n = pq.ParquetFile(path).metadata.serialized_size  # the Thrift FileMetaData's length
    assert size == len(raw) and raw[-4:] == b"PAR1" and int.from_bytes(raw[-8:-4], "little") == n
    assert digest == hashlib.sha256(raw[-8 - n : -8]).hexdigest()
    write_ads(path, 100, seed=2)  # the same shape, other values: other statistics in the footer
    assert footer_digest(path)[1] != digest
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="not a Parquet file"):
        footer_digest(path)


def test_identity_differences_of_the_built_in_sources():
    rows = {"train": 9}
    ml = {"source": "movielens-100k", "settings": {}, "content": {"events_sha256": "aa", "rows": rows}}
    other = {**ml, "content": {"events_sha256": "bb", "rows": rows}}
    assert identity_differences(ml, ml) == []
    (d,) = identity_differences(ml, other)
    locators = ("data.source", "data.movielens")
    assert d == DataDifference("data.movielens", 'events_sha256 "aa" -> "bb"', locators)
    syn = {"source": "synthetic", "settings": {"seed": 0}, "content": {}}
    assert identity_differences(syn, {**syn, "settings": {"seed": 1}}) == []  # the config comparison's job
    (d,) = identity_differences(syn, ml)
    assert d.key == "data.source" and d.detail == 'the data source "synthetic" -> "movielens-100k"'


def test_movielens_identity_is_its_events(tmp_path):
    from gem_train.config import MovieLensConfig
    from gem_train.data.movielens import MovieLens100K, read_movielens_100k

    (tmp_path / "ml-100k.user").write_text(
        "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n1\t24\tM\tx\t85711\n"
    )
    (tmp_path / "ml-100k.item").write_text(
        "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n1\tA\t1995\tDrama\n"
        "2\tB\t1990\tAction\n"
    )
    inter = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    rows = [f"1\t{1 + k % 2}\t{1 + k % 5}\t{10 * k}\n" for k in range(8)]
    (tmp_path / "ml-100k.inter").write_text(inter + "".join(rows))
    cfg = MovieLensConfig(valid_fraction=0.0)
    one = MovieLens100K(cfg, events=read_movielens_100k(tmp_path)).data_identity()
    assert one == MovieLens100K(cfg, events=read_movielens_100k(tmp_path)).data_identity()  # stable
    assert one["content"]["files"] is None and one["content"]["rows"] == {"train": 7, "valid": 0, "test": 1}
    rows[3] = "1\t2\t5\t30\n"  # one rating changed
    (tmp_path / "ml-100k.inter").write_text(inter + "".join(rows))
    other = MovieLens100K(cfg, events=read_movielens_100k(tmp_path)).data_identity()
    (d,) = identity_differences(one, other)
    assert d.key == "data.movielens" and d.detail.startswith("events_sha256 ")


def test_the_history_is_appended_whole_lines_after_a_torn_one(tmp_path):
    append_history(tmp_path, {"event": "start", "step": 0})
    with open(tmp_path / HISTORY_FILE, "ab") as f:
        f.write(b'{"event": "resume", "st')  # a crash in the middle of an append
    append_history(tmp_path, {"event": "resume", "step": 5})
    assert read_history(tmp_path) == [{"event": "start", "step": 0}, {"event": "resume", "step": 5}]
    lines = (tmp_path / HISTORY_FILE).read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2]) == {"event": "resume", "step": 5}
