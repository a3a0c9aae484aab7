"""Metrics against scikit-learn and plain numpy on fixed and random data."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from gem_train.evaluation.metrics import (
    auc,
    binary_entropy,
    binary_metrics,
    calibration,
    log_loss,
    normalized_entropy,
    reliability_bins,
)


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.01, 0.99, n)
    y = (rng.uniform(size=n) < p).astype(np.float64)
    return p, y


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_loss_and_auc_match_sklearn(seed):
    p, y = _data(5000, seed)
    assert log_loss(p, y) == pytest.approx(sk_log_loss(y, p), rel=1e-12)
    assert auc(p, y) == pytest.approx(roc_auc_score(y, p), rel=1e-12)


def test_auc_with_ties_matches_sklearn():
    rng = np.random.default_rng(3)
    # Only 7 distinct scores over 2000 examples: almost every pair is tied.
    p = rng.integers(0, 7, 2000) / 7.0
    y = (rng.uniform(size=2000) < 0.3).astype(np.float64)
    assert auc(p, y) == pytest.approx(roc_auc_score(y, p), rel=1e-12)
    # All scores equal: every pair is a tie, AUC is exactly 1/2.
    assert auc(np.full(10, 0.4), np.array([0, 1] * 5)) == 0.5


def test_auc_small_hand_computed():
    # Pairs (pos, neg): (0.8,0.1) win, (0.8,0.4) win, (0.4,0.1) win, (0.4,0.4) tie -> (3 + 0.5) / 4.
    assert auc([0.1, 0.4, 0.4, 0.8], [0, 0, 1, 1]) == pytest.approx(3.5 / 4)
    assert math.isnan(auc([0.1, 0.2], [1, 1]))


def test_ne_definition_and_explicit_base_rate():
    p, y = _data(4000, 4)
    q = y.mean()
    h = -(q * np.log(q) + (1 - q) * np.log(1 - q))
    assert normalized_entropy(p, y) == pytest.approx(sk_log_loss(y, p) / h, rel=1e-12)
    # Predicting the base rate for everyone gives NE exactly 1.
    assert normalized_entropy(np.full_like(y, q), y) == pytest.approx(1.0, rel=1e-12)
    # An explicit base rate changes only the denominator.
    assert normalized_entropy(p, y, base_rate=0.2) == pytest.approx(sk_log_loss(y, p) / binary_entropy(0.2))
    with pytest.raises(ValueError, match="undefined"):
        normalized_entropy([0.5, 0.5], [1, 1])


def test_calibration_and_reliability():
    p, y = _data(3000, 5)
    assert calibration(p, y) == pytest.approx(p.sum() / y.sum())
    mp, rate, cnt = reliability_bins(p, y, n_bins=5)
    for b in range(5):
        sel = (p >= b / 5) & (p < (b + 1) / 5)
        assert cnt[b] == sel.sum()
        assert mp[b] == pytest.approx(p[sel].mean())
        assert rate[b] == pytest.approx(y[sel].mean())
    assert cnt.sum() == p.size


def test_binary_metrics_accepts_torch_and_checks_inputs():
    p, y = _data(1000, 6)
    m = binary_metrics(torch.tensor(p, dtype=torch.float32), torch.tensor(y))
    assert m.count == 1000
    assert m.auc == pytest.approx(roc_auc_score(y, p.astype(np.float32)), rel=1e-9)
    assert m.ne == pytest.approx(normalized_entropy(p.astype(np.float32), y), rel=1e-9)
    with pytest.raises(ValueError, match="probabilities"):
        log_loss([1.5], [1])
    with pytest.raises(ValueError, match="labels"):
        log_loss([0.5], [2])
    with pytest.raises(ValueError, match="NaN"):
        log_loss([float("nan")], [1])
    with pytest.raises(ValueError, match="differ"):
        log_loss([0.5, 0.5], [1])
