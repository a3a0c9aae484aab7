"""The GBDT baseline: causal features from the batch, statistics from the training split only."""

import numpy as np
import pytest

from gem_train.config import MovieLensConfig, load_config
from gem_train.data.movielens import MovieLens100K, read_movielens_100k
from gem_train.evaluation.baselines.gbdt import batch_features, feature_names, fit_train_stats, run_gbdt

pytest.importorskip("sklearn")

USER = "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
ITEM = "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
INTER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"


def _write(d, inter_rows):
    (d / "ml-100k.user").write_text(USER + "1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\t94043\n")
    (d / "ml-100k.item").write_text(
        ITEM + "1\tA\t1995\tAnimation Comedy\n2\tB\tunkonwn\tAction\n3\tC\t1990\tDrama\n"
    )
    (d / "ml-100k.inter").write_text(INTER + "".join(inter_rows))


def _dataset(tmp_path):
    rng = np.random.default_rng(0)
    rows = [f"1\t{1 + k % 3}\t{1 + k % 5}\t{3600 * (k // 2 + 1)}\n" for k in rng.permutation(20)]
    rows += [f"2\t{1 + k % 2}\t{5 - k % 4}\t{7200 * (k + 1)}\n" for k in range(9)]
    _write(tmp_path, rows)
    cfg = MovieLensConfig(max_len=6, eval_fraction=0.2, valid_fraction=0.2)
    return cfg, read_movielens_100k(tmp_path)


def _train_batches(ds):
    return [ds.get("train", i, 1).batch for i in range(ds.num_batches("train", 1))]


def test_popularity_and_counts_come_from_the_training_split_only(tmp_path):
    cfg, ev = _dataset(tmp_path)
    ds = MovieLens100K(cfg, events=ev)
    stats = fit_train_stats(_train_batches(ds), ds.spec)
    assert stats.examples == len(ds.train_rows)
    np.testing.assert_array_equal(stats.counts["ad_id"], np.bincount(ev.item[ds.train_rows], minlength=4))
    np.testing.assert_array_equal(stats.counts["user_id"], np.bincount(ev.user[ds.train_rows], minlength=3))
    # Other items in the held-out events: the statistics do not move.
    ev2 = read_movielens_100k(tmp_path)
    held = np.concatenate([ds.valid_rows, ds.eval_rows])
    ev2.item[held] = 3
    ds2 = MovieLens100K(cfg, events=ev2)
    stats2 = fit_train_stats(_train_batches(ds2), ds2.spec)
    for name, c in stats.counts.items():
        np.testing.assert_array_equal(c, stats2.counts[name], err_msg=name)


def test_features_of_an_example_use_only_earlier_events_and_its_own_row(tmp_path):
    cfg, ev = _dataset(tmp_path)
    ds = MovieLens100K(cfg, events=ev)
    stats = fit_train_stats(_train_batches(ds), ds.spec)
    names, categorical = feature_names(ds.spec)
    # Held-out examples (a training example's rates leave its own label out: its label is no feature of
    # it either, checked below with training=True).
    rows = np.concatenate([ds.valid_rows, ds.eval_rows])
    x = batch_features(ds.make_batch(rows), ds.spec, stats)
    assert x.shape == (len(rows), len(names)) == (len(rows), len(categorical))
    # Alone or in a batch: the same features (nothing from the other examples of the batch).
    for k, r in enumerate(rows):
        np.testing.assert_array_equal(batch_features(ds.make_batch(np.array([r])), ds.spec, stats)[0], x[k])
    # Every rating at or after an example's time changed (its own label too): its features do not change.
    for k, r in enumerate(rows):
        ev2 = read_movielens_100k(tmp_path)
        late = (ev2.user == ev2.user[r]) & (ev2.timestamp >= ev2.timestamp[r])
        ev2.rating[late] = 6 - ev2.rating[late]
        ds2 = MovieLens100K(cfg, events=ev2)
        stats2 = fit_train_stats(_train_batches(ds2), ds2.spec)
        got = batch_features(ds2.make_batch(np.array([r])), ds2.spec, stats2)[0]
        np.testing.assert_array_equal(got, x[k], err_msg=str(r))
    # A training example's own label does not reach its features (counts count occurrences, not labels).
    batches = _train_batches(ds)
    k = 3
    one = batches[k]
    flipped = ds.make_batch(ds.rows("train", k, 1))
    flipped.labels = 1.0 - flipped.labels
    stats_flipped = fit_train_stats([*batches[:k], flipped, *batches[k + 1 :]], ds.spec)
    assert not np.array_equal(stats_flipped.positives["ad_id"], stats.positives["ad_id"])
    np.testing.assert_array_equal(
        batch_features(one, ds.spec, stats, training=True),
        batch_features(flipped, ds.spec, stats_flipped, training=True),
    )
    # The rating histogram of the history is what the history holds (user 1's last test event).
    r = ds.eval_rows[0]
    hist = ev.rating[(ev.user == ev.user[r]) & (ev.timestamp < ev.timestamp[r])][-cfg.max_len :]
    k = int(np.flatnonzero(rows == r)[0])
    for a in range(1, 6):
        assert x[k, names.index(f"history.share_action_{a}")] == pytest.approx(np.mean(hist == a))
    assert x[k, names.index("history.log_len")] == pytest.approx(np.log1p(len(hist)))


def test_run_gbdt_chooses_its_trees_on_validation_and_reports_the_test_split(tmp_path):
    cfg = load_config(
        "tiny-cpu",
        [
            "data.synthetic.num_users=300", "data.synthetic.num_items=200", "data.synthetic.max_len=16",
            "data.synthetic.eval_examples=512", "data.synthetic.valid_examples=512", "data.batch_size=256",
            "data.eval_batch_size=256",
        ],
    )  # fmt: skip
    from gem_train.loop.build import build_source

    res = run_gbdt(cfg, build_source(cfg), grid=((0.1, 15, 20, 1.0),), max_iter=15, max_train_batches=8)
    for task in cfg_tasks(res):
        p = res.params[task]
        assert 1 <= p["n_trees"] <= 15
        assert 0 < res.test[task].count <= 512 and 0 < res.valid[task].count <= 512
    # The ctr label is on every example; trees learn something from 8 batches.
    assert res.test["ctr"].count == 512 and res.test["ctr"].ne < 1.0 and res.test["ctr"].auc > 0.55


def cfg_tasks(res):
    assert res.test and set(res.test) == set(res.valid) == set(res.params)
    return list(res.test)
