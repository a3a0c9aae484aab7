"""MovieLens-100K: parsing, the CTR task and its time split on a hand-made file; the real data on a slice."""

import os
import re

import numpy as np
import pytest
import torch

from gem_train.config import MovieLensConfig
from gem_train.data.movielens import (
    DataFetchError,
    MovieLens100K,
    MovieLensFormatError,
    fetch_movielens_100k,
    read_movielens_100k,
)

USER = "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
ITEM = "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
INTER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"


def _write(d, inter_rows, users=None, items=None):
    (d / "ml-100k.user").write_text(USER + (users or "1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\t94043\n"))
    (d / "ml-100k.item").write_text(
        ITEM
        + (items or "1\tToy Story\t1995\tAnimation Comedy\n2\tHeat\tunkonwn\tAction\n3\tX\t1990\tDrama\n")
    )
    (d / "ml-100k.inter").write_text(INTER + "".join(inter_rows))


def test_ctr_task_split_and_histories(tmp_path):
    # User 1: 10 events (times 10..100, out of order in the file); user 2: 3 events.
    rows = [f"1\t{1 + k % 3}\t{1 + k % 5}\t{10 * (10 - k)}\n" for k in range(10)]
    rows += ["2\t3\t5\t7\n", "2\t1\t2\t5\n", "2\t2\t4\t9\n"]
    _write(tmp_path, rows)
    ev = read_movielens_100k(tmp_path)
    assert ev.num_users == 3 and ev.num_items == 4
    assert list(ev.timestamp[ev.user == 1]) == sorted(ev.timestamp[ev.user == 1])
    ds = MovieLens100K(MovieLensConfig(max_len=4, eval_fraction=0.1, valid_fraction=0.0), events=ev)
    assert len(ds.valid_rows) == 0 and ds.num_batches("valid", 4) == 0
    # The last 10% (at least one) of each user's events, by time, are evaluated.
    assert list(ev.timestamp[ds.eval_rows]) == [100, 9]
    assert len(ds.train_rows) == 11
    b = ds.make_batch(ds.eval_rows)
    b.validate(ds.spec)
    # Label = rating >= 4.
    assert b.labels[:, 0].tolist() == [float(ev.rating[r] >= 4) for r in ds.eval_rows]
    hist = b.sequences["history"]
    # User 1's eval event sees its 4 most recent earlier events, oldest first; ratings are the actions.
    assert hist.lengths.tolist() == [4, 2]
    u1 = np.flatnonzero(ev.user == 1)
    assert hist.timestamps[:4].tolist() == ev.timestamp[u1][5:9].tolist()
    assert hist.action_ids[:4].tolist() == ev.rating[u1][5:9].tolist()
    assert bool((hist.timestamps[:4] < b.request_time[0]).all())
    # A user's first event has an empty history.
    first = ds.make_batch(np.array([u1[0]]))
    assert first.sequences["history"].lengths.tolist() == [0]
    # Training batches cover the training split once per epoch, reshuffled by epoch.
    e0 = np.concatenate([ds.rows("train", k, 5) for k in range(2)])
    e1 = np.concatenate([ds.rows("train", 2 + k, 5) for k in range(2)])
    assert len(set(e0)) == 10 and set(e0) <= set(ds.train_rows) and not np.array_equal(e0, e1)


def test_validation_split_by_time_disjoint_and_without_leakage(tmp_path):
    # User 1: 20 events (times 10..200, shuffled in the file), user 2: 3 events, user 3: 2 events (too few for
    # a validation event: it keeps one training event), ties in time broken by item id.
    rng = np.random.default_rng(0)
    rows = [f"1\t{1 + k % 3}\t{1 + k % 5}\t{10 * (k + 1)}\n" for k in rng.permutation(20)]
    rows += ["2\t3\t5\t7\n", "2\t1\t2\t5\n", "2\t2\t4\t9\n", "3\t1\t4\t50\n", "3\t2\t1\t50\n"]
    users = "1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\t94043\n3\t30\tF\twriter\t10001\n"
    _write(tmp_path, rows, users=users)
    ev = read_movielens_100k(tmp_path)
    ds_test_only = MovieLens100K(MovieLensConfig(max_len=64, valid_fraction=0.0), events=ev)
    ds = MovieLens100K(MovieLensConfig(max_len=64, eval_fraction=0.1, valid_fraction=0.15), events=ev)
    # The test split does not depend on the validation split.
    np.testing.assert_array_equal(ds.eval_rows, ds_test_only.eval_rows)
    train, valid, test = set(ds.train_rows), set(ds.valid_rows), set(ds.eval_rows)
    assert not (train & valid) and not (train & test) and not (valid & test)
    assert train | valid | test == set(range(len(ev.user)))
    # User 1: ceil(0.1 * 20) = 2 test events, ceil(0.15 * 20) = 3 validation events just before them.
    assert list(ev.timestamp[[r for r in ds.eval_rows if ev.user[r] == 1]]) == [190, 200]
    assert list(ev.timestamp[[r for r in ds.valid_rows if ev.user[r] == 1]]) == [160, 170, 180]
    # User 2: 1 test, 1 validation, 1 training event; user 3: 1 test, 0 validation, 1 training event.
    for u, (n_tr, n_va, n_te) in {1: (15, 3, 2), 2: (1, 1, 1), 3: (1, 0, 1)}.items():
        got = [int(np.sum(ev.user[list(part)] == u)) for part in (train, valid, test)]
        assert got == [n_tr, n_va, n_te], (u, got)
    # Time order within each user: every training event < every validation event < every test event.
    for u in (1, 2, 3):
        t = [ev.timestamp[sorted(r for r in part if ev.user[r] == u)] for part in (train, valid, test)]
        if len(t[1]):
            assert t[0].max() <= t[1].min() and t[1].max() <= t[2].min()
        assert t[0].max() <= t[2].min()
    # Training popularity counts training events only.
    assert ds.item_pop.sum() == len(ds.train_rows)
    # No leakage: the history of each validation/test event is exactly the user's events at earlier times,
    # oldest first (all of them: max_len 64), never the event itself, a later one or one of the same second
    # (user 3's test event at t=50 has an empty history: its training event is also at t=50).
    for split in ("valid", "test"):
        rows_ = ds.rows(split, 0, 1024)
        hist = ds.get(split, 0, 1024).batch.sequences["history"]
        offs = hist.offsets.tolist()
        for k, r in enumerate(rows_):
            expect = np.arange(ev.user_start[ev.user[r]], r)
            expect = expect[ev.timestamp[expect] < ev.timestamp[r]]
            assert hist.item_ids[offs[k] : offs[k + 1]].tolist() == ev.item[expect].tolist()
            assert hist.timestamps[offs[k] : offs[k + 1]].tolist() == ev.timestamp[expect].tolist()
            assert r not in expect
    # Held-out splits come in a fixed order; asking past the end is an error naming the split.
    np.testing.assert_array_equal(np.concatenate([ds.rows("valid", k, 2) for k in range(2)]), ds.valid_rows)
    with pytest.raises(IndexError, match="valid batch 2 out of range"):
        ds.rows("valid", 2, 2)
    with pytest.raises(ValueError, match="split must be one of"):
        ds.rows("eval", 0, 2)  # the old name of the test split


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("1\t2\t3\n", "record 3: expected 4 tab-separated fields"),
        ("1\tabc\t3\t10\n", "record 3: item_id 'abc' is not an integer"),
        ("1\t2\t9\t10\n", r"record 3: rating 9 outside \[1, 5\]"),
        ("7\t2\t3\t10\n", "record 3: user_id 7 outside"),
    ],
)
def test_corrupt_record_names_file_and_record(tmp_path, row, message):
    _write(tmp_path, ["1\t1\t4\t5\n", row])
    with pytest.raises(MovieLensFormatError, match=f"ml-100k.inter: {message}"):
        read_movielens_100k(tmp_path)


def test_bad_header_and_missing_file(tmp_path):
    _write(tmp_path, ["1\t1\t4\t5\n"])
    (tmp_path / "ml-100k.user").write_text("id\tage\n1\t2\n")
    with pytest.raises(MovieLensFormatError, match=r"ml-100k.user: record 1 \(header\)"):
        read_movielens_100k(tmp_path)
    (tmp_path / "ml-100k.user").unlink()
    with pytest.raises(MovieLensFormatError, match="file missing"):
        read_movielens_100k(tmp_path)


# What pip prints when the index cannot be reached: its retries (5 by default) name the connection error
# before "Could not find a version". Without such a line (e.g. PIP_RETRIES=0) the failure is not told from a
# bug, and fails.
_NETWORK_ERROR = re.compile(
    r"NewConnectionError|ConnectTimeout|ReadTimeout|Max retries exceeded|Network is unreachable|"
    r"Temporary failure in name resolution|Name or service not known|Connection refused|ProxyError"
)


@pytest.fixture(scope="module")
def real_ml100k(tmp_path_factory):
    cache = os.environ.get("GEM_CACHE_DIR") or str(tmp_path_factory.mktemp("gem-cache"))
    try:
        return fetch_movielens_100k(cache)
    except DataFetchError as e:
        # Only an unreachable index skips (the data cannot be had here); any other failure is a bug.
        if not _NETWORK_ERROR.search(str(e)):
            raise
        pytest.skip(f"MovieLens-100K not fetched, no network (pip download --no-deps recbole==1.2.1): {e}")


def test_real_movielens_slice(real_ml100k):
    ev = read_movielens_100k(real_ml100k, max_users=50)
    assert set(np.unique(ev.user)) <= set(range(1, 51)) and len(ev.user) > 1000
    assert ev.num_users == 944 and ev.num_items == 1683 and ev.num_genres == 19
    ds = MovieLens100K(MovieLensConfig(max_len=32), events=ev)
    for split in ("train", "test"):
        lb = ds.get(split, 0, 256)
        lb.batch.validate(ds.spec)
        assert torch.isfinite(lb.batch.dense).all()
    # Every user contributes its last ~10% to evaluation.
    per_user = np.bincount(ev.user[ds.eval_rows])
    counts = np.bincount(ev.user)
    ok = counts > 0
    assert np.all(per_user[ok] == np.ceil(0.1 * counts[ok]))
    # ... and the 10% before that to validation (users have >= 20 ratings: never clipped).
    per_user_valid = np.bincount(ev.user[ds.valid_rows], minlength=len(counts))
    assert np.all(per_user_valid[ok] == np.ceil(0.1 * counts[ok]))
    lb = ds.get("valid", 0, 256)
    lb.batch.validate(ds.spec)
    last_train = np.zeros(len(counts), np.int64)
    np.maximum.at(last_train, ev.user[ds.train_rows], ev.timestamp[ds.train_rows])
    first_valid = np.full(len(counts), np.iinfo(np.int64).max)
    np.minimum.at(first_valid, ev.user[ds.valid_rows], ev.timestamp[ds.valid_rows])
    assert np.all(last_train[ok] <= first_valid[ok])
    assert 0.3 < ds.label.mean() < 0.7


@pytest.mark.parametrize(
    ("file", "row", "message"),
    [
        ("inter", "1\t1\tinf\t5\n", "record 3: rating 'inf' is not an integer"),
        ("inter", "1\t1\t4\t1e400\n", "record 3: timestamp '1e400' is not an integer"),
        (
            "inter",
            "1\t1\t4\t99999999999999999999999\n",
            r"record 3: timestamp 99999999999999999999999 outside",
        ),
        ("inter", "1\t1\t4\t-3\n", r"record 3: timestamp -3 outside \[0, 4102444800\]"),
        ("inter", "1\t1\tnan\t5\n", "record 3: rating 'nan' is not an integer"),
        (
            "inter",
            "10000000000000\t1\t4\t5\n",
            r"record 3: user_id 10000000000000 outside \[1, 2\] \(no such user",
        ),
        (
            "inter",
            "3\t1\t4\t5\n",
            r"record 3: user_id 3 outside \[1, 2\] \(no such user in \S*ml-100k.user\)",
        ),
        ("inter", "1\t1e13\t4\t5\n", r"record 3: item_id 1e13 outside \[1, 3\] \(no such item"),
        ("user", "1e13\t30\tF\twriter\t10001\n", r"ml-100k.user: record 4: user_id 1e13 outside \[1, 3\]"),
        (
            "user",
            "2\t30\tF\twriter\t10001\n",
            r"ml-100k.user: record 4: duplicate user_id 2 \(also record 3\)",
        ),
        ("item", "2\tCopy\t1990\tDrama\n", r"ml-100k.item: record 5: duplicate item_id 2 \(also record 3\)"),
        ("user", "3\tinf\tF\twriter\t10001\n", r"ml-100k.user: record 4: age 'inf' is not an integer"),
    ],
)
def test_malformed_records_name_file_and_line(tmp_path, file, row, message):
    """Overflowing, infinite and out-of-range values, unknown users and duplicate ids: MovieLensFormatError
    naming the file and the record, never OverflowError or a huge allocation."""
    users = "1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\t94043\n"
    items = "1\tToy Story\t1995\tAnimation Comedy\n2\tHeat\tunkonwn\tAction\n3\tX\t1990\tDrama\n"
    inter = ["1\t1\t4\t5\n"]
    if file == "inter":
        inter.append(row)
    elif file == "user":
        users += row
    else:
        items += row
    _write(tmp_path, inter, users=users, items=items)
    with pytest.raises(MovieLensFormatError, match=message):
        read_movielens_100k(tmp_path)


def test_the_recbole_wheel_is_checked_against_its_known_sha256(tmp_path):
    """A wheel with the right files but not the released bytes is refused before anything is extracted; a
    cache whose files differ from the released ones is not trusted either."""
    import zipfile

    from gem_train.data.movielens import DataFetchError

    fake = tmp_path / "recbole-1.2.1-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as z:
        for name, body in (("inter", INTER + "1\t1\t4\t5\n"), ("user", USER), ("item", ITEM)):
            z.writestr(f"recbole/dataset_example/ml-100k/ml-100k.{name}", body)
    with pytest.raises(DataFetchError, match=r"sha256 [0-9a-f]{64} is not the known sha256 of recbole-1.2.1"):
        fetch_movielens_100k(tmp_path / "cache", wheel=fake)
    assert not (tmp_path / "cache" / "ml-100k").exists()
    # A tampered cache: re-extracted from the (fake, refused) wheel found in the cache directory.
    cached = tmp_path / "cache" / "ml-100k"
    cached.mkdir(parents=True)
    _write(cached, ["1\t1\t4\t5\n"])
    (tmp_path / "cache" / fake.name).write_bytes(fake.read_bytes())
    with pytest.raises(DataFetchError, match="is not the known sha256"):
        fetch_movielens_100k(tmp_path / "cache")


def _features(b):
    """Everything of a batch except its labels (what the model sees)."""
    h = b.sequences["history"]
    return (
        b.dense, b.sparse.values(), b.sparse.lengths(), b.request_time, h.offsets, h.item_ids,
        h.action_ids, h.timestamps, h.event_features,
    )  # fmt: skip


def test_no_event_at_or_after_the_candidate_reaches_its_features(tmp_path):
    # Ties in time (ML-100K users rate several movies in the same second): user 1 rates items 1 and 2 at
    # t=10, item 3 at t=20, items 1 and 2 again at t=30 and t=30, item 3 at t=40 ...
    rows = ["1\t1\t5\t10\n", "1\t2\t1\t10\n", "1\t3\t4\t20\n", "1\t1\t2\t30\n", "1\t2\t5\t30\n"]
    rows += [f"1\t{1 + k % 3}\t{1 + k % 5}\t{40 + 10 * k}\n" for k in range(8)]
    rows += ["2\t3\t5\t7\n", "2\t1\t2\t7\n", "2\t2\t4\t9\n", "2\t3\t1\t12\n"]
    _write(tmp_path, rows, users="1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\tT8H1N\n")
    cfg = MovieLensConfig(max_len=4, eval_fraction=0.2, valid_fraction=0.2)
    ev = read_movielens_100k(tmp_path)
    ds = MovieLens100K(cfg, events=ev)
    # Genres: Animation, Comedy (item 1), Action (2), Drama (3): distinct rows per item.
    assert ev.num_genres == 4 and ds.spec.sequences[0].num_event_features == 4
    assert ev.user_zip[1:].tolist() == [8, 10]  # first digit; a non-numeric code is bucket 10
    everything = np.arange(len(ev.user))
    b = ds.make_batch(everything)
    b.validate(ds.spec)
    h = b.sequences["history"]
    for r in everything:
        # The reference: the user's events strictly earlier in time, the most recent max_len, oldest first.
        same = np.flatnonzero((ev.user == ev.user[r]) & (ev.timestamp < ev.timestamp[r]))[-4:]
        got = slice(int(h.offsets[r]), int(h.offsets[r + 1]))
        assert h.timestamps[got].tolist() == ev.timestamp[same].tolist()
        assert h.item_ids[got].tolist() == ev.item[same].tolist()
        assert h.action_ids[got].tolist() == ev.rating[same].tolist()
        # Each history event's genre row: the genres of that event's own movie, not the candidate's.
        hot = np.zeros((len(same), ev.num_genres), np.float32)
        for k, item in enumerate(ev.item[same]):
            hot[k, ev.item_genres[item]] = 1.0
        assert np.array_equal(h.event_features[got].numpy(), hot), r
    # Perturbation: change every rating at or after a candidate's time (the candidate's own included, so
    # also its label); none of the candidate's features may change. Popularity counts events, not ratings.
    for r in everything:
        late = (ev.user == ev.user[r]) & (ev.timestamp >= ev.timestamp[r])
        ev2 = read_movielens_100k(tmp_path)
        ev2.rating[late] = 6 - ev2.rating[late]
        ds2 = MovieLens100K(cfg, events=ev2)
        one, two = ds.make_batch(np.array([r])), ds2.make_batch(np.array([r]))
        for x, y in zip(_features(one), _features(two), strict=True):
            assert torch.equal(x, y), r


def test_history_genres_off_gives_the_plain_history(tmp_path):
    rows = [f"1\t{1 + k % 3}\t{1 + k % 5}\t{10 * k}\n" for k in range(6)]
    _write(tmp_path, rows)
    ev = read_movielens_100k(tmp_path)
    on = MovieLens100K(MovieLensConfig(max_len=4), events=ev)
    off = MovieLens100K(MovieLensConfig(max_len=4, history_genres=False), events=ev)
    assert off.spec.sequences[0].num_event_features == 0
    everything = np.arange(len(ev.user))
    a, b = on.make_batch(everything), off.make_batch(everything)
    b.validate(off.spec)
    assert b.sequences["history"].event_features is None
    assert a.sequences["history"].event_features is not None
    # Every other feature is the same with or without the history's genres.
    for x, y in zip(_features(a)[:-1], _features(b)[:-1], strict=True):
        assert torch.equal(x, y)


def test_rating_tasks_add_two_labels_from_the_rating_and_change_nothing_else(tmp_path):
    """``rating_tasks``: labels ``[ctr, rating >= 3, rating = 5]`` of each event's own rating, all unmasked;
    the features and the ``ctr`` column are those of the one-task dataset."""
    rows = [f"1\t{1 + k % 3}\t{1 + k % 5}\t{10 * k}\n" for k in range(10)]
    _write(tmp_path, rows)
    ev = read_movielens_100k(tmp_path)
    one = MovieLens100K(MovieLensConfig(max_len=4), events=ev)
    three = MovieLens100K(MovieLensConfig(max_len=4, rating_tasks=True), events=ev)
    assert one.spec.tasks == ("ctr",)
    assert three.spec.tasks == ("ctr", "rating_ge3", "rating_ge5")
    everything = np.arange(len(ev.user))
    a, b = one.make_batch(everything), three.make_batch(everything)
    b.validate(three.spec)
    rating = torch.as_tensor(ev.rating.astype(np.int64))
    want = torch.stack([rating >= 4, rating >= 3, rating == 5], dim=1).to(torch.float32)
    assert torch.equal(b.labels, want)
    assert bool(b.label_mask.all()) and b.label_mask.shape == (len(everything), 3)
    assert torch.equal(a.labels[:, 0], b.labels[:, 0])
    for x, y in zip(_features(a), _features(b), strict=True):
        assert torch.equal(x, y)


def test_item_stats_come_from_the_training_split_and_never_hold_a_rows_own_label(tmp_path):
    """``item_stats``: two more dense columns, the movie's smoothed like rate and mean rating. A held-out
    event sees every training event of its movie (checked against the formula); changing a held-out rating
    moves no event's statistics, and changing a training rating never moves that event's own."""
    rng = np.random.default_rng(0)
    rows = [f"{1 + k % 2}\t{1 + k % 3}\t{rng.integers(1, 6)}\t{10 * k}\n" for k in range(40)]
    _write(tmp_path, rows)
    cfg = MovieLensConfig(max_len=4, eval_fraction=0.2, valid_fraction=0.2, item_stats=True)
    ev = read_movielens_100k(tmp_path)
    ds = MovieLens100K(cfg, events=ev)
    assert ds.spec.n_dense == 10
    plain = MovieLens100K(MovieLensConfig(max_len=4, eval_fraction=0.2, valid_fraction=0.2), events=ev)
    everything = np.arange(len(ev.user))
    b = ds.make_batch(everything)
    b.validate(ds.spec)
    assert torch.equal(b.dense[:, :8], plain.make_batch(everything).dense)
    tr = ds.train_rows
    prior_rate = float(ds.label[tr].mean())
    prior_rating = float(ev.rating[tr].mean())
    for r in np.concatenate([ds.valid_rows, ds.eval_rows]):
        same = tr[ev.item[tr] == ev.item[r]]
        rate = (ds.label[same].sum() + 10 * prior_rate) / (len(same) + 10)
        rating = (ev.rating[same].sum() + 10 * prior_rating) / (len(same) + 10)
        assert b.dense[r, 8].item() == pytest.approx(rate - 0.55, abs=1e-6)
        assert b.dense[r, 9].item() == pytest.approx(rating - 3.5, abs=1e-6)
    for r in np.concatenate([ds.valid_rows[:2], ds.eval_rows[:2]]):
        ev2 = read_movielens_100k(tmp_path)
        ev2.rating[r] = 6 - ev2.rating[r]
        assert np.array_equal(MovieLens100K(cfg, events=ev2).item_stats, ds.item_stats), r
    # Swap the ratings of two training events of different movies, one liked and one not: the priors (the
    # training split's like rate and mean rating) stay, so only what the two labels feed moves.
    moved = 0
    for r in tr[:10]:
        liked = ev.rating[r] >= 4
        r2 = next(x for x in tr if ev.item[x] != ev.item[r] and (ev.rating[x] >= 4) != liked)
        ev2 = read_movielens_100k(tmp_path)
        ev2.rating[[r, r2]] = ev2.rating[[r2, r]]
        other = MovieLens100K(cfg, events=ev2).item_stats
        assert np.array_equal(other[r], ds.item_stats[r]), r
        moved += int(not np.array_equal(other, ds.item_stats))
    assert moved > 0  # the change does reach other folds' rows and the held-out rows


def test_history_crosses_on_movielens_count_the_earlier_events_of_the_movie_and_its_genres(tmp_path):
    """``cross_item_feature = "ad_id"``, ``cross_attribute_feature = "ad_genres"`` on a MovieLens batch: the
    item group counts the user's earlier ratings of the candidate movie, the genre group the genres they
    share with it (an event counts once per shared genre), both within the history window."""
    from gem_model.crosses import history_cross_stats
    from gem_train.config import load_config
    from gem_train.loop.model import build_gem_config

    rows = [f"1\t{1 + k % 3}\t{1 + k % 5}\t{10 * k}\n" for k in range(9)]
    _write(tmp_path, rows)
    ev = read_movielens_100k(tmp_path)
    ds = MovieLens100K(MovieLensConfig(max_len=6), events=ev)
    overrides = [
        'model.overrides.cross_item_feature="ad_id"',
        'model.overrides.cross_attribute_feature="ad_genres"',
        "model.overrides.cross_like_action=4",
    ]
    gc = build_gem_config(load_config("movielens", overrides).model, ds.spec)
    assert gc.cross_attribute_feature == "ad_genres" and gc.cross_like_action == 4
    everything = np.arange(len(ev.user))
    b = ds.make_batch(everything)
    h = b.sequences["history"]
    genres = b.sparse["ad_genres"]
    hot = torch.zeros(len(everything), ev.num_genres)
    hot[torch.repeat_interleave(torch.arange(len(everything)), genres.lengths()), genres.values()] = 1.0
    stats = history_cross_stats(h.item_ids, h.action_ids, h.offsets, b.sparse["ad_id"].values(),
                                like_action=4, num_actions=6, event_features=h.event_features,
                                candidate_attributes=hot)  # fmt: skip
    for r in everything:
        same = np.flatnonzero((ev.user == ev.user[r]) & (ev.timestamp < ev.timestamp[r]))[-6:]
        n_item = int((ev.item[same] == ev.item[r]).sum())
        n_genre = sum(len(set(ev.item_genres[i]) & set(ev.item_genres[ev.item[r]])) for i in ev.item[same])
        assert stats[r, 0].item() == pytest.approx(np.log1p(len(same)) / 4, abs=1e-6)
        assert stats[r, 3].item() == pytest.approx(np.log1p(n_item) / 4, abs=1e-6), r
        assert stats[r, 6].item() == pytest.approx(np.log1p(n_genre) / 4, abs=1e-6), r
