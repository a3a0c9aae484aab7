"""Binary-classification metrics of ads ranking: NE, AUC, calibration, log loss, reliability bins.

All functions take 1-D arrays (numpy or torch, any float dtype) of predicted probabilities ``p`` in [0, 1]
and labels ``y`` in {0, 1}, and compute in float64 on the host: evaluation sets are small next to training,
and float32 sums over millions of examples lose the digits NE comparisons need.

Normalized entropy (He et al. 2014, "Practical Lessons from Predicting Clicks on Ads at Facebook"):
``NE = log loss / H(base rate)``, with ``H(q) = -(q log q + (1-q) log(1-q))``. NE < 1 means the model beats
predicting the base rate for everyone. The base rate is an explicit argument so train and eval NE can share
the training base rate; by default it is the mean label of the data evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "BinaryMetrics",
    "auc",
    "binary_entropy",
    "binary_metrics",
    "calibration",
    "gauc",
    "ground_truth_ne",
    "log_loss",
    "normalized_entropy",
    "reliability_bins",
]

# Probabilities are clipped to [EPS, 1 - EPS] before logs, as sklearn's log_loss does.
EPS = 1e-15


def _as_f64(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().float().cpu().numpy()
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or Inf")
    return a


def _check(p: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    p_, y_ = _as_f64(p, "predictions"), _as_f64(y, "labels")
    if p_.shape != y_.shape:
        raise ValueError(f"predictions {p_.shape} and labels {y_.shape} differ in length")
    if p_.size == 0:
        raise ValueError("no examples to evaluate")
    if np.any((p_ < 0) | (p_ > 1)):
        raise ValueError("predictions must be probabilities in [0, 1]")
    if np.any((y_ != 0) & (y_ != 1)):
        raise ValueError("labels must be 0 or 1")
    return p_, y_


def binary_entropy(q: float) -> float:
    """Entropy (nats) of a Bernoulli(q); 0 at q in {0, 1}."""
    q = float(q)
    if q <= 0.0 or q >= 1.0:
        return 0.0
    return float(-(q * np.log(q) + (1.0 - q) * np.log(1.0 - q)))


def log_loss(p: Any, y: Any) -> float:
    """Mean binary cross-entropy (nats) of probabilities ``p`` [N] against labels ``y`` [N]."""
    p_, y_ = _check(p, y)
    pc = np.clip(p_, EPS, 1.0 - EPS)
    return float(-np.mean(y_ * np.log(pc) + (1.0 - y_) * np.log1p(-pc)))


def normalized_entropy(p: Any, y: Any, base_rate: float | None = None) -> float:
    """NE = log loss / entropy of ``base_rate`` (default: the mean of ``y``).

    Raises ValueError when the base rate is 0 or 1 (the entropy is 0 and NE undefined).
    """
    ll = log_loss(p, y)
    q = float(_as_f64(y, "labels").mean()) if base_rate is None else float(base_rate)
    h = binary_entropy(q)
    if h == 0.0:
        raise ValueError(f"NE is undefined for base rate {q} (all labels equal)")
    return ll / h


def auc(p: Any, y: Any) -> float:
    """ROC AUC by the Mann–Whitney U statistic, ties scored 1/2 (average ranks). NaN if one class only."""
    p_, y_ = _check(p, y)
    n_pos = float(y_.sum())
    n_neg = float(y_.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(p_, kind="mergesort")
    sorted_p = p_[order]
    # Average 1-based ranks over runs of equal scores: ties contribute 1/2 a pair each.
    ranks = np.empty_like(sorted_p)
    boundaries = np.flatnonzero(np.diff(sorted_p)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [sorted_p.size]))
    avg = (starts + ends + 1) / 2.0  # mean of ranks start+1 .. end
    ranks[:] = np.repeat(avg, ends - starts)
    rank_of = np.empty_like(ranks)
    rank_of[order] = ranks
    u = rank_of[y_ == 1].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def calibration(p: Any, y: Any) -> float:
    """Sum of predictions / sum of labels (1.0 is calibrated; > 1 over-predicts). Inf if no positives."""
    p_, y_ = _check(p, y)
    pos = y_.sum()
    return float(p_.sum() / pos) if pos > 0 else float("inf")


def reliability_bins(p: Any, y: Any, n_bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Equal-width bins over [0, 1]: (mean prediction, observed rate, count) per bin, each [n_bins].

    Empty bins have NaN means and count 0.
    """
    p_, y_ = _check(p, y)
    idx = np.minimum((p_ * n_bins).astype(np.int64), n_bins - 1)
    count = np.bincount(idx, minlength=n_bins).astype(np.float64)
    sum_p = np.bincount(idx, weights=p_, minlength=n_bins)
    sum_y = np.bincount(idx, weights=y_, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sum_p / count, sum_y / count, count


def gauc(p: Any, y: Any, groups: Any) -> float:
    """Group AUC: the AUC of each group (user) weighted by its number of examples, as InterFormer reports
    it: ``sum_u n_u AUC_u / sum_u n_u`` over the groups with both classes (a group with one class has no
    AUC and is left out, with its examples). NaN if no group has both classes.

    ``groups`` [N]: any integer ids (the user of each example).
    """
    p_, y_ = _check(p, y)
    g = np.asarray(groups).reshape(-1)
    if g.shape != p_.shape:
        raise ValueError(f"groups {g.shape} and predictions {p_.shape} differ in length")
    order = np.argsort(g, kind="stable")
    g_sorted = g[order]
    cuts = np.flatnonzero(np.diff(g_sorted)) + 1
    num, den = 0.0, 0.0
    for idx in np.split(order, cuts):
        yg = y_[idx]
        pos = yg.sum()
        if 0 < pos < yg.size:
            num += yg.size * auc(p_[idx], yg)
            den += yg.size
    return num / den if den > 0 else float("nan")


@dataclass(frozen=True)
class BinaryMetrics:
    """The evaluation metrics of one task."""

    ne: float
    auc: float
    calibration: float
    log_loss: float
    base_rate: float
    count: int
    gauc: float | None = None  # per-user AUC weighted by the user's examples (when users are known)

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        out = {
            f"{prefix}ne": self.ne,
            f"{prefix}auc": self.auc,
            f"{prefix}calibration": self.calibration,
            f"{prefix}log_loss": self.log_loss,
            f"{prefix}base_rate": self.base_rate,
            f"{prefix}count": float(self.count),
        }
        if self.gauc is not None:
            out[f"{prefix}gauc"] = self.gauc
        return out


def binary_metrics(p: Any, y: Any, base_rate: float | None = None, groups: Any = None) -> BinaryMetrics:
    """All metrics of one task; ``base_rate`` (default: mean label) is the NE denominator's rate;
    ``groups`` (the user of each example, optional) adds :func:`gauc`."""
    p_, y_ = _check(p, y)
    q = float(y_.mean()) if base_rate is None else float(base_rate)
    ll = log_loss(p_, y_)
    h = binary_entropy(q)
    return BinaryMetrics(
        ne=ll / h if h > 0 else float("nan"),
        auc=auc(p_, y_),
        calibration=calibration(p_, y_),
        log_loss=ll,
        base_rate=float(y_.mean()),
        count=int(y_.size),
        gauc=gauc(p_, y_, groups) if groups is not None else None,
    )


def ground_truth_ne(
    true_probs: list[np.ndarray], labels: list[np.ndarray], masks: list[np.ndarray], tasks: tuple[str, ...]
) -> dict[str, float]:
    """NE of the hidden model's probabilities on the given labels, per task: the floor a model can reach
    on synthetic data (the one place it is computed: evaluation, ``gem-train data synthetic``, tests).

    Each list holds per-batch ``[B, T]`` arrays (``true_probs`` float64, ``labels`` 0/1, ``masks`` bool);
    masked-out labels are skipped, and so is a task with no labelled example (or a single class: its NE is
    undefined).
    """
    p = np.concatenate(true_probs).astype(np.float64)
    y = np.concatenate(labels).astype(np.float64)
    m = np.concatenate(masks).astype(bool)
    out: dict[str, float] = {}
    for j, task in enumerate(tasks):
        sel = m[:, j]
        if sel.any():
            ne = binary_metrics(np.clip(p[sel, j], 0.0, 1.0), y[sel, j]).ne
            if np.isfinite(ne):
                out[task] = ne
    return out
