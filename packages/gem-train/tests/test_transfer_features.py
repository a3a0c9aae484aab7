"""Stored representations as student features (LoopFM, issue 36) and the synthetic data's time windows and
drift (the stale-teacher setting)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gem_train.config import SyntheticConfig
from gem_train.data.synthetic import DRIFT_DIRECTIONS, T0, WINDOW_SECONDS, SyntheticAds
from gem_train.transfer.predict import run_predict
from gem_train.transfer.source import DistillSource

sys.path.insert(0, str(Path(__file__).parent))
from transfer_fixtures import read_split, small_config, train_checkpoint


def test_embeddings_are_the_standardised_stored_rows_appended_to_the_dense_features(tmp_path):
    from gem_train.loop.build import build_source

    ckpt = train_checkpoint(tmp_path / "t", steps=1)
    out = tmp_path / "p"
    run_predict(small_config(tmp_path), ckpt, out, embeddings=True, train_batches=2, progress=False)
    cfg = small_config(tmp_path, "model.arch=mlp", "distill.embeddings=true", f"distill.teacher={out}")
    plain = build_source(cfg)
    src = DistillSource(cfg, plain, torch.device("cpu"), training=True)
    assert src.spec.n_dense == plain.spec.n_dense + 192
    import json

    stats = json.loads((out / "manifest.json").read_text())["splits"]["train"]
    mean, std = np.asarray(stats["embedding_mean"]), np.asarray(stats["embedding_std"])
    for split, j, bs in (("test", 2, 32), ("valid", 1, 32), ("train", 1, 16)):
        stored = read_split(out, split)
        lb = src.get(split, j, bs)
        raw = plain.get(split, j, bs).batch
        n = raw.batch_size
        assert torch.equal(lb.batch.dense[:, : raw.dense.shape[1]], raw.dense)
        want = (stored["embedding"][j * bs : j * bs + n] - mean) / np.maximum(std, 1e-6)
        np.testing.assert_allclose(
            lb.batch.dense[:, raw.dense.shape[1] :].numpy(), want, rtol=1e-5, atol=1e-5
        )


def test_history_embeddings_are_the_mean_over_the_users_past_events(tmp_path):
    from gem_train.data.movielens import DataFetchError
    from gem_train.loop.build import build_source

    ml = ('data.source="movielens-100k"', "data.movielens.max_users=10", "data.movielens.max_len=6")
    try:
        ckpt = train_checkpoint(tmp_path / "t", *ml, steps=1)
    except DataFetchError as e:
        pytest.skip(f"MovieLens-100K not available: {e}")
    out = tmp_path / "p"
    run_predict(small_config(tmp_path, *ml), ckpt, out, embeddings=True, progress=False)
    cfg = small_config(tmp_path, *ml, "distill.embedding_history=true", f"distill.teacher={out}")
    plain = build_source(cfg)
    src = DistillSource(cfg, plain, torch.device("cpu"), training=False)
    d = 192
    assert src.spec.n_dense == plain.spec.n_dense + d
    stored = {s: read_split(out, s) for s in ("train", "valid", "test")}
    by_event = {}
    for cols in stored.values():
        for e, v in zip(cols["event"], cols["embedding"]):
            by_event[int(e)] = v
    import json

    stats = json.loads((out / "manifest.json").read_text())["splits"]["train"]
    mean, std = np.asarray(stats["embedding_mean"]), np.maximum(np.asarray(stats["embedding_std"]), 1e-6)
    lb = src.get("test", 0, 32)
    rows = plain.rows("test", 0, 32)
    got = lb.batch.dense[:, -d:].numpy()
    ev = plain.ev
    for i, r in enumerate(rows):  # the history of event r: the user's events with a strictly earlier time
        start = ev.user_start[ev.user[r]]
        hist = [e for e in range(start, r + 1) if ev.timestamp[e] < ev.timestamp[r]][-6:]
        want = np.mean([(by_event[e] - mean) / std for e in hist], 0) if hist else np.zeros(d)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    assert (np.abs(got).sum(1) > 0).any()


def test_embedding_history_needs_movielens(tmp_path):
    from gem_train.config import ConfigError
    from gem_train.loop.build import build_source

    cfg = small_config(tmp_path, "distill.embedding_history=true", "distill.teacher=x")
    with pytest.raises(ConfigError, match="movielens"):
        DistillSource(cfg, build_source(cfg), torch.device("cpu"), training=False)


# ----------------------------------------------------------------------------------------------------------
# Synthetic windows and drift
# ----------------------------------------------------------------------------------------------------------


def _cfg(**kw):
    return SyntheticConfig(num_users=300, num_items=200, max_len=8, **kw)


def test_window_zero_without_drift_is_the_data_as_before_and_windows_move_in_time():
    base = SyntheticAds(_cfg(), seed=3).make_batch("train", 2, 64)
    again = SyntheticAds(_cfg(drift=0.0, window=0, stream=0), seed=3).make_batch("train", 2, 64)
    assert torch.equal(base.batch.labels, again.batch.labels) and np.array_equal(
        base.true_probs, again.true_probs
    )
    later = SyntheticAds(_cfg(window=2), seed=3).make_batch("train", 2, 64)
    t = later.batch.request_time.numpy()
    assert (t >= T0 + 2 * WINDOW_SECONDS).all() and (t < T0 + 3 * WINDOW_SECONDS).all()
    other = SyntheticAds(_cfg(stream=1), seed=3).make_batch("train", 2, 64)
    assert not torch.equal(other.batch.dense, base.batch.dense)  # another sample of the same window
    t = other.batch.request_time.numpy()
    assert (t >= T0).all() and (t < T0 + WINDOW_SECONDS).all()
    fixed = SyntheticAds(_cfg(seed=3), seed=99).make_batch("train", 2, 64)  # data.synthetic.seed wins
    assert torch.equal(fixed.batch.dense, base.batch.dense)


def test_drift_moves_the_ground_truth_not_the_features_and_the_floor_uses_each_rows_weights():
    a = SyntheticAds(_cfg(), seed=1).make_batch("test", 0, 4096)
    b = SyntheticAds(_cfg(drift=0.8), seed=1).make_batch("test", 0, 4096)
    assert torch.equal(a.batch.dense, b.batch.dense)  # the same impressions (same random stream)
    assert not np.allclose(a.true_probs[:, 0], b.true_probs[:, 0])
    # The drifted CTR logit, recomputed from the undrifted one's parts: the base shifts by -drift * u.
    u = (b.batch.request_time.numpy() - T0) / WINDOW_SECONDS
    assert DRIFT_DIRECTIONS["user_bias"] == 0.0
    # Labels are drawn from the drifted probabilities: their rate matches within 3 standard errors.
    late = SyntheticAds(_cfg(drift=0.8, window=3), seed=1).make_batch("test", 0, 4096)
    p = late.true_probs[:, 0]
    y = late.batch.labels[:, 0].numpy()
    assert abs(y.mean() - p.mean()) < 3 * np.sqrt((p * (1 - p)).sum()) / len(p)
    # Later windows under drift have a lower base rate (the base logit falls by drift * u).
    early = SyntheticAds(_cfg(drift=0.8, window=0), seed=1).make_batch("test", 0, 4096)
    assert late.true_probs[:, 0].mean() < early.true_probs[:, 0].mean() - 0.05
    assert u.min() >= 0 and u.max() < 1
