"""``gem-train predict`` (issue 36): every row exactly once with its keys, the model's own outputs and
representation, atomic shards, cheap reruns, torchrun with an odd row count, Parquet keys, MovieLens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from gem_train.cli import main
from gem_train.config import ConfigError
from gem_train.transfer import prediction_files
from gem_train.transfer.errors import TransferDataError
from gem_train.transfer.predict import run_predict
from gem_train.transfer.prediction_files import PredictionFilesError, read_manifest

sys.path.insert(0, str(Path(__file__).parent))
from transfer_fixtures import SMALL, read_split, small_config, train_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return train_checkpoint(tmp_path_factory.mktemp("teacher"))


def _cfg(tmp_path: Path):
    return small_config(tmp_path / "runs")


def test_every_row_once_with_keys_probs_logits_and_the_models_outputs(ckpt, tmp_path):
    from gem_train.checkpoint import load_checkpoint
    from gem_train.loop.build import build_run

    cfg = _cfg(tmp_path)
    # 20 rows per shard: several shards per split, the last ones short.
    res = run_predict(cfg, ckpt, tmp_path / "p", embeddings=True, train_batches=3, shard_rows=20,
                      progress=False)  # fmt: skip
    assert res.rows == {"train": 48, "valid": 41, "test": 75}
    assert res.predicted_rows == 48 + 41 + 75
    m = read_manifest(tmp_path / "p")
    assert m["key_columns"] == ["split", "row"] and m["tasks"] == ["ctr", "cvr"]
    assert len(m["splits"]["test"]["shards"]) == 3  # 75 rows in batches of 32, K = 1 batch per shard

    run = build_run(cfg, training=False)
    load_checkpoint(ckpt, run.model, None, restore_rng=False)
    model = run.model.eval()
    head_inputs = []
    first_head = next(iter(model.heads.values()))
    first_head.register_forward_pre_hook(lambda mod, args: head_inputs.append(args[0].detach()))
    for split, bs in (("train", 16), ("valid", 32), ("test", 32)):
        cols = read_split(tmp_path / "p", split)
        n = res.rows[split]
        assert list(cols["split"]) == [split] * n
        np.testing.assert_array_equal(cols["row"], np.arange(n))  # every row exactly once, in order
        for j in range(-(-n // bs)):
            lb = run.source.get(split, j, bs)
            head_inputs.clear()
            with torch.no_grad():
                out = model(lb.batch)
            rows = slice(j * bs, j * bs + lb.batch.batch_size)
            np.testing.assert_array_equal(cols["user_id"][rows], lb.batch.sparse["user_id"].values().numpy())
            np.testing.assert_array_equal(cols["ad_id"][rows], lb.batch.sparse["ad_id"].values().numpy())
            for t in ("ctr", "cvr"):
                # Predict forwards whole shards at once: other GEMM shapes, fp32 rounding only.
                np.testing.assert_allclose(cols[f"{t}_logit"][rows], out[t].numpy(), rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(cols[f"{t}_prob"][rows], torch.sigmoid(out[t]).numpy(), atol=1e-6)
            np.testing.assert_allclose(cols["embedding"][rows], head_inputs[0].numpy(), rtol=1e-4, atol=1e-5)
    assert m["embedding"]["dim"] == head_inputs[0].shape[1] == 192  # tiny: (2 + 2 + 2) x 32
    stats = m["splits"]["train"]
    emb = read_split(tmp_path / "p", "train")["embedding"].astype(np.float64)
    np.testing.assert_allclose(stats["embedding_mean"], emb.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stats["embedding_std"], emb.std(0), rtol=1e-4, atol=1e-6)


def test_a_crash_leaves_no_whole_looking_shard_and_a_rerun_finishes_only_the_rest(
    ckpt, tmp_path, monkeypatch
):
    cfg = _cfg(tmp_path)
    out = tmp_path / "p"
    real_replace = os.replace
    calls = {"n": 0}

    def crash_on_third(src, dst):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed between the write and the rename")
        real_replace(src, dst)

    monkeypatch.setattr(prediction_files.os, "replace", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_predict(cfg, ckpt, out, ("test",), shard_rows=20, progress=False)
    monkeypatch.setattr(prediction_files.os, "replace", real_replace)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["test-00000.parquet", "test-00001.parquet"]  # the third's temporary was removed
    assert not (out / "manifest.json").exists()
    with pytest.raises(PredictionFilesError, match=r"no manifest\.json"):
        read_manifest(out)
    # A SIGKILL mid-write leaves a temporary file (no finally runs): never read, removed by the rerun.
    (out / ".tmp-test-00002.parquet.999").write_bytes(b"PAR1 half a file")
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("test-*.parquet")}
    res = run_predict(cfg, ckpt, out, ("test",), shard_rows=20, progress=False)
    assert res.rows == {"test": 75} and res.predicted_rows == 75 - 64  # only the missing shard
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("test-0000[01].parquet")} == before
    assert not list(out.glob(".tmp-*"))
    np.testing.assert_array_equal(read_split(out, "test")["row"], np.arange(75))
    # Once complete, a rerun predicts nothing.
    again = run_predict(cfg, ckpt, out, ("test",), shard_rows=20, progress=False)
    assert again.predicted_rows == 0 and again.rows == {"test": 75}


@pytest.mark.parametrize(
    ("num_batches", "shards", "batches_per_shard"),
    [(64, 8, 8), (1000, 16, 63), (5000, 79, 64), (3, 1, 8), (17, 3, 8)],
)
def test_a_split_is_cut_into_16_shards_of_8192_rows_or_more_whatever_the_world_size(
    tmp_path, num_batches, shards, batches_per_shard
):
    """Shards are the ranks' unit of work: a 65,536-row split in one 65,536-row shard left the second rank
    of a torchrun idle; shards of fewer than 8,192 rows would cost more in files than they share out.
    The layout depends on the split alone (reruns under another world size match)."""
    from types import SimpleNamespace

    from gem_train.transfer.predict import _plan_shards

    plan = SimpleNamespace(batch_size=1024, num_batches=num_batches)
    layouts = {}
    for world in (1, 2, 3):
        mine = [_plan_shards(tmp_path, {"test": plan}, 65_536, {}, r, world)[0] for r in range(world)]
        layouts[world] = sorted((s.index, s.lo, s.hi) for todo in mine for s in todo)
        if world == 2:
            assert [len(todo) for todo in mine] == [-(-shards // 2), shards // 2]
    assert layouts[1] == layouts[2] == layouts[3]
    assert len(layouts[1]) == shards
    assert layouts[1][0][1:] == (0, min(batches_per_shard, num_batches)) and layouts[1][-1][2] == num_batches
    assert all(hi - lo <= batches_per_shard for _, lo, hi in layouts[1])


def test_a_shard_of_another_run_is_refused(ckpt, tmp_path):
    out = tmp_path / "p"
    run_predict(_cfg(tmp_path), ckpt, out, ("test",), progress=False)
    other = small_config(tmp_path / "runs", "data.synthetic.drift=0.5")
    with pytest.raises(PredictionFilesError, match="belongs to another predict run"):
        run_predict(other, ckpt, out, ("test",), progress=False)
    manifest = out / "manifest.json"
    m = json.loads(manifest.read_text())
    m["splits"]["test"]["shards"][0]["bytes"] += 1
    manifest.write_text(json.dumps(m))
    with pytest.raises(PredictionFilesError, match="another size"):
        read_manifest(out)


def test_cli_errors_and_output(ckpt, tmp_path, capsys):
    assert main(["predict", "--checkpoint", str(ckpt), "--out", str(tmp_path / "p")]) == 2
    assert "--train-batches" in capsys.readouterr().err  # the endless synthetic training stream
    code = main(["predict", "--checkpoint", str(ckpt), "--out", str(tmp_path / "p"), "--split", "test",
                 "--no-progress"])  # fmt: skip
    assert code == 0 and "test 75 rows" in capsys.readouterr().out
    assert issubclass(PredictionFilesError, TransferDataError)


@pytest.mark.distributed
def test_torchrun_two_ranks_odd_rows_every_row_once(ckpt, tmp_path):
    out = tmp_path / "p"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "gem_train.cli", "predict", "--checkpoint", str(ckpt), "--out", str(out), "--embeddings",
        "--train-batches", "5", "--shard-rows", "16", "--no-progress", *SMALL,
        "data.synthetic.eval_examples=77", "data.synthetic.valid_examples=0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    m = read_manifest(out)
    assert {s: e["rows"] for s, e in m["splits"].items()} == {"train": 80, "test": 77}
    assert len(m["splits"]["test"]["shards"]) == 3  # 3 batches of 32: shards 0, 2 on rank 0, 1 on rank 1
    for split, n in (("train", 80), ("test", 77)):
        rows = read_split(out, split)["row"]
        assert sorted(rows.tolist()) == list(range(n))
    assert done.stdout.count("predictions of") == 1


def test_parquet_keys_are_written_and_join_back(tmp_path):
    from test_train_parquet import _parquet_run, write_table

    table = tmp_path / "t"
    ids = lambda n, first: pa.array([f"imp-{first + i}" for i in range(n)])
    write_table(table / "train" / "a.parquet", 53, seed=1, impression=ids(53, 0))
    write_table(table / "test" / "t.parquet", 37, seed=3, first_id=10_000, impression=ids(37, 10_000))
    cfg = _parquet_run(table, tmp_path / "runs", "train.steps=1", 'data.parquet.keys=["impression"]')
    from gem_train.loop.trainer import Trainer

    res = Trainer(cfg).fit()
    out = tmp_path / "p"
    pres = run_predict(cfg, res.last_checkpoint, out, progress=False, shard_rows=10)
    assert pres.rows == {"train": 53, "test": 37}
    for split, n, first in (("train", 53, 0), ("test", 37, 10_000)):
        cols = read_split(out, split)
        assert sorted(cols["impression"].tolist()) == sorted(f"imp-{first + i}" for i in range(n))
        # The dense feature's first column is the row id in the test table: the keys travelled with it.
        assert [int(k.split("-")[1]) for k in cols["impression"]] == list(range(first, first + n))
    no_keys = _parquet_run(table, tmp_path / "runs2", "train.steps=1")
    with pytest.raises(ConfigError, match=r"data\.parquet\.keys"):
        run_predict(no_keys, res.last_checkpoint, tmp_path / "q", progress=False)


def test_movielens_events_are_keys_and_cover_every_split(tmp_path):
    from gem_train.data.movielens import DataFetchError

    ml = ('data.source="movielens-100k"', "data.movielens.max_users=12", "data.movielens.max_len=16")
    cfg = small_config(tmp_path / "runs", *ml)
    try:
        ckpt = train_checkpoint(tmp_path / "runs", *ml, steps=1)
    except DataFetchError as e:
        pytest.skip(f"MovieLens-100K not available: {e}")
    from gem_train.loop.build import build_source

    ml = build_source(cfg)
    res = run_predict(cfg, ckpt, tmp_path / "p", progress=False)
    for split, rows in (("train", ml.train_rows), ("valid", ml.valid_rows), ("test", ml.eval_rows)):
        cols = read_split(tmp_path / "p", split)
        np.testing.assert_array_equal(np.sort(cols["event"]), np.sort(rows))
        np.testing.assert_array_equal(cols["user_id"], ml.ev.user[cols["event"]])
        np.testing.assert_array_equal(cols["ad_id"], ml.ev.item[cols["event"]])
        assert res.rows[split] == len(rows)


def test_compiled_predictions_equal_the_eager_ones(ckpt, tmp_path, monkeypatch):
    # `--compile` goes through gem_parallel.compile_layers, here with dynamo's "eager" backend (inductor's C++
    # build takes minutes on 2 cores; the benchmark measures it): the same rows, keys and logits (fp32).
    from torch._dynamo.utils import counters

    import gem_parallel

    real, calls = gem_parallel.compile_layers, []

    def compile_eager(model, **kwargs):
        calls.append(kwargs)
        return real(model, backend="eager")

    monkeypatch.setattr(gem_parallel, "compile_layers", compile_eager)
    cfg = _cfg(tmp_path)
    eager = run_predict(cfg, ckpt, tmp_path / "eager", ("test",), progress=False)
    frames = counters["frames"]["ok"]
    compiled = run_predict(cfg, ckpt, tmp_path / "compiled", ("test",), progress=False, compile=True)
    assert len(calls) == 1 and counters["frames"]["ok"] > frames  # the layers really went through dynamo
    assert compiled.rows == eager.rows == {"test": 75}
    a, b = read_split(tmp_path / "eager", "test"), read_split(tmp_path / "compiled", "test")
    np.testing.assert_array_equal(a["row"], b["row"])
    for t in ("ctr", "cvr"):
        np.testing.assert_allclose(b[f"{t}_logit"], a[f"{t}_logit"], rtol=1e-5, atol=1e-6)


def test_forwards_kept_in_flight_change_no_row(ckpt, tmp_path, monkeypatch):
    # On CUDA predict launches the next forward before reading the previous one's outputs; here the same
    # bookkeeping (rows filed late, a shard written once its last forward is read) runs on the CPU, two
    # forwards deep, across shards of 20 rows: the same rows, keys, logits and representations.
    from gem_train.transfer import predict

    cfg = _cfg(tmp_path)
    kwargs = {"embeddings": True, "train_batches": 3, "shard_rows": 20, "progress": False}
    now = run_predict(cfg, ckpt, tmp_path / "now", **kwargs)
    monkeypatch.setattr(predict, "forwards_in_flight", lambda device: 2)
    late = run_predict(cfg, ckpt, tmp_path / "late", **kwargs)
    assert late.rows == now.rows == {"train": 48, "valid": 41, "test": 75}
    assert late.predicted_rows == now.predicted_rows
    for split in ("train", "valid", "test"):
        a, b = read_split(tmp_path / "now", split), read_split(tmp_path / "late", split)
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(b[name], a[name], err_msg=f"{split} {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_predictions_equal_the_cpu_ones(ckpt, tmp_path):
    # The CUDA path keeps a forward in flight and reads its outputs from page-locked memory after an event:
    # every row once, keys intact, logits and representations as the CPU's (fp32; cuBLAS vs MKL rounding).
    kwargs = {"embeddings": True, "train_batches": 3, "shard_rows": 20, "progress": False}
    cpu = run_predict(_cfg(tmp_path), ckpt, tmp_path / "cpu", **kwargs)
    cfg = small_config(tmp_path / "runs", "run.device=cuda", "data.num_workers=2")
    gpu = run_predict(cfg, ckpt, tmp_path / "gpu", **kwargs)
    assert gpu.rows == cpu.rows
    for split in ("train", "valid", "test"):
        a, b = read_split(tmp_path / "cpu", split), read_split(tmp_path / "gpu", split)
        np.testing.assert_array_equal(b["row"], a["row"])
        np.testing.assert_array_equal(b["user_id"], a["user_id"])
        for name in ("ctr_logit", "cvr_logit", "embedding"):
            np.testing.assert_allclose(b[name], a[name], rtol=1e-3, atol=1e-4, err_msg=f"{split} {name}")
