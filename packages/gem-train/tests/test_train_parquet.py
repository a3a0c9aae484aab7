"""The Parquet source (issue 17): round trip, splits, resume, bad inputs, ids, inspect, MovieLens equality."""

from __future__ import annotations

import json
import tomllib
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem_train.cli import main
from gem_train.config import ConfigError, ParquetConfig, config_from_dict, load_config
from gem_train.data.loader import make_eval_loader, make_train_loader
from gem_train.data.parquet import reader as reader_mod
from gem_train.data.parquet.errors import ParquetDataError
from gem_train.data.parquet.export import export_synthetic
from gem_train.data.parquet.ids import IdMapper, splitmix64
from gem_train.data.parquet.inspect import inspect_dataset
from gem_train.data.parquet.reader import ParquetSource
from gem_train.data.synthetic import SyntheticAds

# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def assert_batches_equal(a, b):
    """Every tensor of two GemBatches equal (bit for bit) and of the same dtype."""
    assert torch.equal(a.dense, b.dense)
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())
    assert a.sequences.keys() == b.sequences.keys()
    for k in a.sequences:
        x, y = a.sequences[k], b.sequences[k]
        for f in ("offsets", "item_ids", "action_ids", "timestamps"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f
        assert x.max_len == y.max_len
    assert torch.equal(a.request_time, b.request_time)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.label_mask, b.label_mask)


def write_table(path: Path, n: int, seed: int = 0, first_id: int = 0, row_group: int = 50, **columns) -> None:
    """``n`` rows: dense ``[row id, noise]`` (the row id identifies the row), a user id, multi-hot tags,
    ragged histories (lengths 0..12, incl. 0 and 1), a click label and a nullable conversion label."""
    rng = np.random.default_rng(seed)
    ids = np.arange(first_id, first_id + n)
    lengths = rng.integers(0, 13, n)
    lengths[:2] = [0, 1]
    items = [rng.integers(0, 100, k).tolist() for k in lengths]
    ts = [np.sort(rng.integers(0, 1000, k)).tolist() for k in lengths]
    cols = {
        "dense": pa.FixedSizeListArray.from_arrays(
            pa.array(np.stack([ids, rng.normal(size=n)], 1).reshape(-1), pa.float32()), 2
        ),
        "user": pa.array(rng.integers(0, 50, n), pa.int64()),
        "tags": pa.array(
            [rng.integers(0, 10, rng.integers(1, 4)).tolist() for _ in range(n)], pa.list_(pa.int64())
        ),
        "items": pa.array(items, pa.list_(pa.int64())),
        "actions": pa.array([rng.integers(0, 3, k).tolist() for k in lengths], pa.list_(pa.int64())),
        "ts": pa.array(ts, pa.list_(pa.int64())),
        "click": pa.array(rng.integers(0, 2, n), pa.int8()),
        "conv": pa.array(rng.integers(0, 2, n), pa.int8(), mask=rng.uniform(size=n) < 0.3),
    }
    cols.update(columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path, row_group_size=row_group)


def section(root: Path, **over) -> dict:
    """The [data.parquet] section of :func:`write_table` files."""
    sec = {
        "root": str(root),
        "train": ["train/*.parquet"],
        "test": ["test/*.parquet"],
        "shuffle": "buffer",
        "shuffle_buffer": 40,
        "dense": {"column": "dense", "n_dense": 2},
        "sparse": {"user": {"num_embeddings": 50}, "tags": {"num_embeddings": 10, "max_ids": 3}},
        "sequences": {
            "history": {
                "items": "items",
                "actions": "actions",
                "timestamps": "ts",
                "num_items": 100,
                "num_actions": 3,
                "max_len": 8,
            },
        },
        "labels": {"ctr": "click", "cvr": "conv"},
        # These tests read every training row; the time-cut validation split is tested in
        # test_train_own_data.py.
        "valid_fraction": 0.0,
    }
    sec.update(over)
    return sec


def source(root: Path, seed: int = 0, **over) -> ParquetSource:
    return ParquetSource(config_from_dict(ParquetConfig, section(root, **over)), seed=seed)


@pytest.fixture
def table_dir(tmp_path):
    write_table(tmp_path / "train" / "a.parquet", 230, seed=1)
    write_table(tmp_path / "train" / "b.parquet", 97, seed=2, first_id=230, row_group=30)
    write_table(tmp_path / "test" / "t.parquet", 61, seed=3, first_id=10_000)
    return tmp_path


def row_ids(lb) -> list[int]:
    return lb.batch.dense[:, 0].to(torch.int64).tolist()


class _Worker:
    """Makes ``get_worker_info()`` of the reader say "worker ``id`` of ``num_workers``" while a worker's
    stream starts (its generator reads it once, at the first ``next``)."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def stream(self, ds, worker: int, workers: int):
        it = iter(ds)
        self.mp.setattr(
            reader_mod, "get_worker_info", lambda: types.SimpleNamespace(id=worker, num_workers=workers)
        )
        first = next(it)
        self.mp.setattr(reader_mod, "get_worker_info", lambda: None)
        yield first
        yield from it


def rank_stream(src, monkeypatch, rank, world, workers, start, n, batch_size=16):
    """What a DataLoader with ``workers`` workers yields on ``rank``: the workers' batches in turn."""
    ds = src.make_stream(
        "train", batch_size, rank=rank, world_size=world, start=start, max_batches=0, num_workers=workers
    )
    w = _Worker(monkeypatch)
    its = [w.stream(ds, k, workers) for k in range(workers)]
    return [next(its[i % workers]) for i in range(n)]


# ----------------------------------------------------------------------------------------------------------
# Round trip, splits, resume
# ----------------------------------------------------------------------------------------------------------


def test_round_trip_synthetic_to_parquet_gives_the_generators_batches(tmp_path):
    cfg = load_config(
        "tiny-cpu",
        [
            "data.batch_size=32",
            "data.eval_batch_size=50",
            "data.synthetic.max_len=24",
            "data.synthetic.eval_examples=120",
            "data.synthetic.valid_examples=70",
        ],
    )
    counts = export_synthetic(cfg, tmp_path, 32 * 9)
    assert counts == {"train": 288, "test": 120, "valid": 70}
    sec = tomllib.loads((tmp_path / "data.toml").read_text())["data"]["parquet"]
    src = ParquetSource(config_from_dict(ParquetConfig, sec), seed=0)
    ds = SyntheticAds(cfg.data.synthetic, 0)
    assert src.spec == ds.spec
    it = iter(make_train_loader(src, 32))
    for i in range(9 + 3):  # past the end of the file: the next epoch starts over, in file order
        lb = next(it)
        lb.batch.validate(src.spec)
        assert_batches_equal(lb.batch, ds.make_batch("train", i % 9, 32).batch)
    for split in ("test", "valid"):
        got = list(make_eval_loader(src, 50, split=split))
        assert len(got) == ds.held_out_batches(split, 50) == src.num_batches(split, 50)
        for i, lb in enumerate(got):
            assert_batches_equal(lb.batch, ds.get(split, i, 50).batch)


@pytest.mark.parametrize(("world", "workers"), [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_rank_and_worker_shards_are_disjoint_and_cover_every_row_once_per_epoch(table_dir, world, workers):
    src = source(table_dir)
    n = src.rows("train")
    shards = world * workers
    for epoch in range(2):
        seen = []
        for s in range(shards):
            size = (s + 1) * n // shards - s * n // shards
            it = src._train_batches(s, shards, 1, local_start=epoch * size)  # batches of one row
            seen += [row_ids(next(it))[0] for _ in range(size)]
        assert sorted(seen) == list(range(n))  # disjoint and complete
    # Epochs differ (row groups and windows reshuffled), a seed is deterministic, another seed differs.
    first = [row_ids(lb) for lb in _take(src._train_batches(0, 1, 16, 0), 5)]
    assert first == [row_ids(lb) for lb in _take(source(table_dir)._train_batches(0, 1, 16, 0), 5)]
    assert first != [row_ids(lb) for lb in _take(source(table_dir, seed=1)._train_batches(0, 1, 16, 0), 5)]
    assert first != [row_ids(lb) for lb in _take(src._train_batches(0, 1, 16, n // 16 + 1), 5)]


def _take(it, k):
    return [next(it) for _ in range(k)]


def test_shuffle_buffer_bounds_how_far_rows_move(table_dir):
    """Each window of shuffle_buffer rows holds exactly the rows of that stretch of the epoch's row-group
    order (rows move only within their window); "none" keeps file order."""
    src = source(table_dir, shuffle_buffer=10)
    files = src.files["train"]
    order, _ = src._order(files, 0)
    start = np.concatenate([[0], np.cumsum(files.group_rows)])  # row ids are consecutive in file order
    space = np.concatenate([np.arange(start[g], start[g + 1]) for g in order])
    rows = [r for lb in _take(src._train_batches(0, 1, 10, 0), 8) for r in row_ids(lb)]
    for k in range(8):
        assert sorted(rows[10 * k : 10 * k + 10]) == sorted(space[10 * k : 10 * k + 10].tolist())
    assert rows != space[:80].tolist() and sorted(order.tolist()) == list(range(len(order)))
    plain = source(table_dir, shuffle="none")
    assert [r for lb in _take(plain._train_batches(0, 1, 10, 0), 3) for r in row_ids(lb)] == list(range(30))


@pytest.mark.parametrize(("world", "workers", "start"), [(1, 1, 5), (1, 3, 7), (2, 2, 5), (2, 3, 4)])
def test_resume_continues_the_exact_stream(table_dir, monkeypatch, world, workers, start):
    src = source(table_dir)
    for rank in range(world):
        full = rank_stream(src, monkeypatch, rank, world, workers, 0, start + 12)
        resumed = rank_stream(source(table_dir), monkeypatch, rank, world, workers, start, 12)
        for a, b in zip(full[start:], resumed):
            assert_batches_equal(a.batch, b.batch)


def test_real_dataloader_workers_give_the_planned_stream(table_dir, monkeypatch):
    src = source(table_dir)
    want = rank_stream(src, monkeypatch, 0, 1, 2, 3, 8)
    monkeypatch.undo()
    loader = make_train_loader(source(table_dir), 16, start=3, num_workers=2)
    got = []
    for lb in loader:
        got.append(lb)
        if len(got) == 8:
            break
    for a, b in zip(want, got):
        assert_batches_equal(a.batch, b.batch)


def test_held_out_split_is_read_once_in_file_order_by_any_layout(table_dir):
    src = source(table_dir)
    for world, workers in ((1, 1), (2, 1), (3, 2)):
        rows = []
        for rank in range(world):
            for w in range(workers):
                batches = src._held_out_batches("test", 8, rank, world, w, workers, 0)
                rows += [r for lb in batches for r in row_ids(lb)]
        assert sorted(rows) == list(range(10_000, 10_061))
    assert src.num_batches("test", 8) == 8 and src.num_batches("valid", 8) == 0


def test_truncation_keeps_the_most_recent_events(tmp_path):
    items = [list(range(20)), [5], []]
    ts = [list(range(100, 120)), [7], []]
    n = 3
    write_table(
        tmp_path / "train" / "a.parquet",
        n,
        items=pa.array(items, pa.list_(pa.int64())),
        ts=pa.array(ts, pa.list_(pa.int64())),
        actions=pa.array([[1] * 20, [2], []], pa.list_(pa.int64())),
    )
    write_table(tmp_path / "test" / "t.parquet", 5)
    src = source(tmp_path, shuffle="none")
    lb = next(src._train_batches(0, 1, 3, 0))
    seq = lb.batch.sequences["history"]
    assert seq.offsets.tolist() == [0, 8, 9, 9]
    assert seq.item_ids.tolist() == [*range(12, 20), 5]
    assert seq.timestamps.tolist() == [*range(112, 120), 7]
    assert lb.batch.request_time.tolist() == [119, 7, 0]  # no request_time column: the latest event
    lb.batch.validate(src.spec)


# ----------------------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------------------


def _bad(tmp_path, rows_fn, **over):
    """A 60-row train file whose row 37 (row group 1 with groups of 25, row 12 there) is made bad."""
    n = 60
    cols = rows_fn(n)
    write_table(tmp_path / "train" / "a.parquet", n, row_group=25, **cols)
    write_table(tmp_path / "test" / "t.parquet", 5)
    return source(tmp_path, **{"shuffle": "none", **over})


def _lists(n, bad_row, good, bad):
    return pa.array([bad if i == bad_row else good for i in range(n)], pa.list_(pa.int64()))


BAD_ROWS = {
    "unequal lengths": (
        lambda n: {
            "items": _lists(n, 37, [1, 2], [1, 2, 3]),
            "actions": _lists(n, 37, [0, 0], [0, 0]),
            "ts": _lists(n, 37, [1, 2], [1, 2]),
        },
        "sequence 'history': 'actions' and 'items' differ in length",
    ),
    "item out of range": (
        lambda n: {
            "items": _lists(n, 37, [1], [100]),
            "actions": _lists(n, 37, [0], [0]),
            "ts": _lists(n, 37, [1], [1]),
        },
        r"sequence 'history': an item id out of range \[0, 100\)",
    ),
    "sparse out of range": (
        lambda n: {"user": pa.array([50 if i == 37 else 1 for i in range(n)], pa.int64())},
        r"sparse feature 'user': id 50 out of range \[0, 50\)",
    ),
    "negative id": (
        lambda n: {"user": pa.array([-1 if i == 37 else 1 for i in range(n)], pa.int64())},
        r"sparse feature 'user': id -1 out of range",
    ),
    "too many ids": (
        lambda n: {"tags": _lists(n, 37, [1], [1, 2, 3, 4])},
        "sparse feature 'tags': more than max_ids 3",
    ),
    "negative timestamp": (
        lambda n: {
            "items": _lists(n, 37, [1, 2], [1, 2]),
            "actions": _lists(n, 37, [0, 0], [0, 0]),
            "ts": _lists(n, 37, [1, 2], [-5, 2]),
        },
        "sequence 'history': a negative timestamp",
    ),
    "non-monotone timestamps": (
        lambda n: {
            "items": _lists(n, 37, [1, 2], [1, 2]),
            "actions": _lists(n, 37, [0, 0], [0, 0]),
            "ts": _lists(n, 37, [1, 2], [9, 2]),
        },
        r"sequence 'history': timestamps decrease",
    ),
    "NaN dense": (
        lambda n: {
            "dense": pa.FixedSizeListArray.from_arrays(
                pa.array([np.nan if i == 2 * 37 + 1 else float(i // 2) for i in range(2 * n)], pa.float32()),
                2,
            )
        },
        "a dense feature is NaN, inf or null",
    ),
    "label not 0/1": (
        lambda n: {"click": pa.array([2 if i == 37 else 0 for i in range(n)], pa.int8())},
        r"label 'click' \(task 'ctr'\) is 2.0, not 0 or 1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_each_bad_row_names_file_row_group_and_row_or_is_skipped_and_counted(tmp_path, case):
    rows_fn, message = BAD_ROWS[case]
    src = _bad(tmp_path, rows_fn)
    with pytest.raises(ParquetDataError, match=r"a\.parquet, row group 1, row 12: " + message):
        list(_take(src._train_batches(0, 1, 20, 0), 3))
    # skip: the batch holding it is one row short, the position of every other batch is unchanged.
    skip = _bad(tmp_path / "skip", rows_fn, on_bad_row="skip")
    got = _take(skip._train_batches(0, 1, 20, 0), 3)
    assert [lb.batch.batch_size for lb in got] == [20, 19, 20]
    assert [lb.bad_rows for lb in got] == [0, 1, 0]
    assert 37 not in row_ids(got[1]) and row_ids(got[2]) == list(range(40, 60))
    assert "row group 1, row 12" in got[1].bad_reason
    got[1].batch.validate(skip.spec)


def test_skipped_rows_are_summed_over_workers_in_the_main_process(tmp_path, capsys):
    rows_fn, _ = BAD_ROWS["sparse out of range"]
    src = _bad(tmp_path, rows_fn, on_bad_row="skip", shuffle="buffer")
    loader = make_train_loader(src, 15, num_workers=2)
    it = iter(loader)
    batches = [next(it) for _ in range(4)]  # 2 per worker: the first epoch of both shards, 30 rows each
    assert sum(lb.batch.batch_size for lb in batches) == 59
    assert src.bad_rows == {"train": 1}
    assert "left 1 bad row(s) out of a train batch" in capsys.readouterr().err


def test_dense_nan_fill(tmp_path):
    rows_fn, _ = BAD_ROWS["NaN dense"]
    src = _bad(tmp_path, rows_fn, dense_nan="fill", dense_fill=-3.0)
    lb = _take(src._train_batches(0, 1, 20, 0), 2)[1]
    assert lb.batch.batch_size == 20 and lb.batch.dense[17, 1].item() == -3.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.drop_columns(["items"]), r"no column 'items' \(sequence 'history'\)"),
        (
            lambda t: t.set_column(t.schema.get_field_index("user"), "user", pa.array(["x"] * t.num_rows)),
            r"sparse column 'user' is string, expected int64 or list<int64>",
        ),
        (
            lambda t: t.set_column(t.schema.get_field_index("ts"), "ts", pa.array([1.5] * t.num_rows)),
            r"sequence column 'ts' is double, expected list<int64>",
        ),
        (lambda t: t.slice(0, 0), r"the file is empty \(0 rows\)"),
    ],
)
def test_missing_mistyped_columns_and_empty_files_name_the_file(tmp_path, change, message):
    write_table(tmp_path / "ok" / "a.parquet", 10)
    t = change(pq.read_table(tmp_path / "ok" / "a.parquet"))
    (tmp_path / "train").mkdir()
    pq.write_table(t, tmp_path / "train" / "bad.parquet")
    write_table(tmp_path / "test" / "t.parquet", 5)
    with pytest.raises(ParquetDataError, match=r"file \S*train/bad\.parquet: " + message):
        source(tmp_path)


def test_no_files_and_bad_declarations(tmp_path):
    write_table(tmp_path / "test" / "t.parquet", 5)
    with pytest.raises(ParquetDataError, match=r"no file matches the train pattern 'train/\*\.parquet'"):
        source(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"data.parquet.sparse.user.ids: expected one of .raw. | .hash. | .vocab., got .md5.",
    ):
        source(tmp_path, sparse={"user": {"num_embeddings": 5, "ids": "md5"}})
    with pytest.raises(ConfigError, match=r"unknown config key 'data.parquet.sequences.history.item'"):
        source(tmp_path, sequences={"history": {"item": "items"}})
    with pytest.raises(ConfigError, match=r"data.parquet.train must list the train files"):
        load_config("tiny-cpu", ["data.source=parquet"])


def test_fewer_rows_than_shards_is_an_error_not_a_hang(tmp_path):
    write_table(tmp_path / "train" / "a.parquet", 3)
    write_table(tmp_path / "test" / "t.parquet", 3)
    with pytest.raises(ParquetDataError, match="fewer than ranks x loader workers = 4"):
        next(source(tmp_path)._train_batches(0, 4, 1, 0))


# ----------------------------------------------------------------------------------------------------------
# Ids: hash, vocabulary
# ----------------------------------------------------------------------------------------------------------


def _splitmix64_reference(x: int) -> int:
    m = (1 << 64) - 1
    z = x & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_hash_is_the_stated_splitmix64_and_vocabulary_maps_by_line(tmp_path):
    raw = np.array([0, 1, -1, 2**63 - 1, -(2**63), 123456789], np.int64)
    assert splitmix64(raw).tolist() == [_splitmix64_reference(int(v)) for v in raw]
    rows, bad = IdMapper("hash", 1000)(raw)
    assert rows.tolist() == [_splitmix64_reference(int(v)) % 1000 for v in raw] and not bad.any()
    (tmp_path / "v.txt").write_text("700\n-5\n42\n")
    rows, bad = IdMapper("vocab", 4, tmp_path / "v.txt")(np.array([42, 700, 9, -5]))
    assert rows.tolist() == [2, 0, 0, 1] and bad.tolist() == [False, False, True, False]
    (tmp_path / "dup.txt").write_text("1\n2\n1\n")
    with pytest.raises(ValueError, match=r"dup.txt, line 3: id 1 repeats line 1"):
        IdMapper("vocab", 4, tmp_path / "dup.txt")


def test_hashed_and_vocabulary_ids_in_batches_and_inspect_counts_collisions(table_dir, tmp_path):
    (tmp_path / "tags.txt").write_text("\n".join(str(i) for i in range(9)) + "\n")  # tag 9 is unknown
    src = source(
        table_dir,
        shuffle="none",
        on_bad_row="skip",
        sparse={
            "user": {"num_embeddings": 7, "ids": "hash"},
            "tags": {
                "num_embeddings": 10,
                "max_ids": 3,
                "ids": "vocab",
                "vocab_file": str(tmp_path / "tags.txt"),
            },
        },
    )
    raw = pq.read_table(table_dir / "train" / "a.parquet")
    lb = next(src._train_batches(0, 1, 50, 0))
    keep = [i for i in range(50) if 9 not in raw["tags"][i].as_py()]
    users = raw["user"].to_numpy()[keep]
    assert (
        lb.batch.sparse["user"].values().tolist()
        == (splitmix64(users) % np.uint64(7)).astype(np.int64).tolist()
    )
    assert lb.bad_rows == 50 - len(keep)
    report = inspect_dataset(src, tmp_path / "h.png")
    user = report["splits"]["train"]["ids"]["sparse.user"]
    distinct = np.unique(
        np.concatenate([pq.read_table(p)["user"].to_numpy() for p in src.files["train"].paths])
    )
    assert user["distinct_ids"] == len(distinct) == 50
    assert user["distinct_rows"] == len(np.unique(splitmix64(distinct) % np.uint64(7))) == 7
    assert user["collisions"] == 43
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_inspect_reports_counts_rates_quantiles_and_out_of_range(table_dir, tmp_path, capsys):
    src = source(table_dir, sparse={"user": {"num_embeddings": 40}})
    rep = inspect_dataset(src)["splits"]
    t = pq.read_table(table_dir / "test" / "t.parquet")
    assert rep["train"]["rows"] == 327 and rep["test"]["rows"] == 61
    users = t["user"].to_numpy()
    assert rep["test"]["ids"]["sparse.user"]["out_of_range"] == int((users >= 40).sum()) > 0
    assert rep["test"]["bad_rows"] == int((users >= 40).sum())
    conv = t["conv"]
    assert rep["test"]["labels"]["cvr"]["null"] == conv.null_count
    assert rep["test"]["labels"]["cvr"]["positive_rate"] == pytest.approx(
        np.mean(conv.drop_null().to_numpy())
    )
    lengths = np.array([len(x) for x in t["items"].to_pylist()])
    h = rep["test"]["history_length"]["history"]
    assert h["p50"] == np.quantile(lengths, 0.5) and h["max"] == lengths.max()
    assert h["longer_than_max_len"] == int((lengths > 8).sum())
    # The command line: a config file, text (or --json) out.
    cfg = tmp_path / "run.toml"
    cfg.write_text('[data]\nsource = "parquet"\n' + _toml_section(section(table_dir)))
    assert main(["data", "inspect", "--config", str(cfg), "--png", str(tmp_path / "x.png"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["splits"]["train"]["rows"] == 327


def _toml_section(sec: dict) -> str:
    from gem_train.config import dumps_toml

    return dumps_toml({"data": {"parquet": sec}}).replace("[data]\n", "")


# ----------------------------------------------------------------------------------------------------------
# Training on a table with only a config file; resume; MovieLens equality
# ----------------------------------------------------------------------------------------------------------


def _parquet_run(table_dir, out, *extra):
    cfg_text = '[data]\nsource = "parquet"\n' + _toml_section(section(table_dir))
    path = out / "run.toml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(cfg_text)
    return load_config(
        str(path),
        [
            "data.batch_size=16",
            "data.eval_batch_size=32",
            "model.overrides.n_layers=1",
            'model.overrides.attention="full"',
            "train.log_every=2",
            "train.progress_bar=false",
            "optim.warmup_steps=2",
            f"run.out_dir={out}",
            *extra,
        ],
    )


def test_train_and_resume_on_a_table_with_only_a_config(table_dir, tmp_path):
    from gem_train.loop.trainer import Trainer

    full = Trainer(_parquet_run(table_dir, tmp_path / "a", "train.steps=6")).fit()
    assert full.status == "completed" and set(full.final_eval.tasks) == {"ctr", "cvr"}
    first = Trainer(_parquet_run(table_dir, tmp_path / "b", "train.steps=6")).fit(stop_after=3)
    state = json.loads((first.last_checkpoint / "trainer_state.json").read_text())
    assert state["data_stream"]["world_size"] == 1 and state["data_position"] == 3
    second = Trainer(
        _parquet_run(table_dir, tmp_path / "b", "train.steps=6"), resume=first.last_checkpoint
    ).fit()
    assert first.losses + second.losses == full.losses
    assert second.final_eval.tasks["ctr"].ne == full.final_eval.tasks["ctr"].ne
    with pytest.raises(ConfigError, match=r"same ranks and data.num_workers \(num_workers 1 -> 2\)"):
        Trainer(
            _parquet_run(table_dir, tmp_path / "b", "train.steps=6", "data.num_workers=2"),
            resume=first.last_checkpoint,
        )


@pytest.fixture(scope="module")
def ml_parquet(tmp_path_factory):
    """A 60-user MovieLens slice exported to Parquet (the real data; skipped only without a network)."""
    import os
    import re

    from gem_train.data.movielens import DataFetchError, fetch_movielens_100k

    # As test_train_movielens.py: only an unreachable index skips; any other failure is a bug.
    network_error = re.compile(
        r"NewConnectionError|ConnectTimeout|ReadTimeout|Max retries exceeded|Network is unreachable|"
        r"Temporary failure in name resolution|Name or service not known|Connection refused|ProxyError"
    )
    cache = os.environ.get("GEM_CACHE_DIR") or str(tmp_path_factory.mktemp("gem-cache"))
    try:
        fetch_movielens_100k(cache)
    except DataFetchError as e:
        if not network_error.search(str(e)):
            raise
        pytest.skip(f"MovieLens-100K not fetched, no network: {e}")
    out = tmp_path_factory.mktemp("ml-parquet")
    base = [
        f"data.movielens.cache_dir={cache}",
        "data.movielens.max_users=60",
        "data.movielens.max_len=32",
        "data.movielens.history_genres=false",  # no Parquet columns for event features yet
    ]
    assert (
        main(
            [
                "data",
                "export",
                "movielens-100k",
                str(out),
                "--config",
                "movielens",
                *[x for b in base for x in ("--set", b)],
            ]
        )
        == 0
    )
    return out, base


def test_movielens_parquet_gives_the_built_in_batches_and_metrics(ml_parquet, tmp_path):
    from gem_train.loop.build import build_source
    from gem_train.loop.trainer import Trainer

    out, base = ml_parquet
    small = [
        "data.batch_size=64",
        "data.eval_batch_size=256",
        "model.overrides.n_layers=1",
        'model.overrides.attention="full"',
        "train.steps=12",
        "train.valid_every=6",
        "train.log_every=4",
        "train.progress_bar=false",
        "checkpoint.every=0",
        f"run.out_dir={tmp_path}",
        "run.seed=3",
    ]
    parquet = [f"data.parquet.root={out}", "data.parquet.sequences.history.max_len=32", *small]
    # The shipped config declares the full dataset's vocabularies; the slice has the same ones.
    builtin_cfg = load_config("movielens", [*base, *small])
    parquet_cfg = load_config("movielens-parquet", parquet)
    a, b = build_source(builtin_cfg), build_source(parquet_cfg)
    assert a.spec == b.spec
    for split in ("train", "valid", "test"):
        assert a.num_batches(split, 64) == b.num_batches(split, 64)
    per_epoch = a.num_batches("train", 64)
    for i in [0, 1, per_epoch - 1, per_epoch, per_epoch + 2]:  # across an epoch boundary: new permutation
        assert_batches_equal(a.get("train", i, 64).batch, b.get("train", i, 64).batch)
    for split in ("valid", "test"):
        for x, y in zip(
            make_eval_loader(a, 256, split=split), make_eval_loader(b, 256, split=split), strict=True
        ):
            assert_batches_equal(x.batch, y.batch)
    ra, rb = Trainer(builtin_cfg).fit(), Trainer(parquet_cfg).fit()
    assert ra.losses == rb.losses
    assert ra.final_eval.tasks["ctr"].ne == rb.final_eval.tasks["ctr"].ne
    assert ra.best_eval.tasks["ctr"].ne == rb.best_eval.tasks["ctr"].ne and ra.best_step == rb.best_step


def test_readme_config_loads_and_synthetic_export_command(tmp_path, capsys):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    # The format's reference config (the walk-through above it runs whole in tests/test_readme_examples.py).
    part = readme.split("## Training on your own data (Parquet)", 1)[1].split("### The table format", 1)[1]
    block = part.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my-ads.toml").write_text(block)
    cfg = load_config(str(tmp_path / "my-ads.toml"))
    names = [n for n, _ in cfg.data.parquet.sparse_features()]
    assert cfg.data.source == "parquet" and names == ["user_id", "interests"]
    assert list(cfg.data.parquet.labels) == ["ctr", "cvr"]
    argv = [
        "data",
        "synthetic",
        "--format",
        "parquet",
        "--train-examples",
        "100",
        str(tmp_path / "syn"),
        "data.batch_size=50",
        "data.synthetic.eval_examples=60",
        "data.synthetic.max_len=8",
    ]
    assert main(argv) == 0
    assert "train 100 rows, test 60 rows" in capsys.readouterr().out
    text = (tmp_path / "syn" / "data.toml").read_text()
    assert (
        main(
            [
                "data",
                "inspect",
                "--config",
                str(tmp_path / "syn" / "data.toml"),
                "--png",
                str(tmp_path / "h.png"),
            ]
        )
        == 0
    )
    assert "train: 100 rows" in capsys.readouterr().out and 'source = "parquet"' in text


@pytest.mark.distributed
def test_torchrun_two_ranks_train_and_evaluate_every_held_out_row_once(table_dir, tmp_path):
    import os
    import subprocess
    import sys

    write_table(table_dir / "valid" / "v.parquet", 45, seed=4, first_id=20_000)
    sec = section(table_dir, valid=["valid/*.parquet"])
    cfg = tmp_path / "run.toml"
    cfg.write_text('[data]\nsource = "parquet"\n' + _toml_section(sec))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "gem_train.cli",
        "train",
        "--config",
        str(cfg),
        "data.batch_size=16",
        "data.eval_batch_size=8",
        "data.num_workers=1",
        "model.overrides.n_layers=1",
        'model.overrides.attention="full"',
        "train.steps=4",
        "train.log_every=2",
        "train.valid_every=2",
        "train.progress_bar=false",
        "checkpoint.every=2",
        f"run.out_dir={tmp_path / 'runs'}",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    (run,) = list((tmp_path / "runs").iterdir())
    summary = json.loads((run / "eval.json").read_text())
    assert summary["tasks"]["ctr"]["count"] == 61  # every test row once, over both ranks
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["ctr/count"] == 45 for r in rows if r["split"] == "valid")
    state = json.loads((run / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["data_stream"] == {
        "format": "parquet",
        "shuffle": "buffer",
        "world_size": 2,
        "num_workers": 1,
        "train_rows": 327,
    }
