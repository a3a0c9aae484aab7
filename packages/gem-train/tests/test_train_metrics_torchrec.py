"""gem-train's metrics against torchrec.metrics (the anchor) on the same data, and GAUC by its definition.

Fresh random predictions (continuous: no ties, where torchrec's trapezoid AUC and the rank statistic
agree exactly), labels correlated with them, users with ragged example counts (1 example, a single
class, many examples).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchrec.metrics.auc import _compute_auc_helper, compute_auc
from torchrec.metrics.calibration import compute_calibration, get_calibration_states
from torchrec.metrics.ne import compute_logloss, compute_ne, get_ne_states

from gem_train.evaluation.metrics import auc, binary_metrics, gauc

ETA = 1e-12  # torchrec's clamp of predictions (ours: 1e-15): no prediction here is that close to 0 or 1


def _data(seed: int, n: int = 3000, users: int = 200):
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.02, 0.98, n)
    y = (rng.uniform(size=n) < p**1.5).astype(np.float64)
    g = rng.zipf(1.5, n) % users  # ragged: some users with one example, a few with hundreds
    return p, y, g


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ne_auc_calibration_log_loss_equal_torchrec(seed):
    p, y, _ = _data(seed)
    tp, ty, tw = (torch.from_numpy(a)[None] for a in (p, y, np.ones_like(p)))
    m = binary_metrics(p, y)
    st = get_ne_states(ty, tp, tw, ETA)
    ne = compute_ne(
        st["cross_entropy_sum"], st["weighted_num_samples"], st["pos_labels"], st["neg_labels"], ETA
    )
    # torchrec's log loss is a sum in bits over the examples / n; ours is the mean in nats.
    ll = compute_logloss(st["cross_entropy_sum"], st["pos_labels"], st["neg_labels"], ETA) * math.log(2)
    cal = get_calibration_states(ty, tp, tw)
    assert m.ne == pytest.approx(float(ne), rel=1e-12)
    assert m.log_loss == pytest.approx(float(ll), rel=1e-12)
    cal_tr = compute_calibration(cal["calibration_num"], cal["calibration_denom"])
    assert m.calibration == pytest.approx(float(cal_tr), rel=1e-12)
    assert m.auc == pytest.approx(float(compute_auc(1, [tp], [ty], [tw])), rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_gauc_is_the_example_weighted_mean_of_torchrec_per_user_aucs(seed):
    p, y, g = _data(seed)
    num = den = 0.0
    skipped = 0
    for u in np.unique(g):
        sel = g == u
        if 0 < y[sel].sum() < sel.sum():
            t = [torch.from_numpy(a[sel]) for a in (p, y, np.ones_like(p))]
            num += sel.sum() * float(_compute_auc_helper(*t))
            den += sel.sum()
        else:
            skipped += 1
    assert skipped > 0 and den < len(p)  # one-class users exist and are left out
    assert gauc(p, y, g) == pytest.approx(num / den, rel=1e-9)
    assert binary_metrics(p, y, groups=g).gauc == gauc(p, y, g)
    # One group holding everything: GAUC is the AUC; groups with one class only: undefined.
    assert gauc(p, y, np.zeros_like(g)) == pytest.approx(auc(p, y), rel=1e-12)
    assert math.isnan(gauc(p[y == 1], y[y == 1], g[y == 1]))
    with pytest.raises(ValueError, match="groups"):
        gauc(p, y, g[:-1])
