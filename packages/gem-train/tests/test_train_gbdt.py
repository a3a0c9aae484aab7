"""The GBDT baseline: strictly causal features, item statistics from the training split only, no leak."""

import copy

import numpy as np
import pytest

from gem_train.config import ConfigError, MovieLensConfig, load_config
from gem_train.config.gbdt import GbdtConfig
from gem_train.data.movielens import MovieLens100K, read_movielens_100k
from gem_train.evaluation.baselines.gbdt_features import FeatureOptions
from gem_train.evaluation.baselines.gbdt_matrix import GbdtFeatureBuilder
from gem_train.evaluation.baselines.item_stats import ItemStats
from gem_train.evaluation.baselines.training_log import TrainingLog

USER = "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
ITEM = "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
INTER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
GENRES = ["Animation Comedy", "Action", "Drama", "Comedy Drama", "Action Thriller", "Comedy"]


def _write(d, n_users=8, n_items=10, seed=0):
    rng = np.random.default_rng(seed)
    users = "".join(
        f"{u}\t{20 + 7 * u}\t{'MF'[u % 2]}\tjob{u % 3}\t{10000 + u}\n" for u in range(1, n_users + 1)
    )
    (d / "ml-100k.user").write_text(USER + users)
    items = "".join(
        f"{i}\tT{i}\t{1980 + 3 * i}\t{GENRES[(i - 1) % len(GENRES)]}\n" for i in range(1, n_items + 1)
    )
    (d / "ml-100k.item").write_text(ITEM + items)
    rows = []
    for u in range(1, n_users + 1):
        t = 0
        for i in rng.permutation(np.arange(1, n_items + 1)):
            t += int(rng.choice([0, 3600, 86_400]))  # same-second events too
            rows.append(f"{u}\t{i}\t{rng.integers(1, 6)}\t{10**6 + t}\n")
    (d / "ml-100k.inter").write_text(INTER + "".join(rows))


@pytest.fixture
def ml_dir(tmp_path):
    _write(tmp_path)
    return tmp_path


ML_CFG = MovieLensConfig(max_len=1000, eval_fraction=0.2, valid_fraction=0.2)


def _builder(ev, options=None, ml_cfg=ML_CFG):
    ds = MovieLens100K(ml_cfg, events=ev)
    b = GbdtFeatureBuilder(ds, GbdtConfig(), 4, 1, 4, ds.num_batches("train", 1), options)
    b.fit()
    return b, ds


def _features(ev, options=None):
    """Every split's features of the tiny MovieLens (training batches of 1: every row, in order), indexed
    by event row: ``{event row: feature vector}``, the column names and the dataset."""
    b, ds = _builder(ev, options)
    out = {}
    train_rows = [int(ds.rows("train", i, 1)[0]) for i in range(ds.num_batches("train", 1))]
    for r, x in zip(train_rows, b.train_matrix().x, strict=True):
        out[r] = x
    for split, rows in (("valid", ds.valid_rows), ("test", ds.eval_rows)):
        for r, x in zip(rows, b.held_out_matrix(split).x, strict=True):
            out[int(r)] = x
    return out, b.names, ds


def _same(a, b):
    return np.array_equal(a, b, equal_nan=True)


def test_features_are_the_practitioners_set_built_from_the_declared_data(ml_dir):
    ev = read_movielens_100k(ml_dir)
    b, ds = _builder(ev)
    for n in [
        "history.like_rate", "history.mean_action", "history.like_rate_last3", "history.mean_action_last3",
        "history.like_rate_last10", "history.mean_action_last10", "history.log_hours_since_last",
        "history.ad_genres.like_rate", "history.ad_genres.log_count", "item.ctr_rate", "item.log_rows",
        "item.mean_action", "user_gender", "user_age", "user_occupation", "ad_year", "ad_genres=0",
    ]:  # fmt: skip
        assert n in b.names, n
    assert "history.user_age.like_rate" not in b.names  # a user feature is no item attribute
    # The history columns are what the user's strictly earlier events say (test rows: their histories
    # hold training and validation events). A history item's genres are known when it was a training
    # candidate (the attribute table is the training split's).
    known = set(ev.item[ds.train_rows].tolist())
    prior = 0.5
    checked_genres = 0
    for k, r in enumerate(ds.eval_rows):
        x = dict(zip(b.names, b.held_out_matrix("test").x[k], strict=True))
        earlier = (ev.user == ev.user[r]) & (ev.timestamp < ev.timestamp[r])
        ratings, n = ev.rating[earlier], int(earlier.sum())
        assert x["history.log_len"] == pytest.approx(np.log1p(n))
        assert x["history.like_rate"] == pytest.approx(((ratings >= 4).sum() + 5 * prior) / (n + 5))
        assert x["history.mean_action"] == pytest.approx(ratings.mean())
        assert x["history.like_rate_last3"] == pytest.approx((ratings[-3:] >= 4).mean())
        assert x["history.mean_action_last3"] == pytest.approx(ratings[-3:].mean())
        assert x["history.mean_action_last10"] == pytest.approx(ratings[-10:].mean())
        hours = (ev.timestamp[r] - ev.timestamp[earlier].max()) / 3600
        assert x["history.log_hours_since_last"] == pytest.approx(np.log1p(hours))
        # Genres: the user's likes on earlier events, once per genre shared with the candidate.
        genres = set(ev.item_genres[ev.item[r]])
        hits = np.array([len(genres & set(ev.item_genres[i])) if i in known else 0 for i in ev.item[earlier]])
        likes = float((hits * (ratings >= 4)).sum())
        assert x["history.ad_genres.log_count"] == pytest.approx(np.log1p(hits.sum()))
        want = (likes + 2 * x["history.like_rate"]) / (hits.sum() + 2)
        assert x["history.ad_genres.like_rate"] == pytest.approx(want)
        checked_genres += hits.sum() > 0
    assert checked_genres >= 3


def test_changing_later_events_moves_no_feature_of_an_earlier_example(ml_dir):
    """A user's events at or after an example's time (their ratings, so labels too; timestamps kept)
    change no history or static feature of that example, nor any feature of another user's example
    but through the training split's item statistics (checked apart below)."""
    ev = read_movielens_100k(ml_dir)
    base, names, ds = _features(ev)
    own = np.array([not n.startswith("item.") for n in names])
    seen = 0
    for r in [int(ds.train_rows[3]), int(ds.valid_rows[2]), int(ds.eval_rows[1]), int(ds.train_rows[0])]:
        ev2 = copy.deepcopy(ev)
        late = (ev2.user == ev2.user[r]) & (ev2.timestamp >= ev2.timestamp[r])
        ev2.rating[late] = 6 - ev2.rating[late]
        moved, _, _ = _features(ev2)
        seen += not all(_same(moved[k], base[k]) for k in base)
        for k in base:
            later_same_user = ev.user[k] == ev.user[r] and ev.timestamp[k] > ev.timestamp[r]
            if not later_same_user:
                assert _same(moved[k][own], base[k][own]), (r, k)
    assert seen >= 3  # the changes are seen (by later rows), except a user's last test event's
    # The causal encoding of the item statistics: no feature at all of an earlier training row moves when
    # later training events change (other users' too). Two later events swap ratings (a like and a
    # dislike), which keeps the training split's priors (one number each, over the whole split).
    opt = FeatureOptions(item_encoding="causal")
    base, names, ds = _features(ev, opt)
    t_cut = np.sort(ev.timestamp[ds.train_rows])[len(ds.train_rows) // 2]
    in_history = _in_a_training_history(ev, ds)
    late = [int(k) for k in ds.train_rows if ev.timestamp[k] > t_cut and in_history[k]]
    a = next(k for k in late if ev.rating[k] >= 4)
    b = next(k for k in late if ev.rating[k] < 4)
    ev2 = copy.deepcopy(ev)
    ev2.rating[[a, b]] = ev.rating[[b, a]]
    moved, _, _ = _features(ev2, opt)
    earlier = [int(k) for k in ds.train_rows if ev.timestamp[k] <= min(ev.timestamp[a], ev.timestamp[b])]
    assert earlier
    for k in earlier:
        assert _same(moved[k], base[k]), k
    assert not all(_same(moved[k], base[k]) for k in base)


def _in_a_training_history(ev, ds):
    """``[N]`` bool: the events in some training row's history (earlier than a training event of their
    user)."""
    last_train: dict[int, int] = {}
    for r in ds.train_rows:
        last_train[ev.user[r]] = max(last_train.get(ev.user[r], 0), ev.timestamp[r])
    return np.array([ev.timestamp[k] < last_train.get(ev.user[k], -1) for k in range(len(ev.user))])


def test_item_statistics_come_from_the_training_split_only(ml_dir):
    ev = read_movielens_100k(ml_dir)
    base, names, ds = _features(ev)
    item_cols = np.array([n.startswith("item.") for n in names])
    for split_rows in (ds.eval_rows, ds.valid_rows):
        ev2 = copy.deepcopy(ev)
        ev2.rating[split_rows] = 6 - ev2.rating[split_rows]  # every label of the split flips
        moved, _, _ = _features(ev2)
        for k in base:
            assert _same(moved[k][item_cols], base[k][item_cols]), k
            if k in ds.train_rows:  # a training row sees no held-out event at all
                assert _same(moved[k], base[k]), k
    # A training label does move the held-out rows' item statistics (they are the training split's).
    ev2 = copy.deepcopy(ev)
    ev2.rating[ds.train_rows] = 6 - ev2.rating[ds.train_rows]
    moved, _, _ = _features(ev2)
    assert not all(_same(moved[int(k)][item_cols], base[int(k)][item_cols]) for k in ds.eval_rows)


def _noise_log(n_items=100, per_item=30, seed=0):
    """A training log whose labels are coin flips: no feature can predict them honestly."""
    rng = np.random.default_rng(seed)
    n = n_items * per_item
    item, user, time = (
        rng.permutation(np.repeat(np.arange(n_items), per_item)),
        rng.integers(0, 500, n),
        rng.integers(0, 10**6, n),
    )
    e = np.zeros(0, np.int64)
    y = (rng.random(n) < 0.5).astype(np.float64)[:, None]
    return TrainingLog(item, user, time, y, np.ones((n, 1), bool), e, e, e, e), rng


def _out_of_fold_auc(x, y, rng):
    """AUC of a small GBDT's 5-fold out-of-fold predictions on the training rows."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from threadpoolctl import threadpool_limits

    from gem_train.evaluation.metrics import auc

    fold, p = rng.integers(0, 5, len(y)), np.zeros(len(y))
    with threadpool_limits(1):  # OpenMP threads on a busy 2-core machine only spin
        for k in range(5):
            m = HistGradientBoostingClassifier(
                max_iter=30, max_leaf_nodes=15, min_samples_leaf=20, random_state=0
            )
            m.fit(x[fold != k], y[fold != k])
            p[fold == k] = m.predict_proba(x[fold == k])[:, 1]
    return auc(p, y)


@pytest.mark.parametrize("encoding", ["loo", "kfold", "causal"])
def test_a_leaking_item_encoding_scores_implausibly_well_out_of_fold(encoding):
    """On coin-flip labels a training row's item statistics plus the item's id predict nothing, unless
    the statistics hold the row's own label: leave-one-out's rate (S - y) / (n - 1) gives it away (an
    out-of-fold AUC near 1 on training rows, which the validation split would not confirm). The k-fold
    encoding's own fold is left out too, a weak known tell (the fold's sum holds the row's label: the
    row's rate is a little lower when it is positive): bounded here; the causal encoding has none."""
    pytest.importorskip("sklearn")
    log, rng = _noise_log()
    x = ItemStats(log, 100, ("ctr",), encoding=encoding).training()
    auc = _out_of_fold_auc(np.column_stack([x, log.item]), log.labels[:, 0], rng)
    if encoding == "loo":
        assert auc > 0.75  # coin flips predicted: implausible
    elif encoding == "kfold":
        assert auc < 0.58
    else:
        assert auc < 0.54  # 3,000 coin flips: the AUC's std is ~0.01


def test_item_encodings_keep_the_own_label_out_exactly():
    log, _ = _noise_log(n_items=20, per_item=10)
    flipped = copy.deepcopy(log)
    r = 7
    flipped.labels[r] = 1 - flipped.labels[r]
    priors = (log.labels.mean(axis=0), 0.0)  # pinned: the prior is one number for every row
    for enc in ("causal", "kfold"):
        a = ItemStats(log, 20, ("ctr",), encoding=enc, priors=priors).training()
        b = ItemStats(flipped, 20, ("ctr",), encoding=enc, priors=priors).training()
        np.testing.assert_array_equal(a[r], b[r])  # the row's own label is not in its features
        assert not np.array_equal(a, b)  # and others see it
    a = ItemStats(log, 20, ("ctr",)).held_out(np.array([log.item[r], -1, 99]))
    # An unknown item or no item: the priors (count 0).
    assert a[1, 0] == a[2, 0] == pytest.approx(log.labels.mean()) and a[1, 1] == 0.0


def test_parquet_declared_columns_give_the_built_in_features(ml_dir, tmp_path):
    """The tiny MovieLens written to Parquet and read back from its declared columns (no per-event genres:
    a history item's genres come from the item -> attribute table) gives the very same matrices."""
    import tomllib

    from gem_train.config import ParquetConfig, config_from_dict
    from gem_train.data.parquet.export import parquet_section, write_split
    from gem_train.data.parquet.reader import ParquetSource

    ml_cfg = MovieLensConfig(max_len=1000, eval_fraction=0.2, valid_fraction=0.2, history_genres=False)
    builtin = MovieLens100K(ml_cfg, events=read_movielens_100k(ml_dir))
    out = tmp_path / "pq"
    splits = {"train": builtin.train_rows, "valid": builtin.valid_rows, "test": builtin.eval_rows}
    for split, rows in splits.items():
        chunks = [builtin.make_batch(rows[i : i + 7]) for i in range(0, len(rows), 7)]
        write_split(chunks, builtin.spec, out / split / "part-00000.parquet")
    text = parquet_section(builtin.spec, str(out), {k: f"{k}/*.parquet" for k in splits}, shuffle="global")
    pcfg = config_from_dict(ParquetConfig, tomllib.loads(text)["data"]["parquet"], prefix="data.parquet")
    source = ParquetSource(pcfg, seed=0)
    assert source.spec == builtin.spec
    mats = []
    for src in (builtin, source):
        b = GbdtFeatureBuilder(src, GbdtConfig(like_action=4), 4, 4, 8, src.num_batches("train", 4))
        b.fit()
        assert [a.name for a in b.log.attributes] == ["ad_genres", "ad_year"]
        mats.append((b.names, b.train_matrix(), b.held_out_matrix("valid"), b.held_out_matrix("test")))
    (na, *ma), (nb, *mb) = mats
    assert na == nb and "history.ad_genres.like_rate" in na and "item.mean_action" in na
    for x, y in zip(ma, mb, strict=True):
        np.testing.assert_array_equal(x.x, y.x)
        np.testing.assert_array_equal(x.y, y.y)


def _tiny_synthetic(*extra):
    return [
        "data.synthetic.num_users=300", "data.synthetic.num_items=200", "data.synthetic.max_len=16",
        "data.synthetic.eval_examples=512", "data.synthetic.valid_examples=512", "data.batch_size=256",
        "data.eval_batch_size=256", "data.synthetic.train_examples_per_epoch=2048", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("library", ["xgboost", "sklearn"])
def test_baseline_gbdt_command_end_to_end(tmp_path, capsys, library):
    pytest.importorskip(library)
    import json

    from gem_train.cli import main

    rc = main(["baseline", "--model", "gbdt", "--config", "tiny-cpu", *_tiny_synthetic(
        f"model.gbdt.library={library}", f"run.out_dir={tmp_path}"
    )])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "test NE" in out and library in out
    (path,) = tmp_path.glob("*-gbdt-*/eval.json")
    doc = json.loads(path.read_text())
    assert doc["model"] == "gbdt" and doc["library"] == library
    assert set(doc["tasks"]) == set(doc["valid"]) == set(doc["params"]) == {"ctr", "cvr"}
    for task in doc["tasks"]:
        assert 1 <= doc["params"][task]["n_trees"] <= 2000
    # ctr is labelled on every impression (cvr only on clicks).
    assert doc["tasks"]["ctr"]["count"] == 512 and doc["valid"]["ctr"]["count"] == 512
    # The trees learn something from 2,048 impressions (the synthetic click depends on the features).
    assert doc["tasks"]["ctr"]["ne"] < 1.0 and doc["tasks"]["ctr"]["auc"] > 0.55
    assert "item.ctr_rate" in doc["features"] and "history.ad_category.like_rate" in doc["features"]


def test_bad_inputs_give_clear_errors(tmp_path, monkeypatch):
    from gem_train.evaluation.baselines.gbdt import run_gbdt
    from gem_train.loop.build import build_source

    cfg = load_config("tiny-cpu", _tiny_synthetic("data.synthetic.valid_examples=0"))
    with pytest.raises(ConfigError, match="validation split"):
        run_gbdt(cfg, build_source(cfg))
    with pytest.raises(ConfigError, match="expected one of"):
        load_config("tiny-cpu", ["model.gbdt.library=lightgbm"])  # the benchmark's, not gem-train's
    cfg = load_config("tiny-cpu", _tiny_synthetic("model.gbdt.item_feature=user_segment"))
    with pytest.raises(ConfigError, match="item vocabularies"):
        run_gbdt(cfg, build_source(cfg))
    cfg = load_config("tiny-cpu", _tiny_synthetic("model.gbdt.item_feature=nope"))
    with pytest.raises(ConfigError, match="not a single-id sparse feature"):
        run_gbdt(cfg, build_source(cfg))
    import builtins

    real_import = builtins.__import__

    def no_xgboost(name, *a, **k):
        if name == "xgboost":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_xgboost)
    cfg = load_config("tiny-cpu", _tiny_synthetic())
    with pytest.raises(ConfigError, match=r"needs xgboost-cpu: pip install 'gem-train\[gbdt\]'"):
        run_gbdt(cfg, build_source(cfg))
