"""The gradient-boosted-trees baseline (``gem-train baseline --model gbdt``) on causal tabular features.

The features of an example come from its own ``GemBatch`` row (which the data sources build from the past
only: the history holds events before the candidate) plus statistics of the *training* split:

- the batch's dense features as they are (on MovieLens: age, release year, training popularity of the
  movie, the user's earlier like-rate, mean rating and genre affinity, the time since the previous event);
- each single-id sparse feature: its id (a categorical feature when the vocabulary has <= 255 ids), and its
  count in the training split (the popularity of the candidate item, the activity of the user). No
  positive rate of the id: on the training rows it would hold their own label (and its leave-one-out form
  encodes the label exactly given the count: measured, the trees then learn nothing that holds on
  validation);
  each multi-id feature with <= 32 ids: one indicator per id (MovieLens genres);
- each sequence: log length, mean action id, the share of each action id (<= 16 ids: the user's rating
  histogram), the mean and last action of the 10 most recent events, log hours since the last and the
  10th-last event, and how many events fall within a day and a week of the candidate.

``HistGradientBoostingClassifier`` (scikit-learn, the ``gbdt`` extra) is fitted on the training split for
each point of a small grid; the grid point *and the number of trees* are chosen on the validation NE (the
staged predictions of each fit), and the choice is reported on the test split. The test split takes no part
in any choice, and no statistic is computed from the held-out splits.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gem_model import FeatureSpec, GemBatch
from gem_train.config import ConfigError, TrainConfig
from gem_train.data.loader import BatchSource
from gem_train.data.split import Split
from gem_train.evaluation.metrics import BinaryMetrics, binary_metrics, normalized_entropy

__all__ = ["GBDT_GRID", "GbdtResult", "TrainStats", "batch_features", "fit_train_stats", "run_gbdt"]

_MAX_CATEGORIES = 255  # HistGradientBoosting's limit for a categorical feature
_MAX_INDICATORS = 32
_MAX_ACTION_SHARES = 16
_RECENT = 10
_DAY, _WEEK = 86_400, 7 * 86_400

# (learning_rate, max_leaf_nodes, min_samples_leaf, l2_regularization); max_iter is the trees' upper bound,
# the number actually used is chosen on validation.
GBDT_GRID: tuple[tuple[float, int, int, float], ...] = tuple(
    itertools.product((0.05, 0.1), (15, 63), (100,), (1.0,))
)


@dataclass
class TrainStats:
    """Id counts of every single-id sparse feature over the training split: ``counts[name]`` ``[V]``, and
    the sums of the first task's labels over those examples, ``positives[name]`` ``[V]``."""

    counts: dict[str, np.ndarray] = field(default_factory=dict)
    positives: dict[str, np.ndarray] = field(default_factory=dict)
    examples: int = 0
    labelled: float = 0.0
    label_sum: float = 0.0


def _ids(batch: GemBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    jt = batch.sparse[name]
    return jt.values().numpy(), jt.lengths().numpy()


def fit_train_stats(batches: list[GemBatch], spec: FeatureSpec) -> TrainStats:
    """Counts of each single-id feature's ids in ``batches`` (the training split only)."""
    stats = TrainStats()
    for f in spec.sparse:
        if f.max_ids == 1:
            stats.counts[f.name] = np.zeros(f.num_embeddings, np.float64)
            stats.positives[f.name] = np.zeros(f.num_embeddings, np.float64)
    for b in batches:
        stats.examples += b.batch_size
        y, m = _first_label(b)
        stats.labelled += float(m.sum())
        stats.label_sum += float((y * m).sum())
        for name, c in stats.counts.items():
            ids, _ = _ids(b, name)
            c += np.bincount(ids, weights=m[_row_of(b, name)], minlength=len(c))
            stats.positives[name] += np.bincount(ids, weights=(y * m)[_row_of(b, name)], minlength=len(c))
    return stats


def _first_label(b: GemBatch) -> tuple[np.ndarray, np.ndarray]:
    """The first task's labels and mask ``[B]`` float64."""
    return b.labels[:, 0].numpy().astype(np.float64), b.label_mask[:, 0].numpy().astype(np.float64)


def _row_of(b: GemBatch, name: str) -> np.ndarray:
    """The example of every id of sparse feature ``name``."""
    return np.repeat(np.arange(b.batch_size), b.sparse[name].lengths().numpy())


def feature_names(spec: FeatureSpec) -> tuple[list[str], list[bool]]:
    """Column names of :func:`batch_features` and which columns are categorical."""
    names = [f"dense_{i}" for i in range(spec.n_dense)]
    cat = [False] * spec.n_dense
    for f in spec.sparse:
        if f.max_ids == 1:
            if f.num_embeddings <= _MAX_CATEGORIES:
                names.append(f"{f.name}")
                cat.append(True)
            names.append(f"{f.name}_train_count")
            cat.append(False)
        elif f.num_embeddings <= _MAX_INDICATORS:
            names += [f"{f.name}={i}" for i in range(f.num_embeddings)]
            cat += [False] * f.num_embeddings
    for s in spec.sequences:
        cols = ["log_len", "mean_action"]
        if s.num_actions <= _MAX_ACTION_SHARES:
            cols += [f"share_action_{a}" for a in range(s.num_actions)]
        cols += ["recent_mean_action", "last_action", "log_h_since_last", "log_h_since_recent"]
        cols += ["events_last_day", "events_last_week"]
        names += [f"{s.name}.{c}" for c in cols]
        cat += [False] * len(cols)
    return names, cat


def batch_features(
    batch: GemBatch, spec: FeatureSpec, stats: TrainStats, training: bool = False
) -> np.ndarray:
    """``[B, F]`` float64 features of each example (columns: :func:`feature_names`), from its own row of
    ``batch`` and the training statistics ``stats`` only (so an example's features do not depend on the
    other examples of its batch). ``training``: the batch is from the training split, whose examples are
    in ``stats``: each one's own occurrence is taken out of its counts (so a training row sees the counts a
    held-out row with the same ids would see, less itself)."""
    b = batch.batch_size
    _, m = _first_label(batch)
    own_n = m if training else np.zeros(b)
    cols: list[np.ndarray] = [batch.dense.numpy().astype(np.float64).T.reshape(spec.n_dense, b)]
    for f in spec.sparse:
        ids, lengths = _ids(batch, f.name)
        if f.max_ids == 1:
            one = np.where(lengths > 0, ids[np.minimum(np.cumsum(lengths) - 1, len(ids) - 1)], -1)
            if len(ids) == 0:
                one = np.full(b, -1)
            if f.num_embeddings <= _MAX_CATEGORIES:
                cols.append(np.where(one >= 0, one, np.nan)[None].astype(np.float64))
            count = np.where(one >= 0, stats.counts[f.name][np.maximum(one, 0)] - own_n, 0.0)
            cols.append(np.log1p(count)[None])
        elif f.num_embeddings <= _MAX_INDICATORS:
            hot = np.zeros((f.num_embeddings, b))
            owner = np.repeat(np.arange(b), lengths)
            hot[ids, owner] = 1.0
            cols.append(hot)
    t_req = batch.request_time.numpy().astype(np.float64)
    for s in spec.sequences:
        seq = batch.sequences[s.name]
        off = seq.offsets.numpy()
        n = off[1:] - off[:-1]
        act = seq.action_ids.numpy().astype(np.float64)
        ts = seq.timestamps.numpy().astype(np.float64)
        owner = np.repeat(np.arange(b), n)
        has = n > 0
        safe = np.maximum(n, 1)
        rank_from_end = off[1:][owner] - np.arange(len(act))  # 1 for the newest event
        recent = rank_from_end <= _RECENT
        n_recent = np.bincount(owner, weights=recent, minlength=b)
        gap = t_req[owner] - ts
        # Index of the newest and of the 10th-newest event (clipped into range: empty histories are masked).
        top = max(len(act) - 1, 0)
        last = np.clip(off[1:] - 1, 0, top)
        nth = np.clip(np.maximum(off[1:] - _RECENT, off[:-1]), 0, top)
        rows = [
            np.log1p(n),
            np.where(has, np.bincount(owner, weights=act, minlength=b) / safe, np.nan),
        ]
        if s.num_actions <= _MAX_ACTION_SHARES:
            for a in range(s.num_actions):
                rows.append(np.where(has, np.bincount(owner, weights=act == a, minlength=b) / safe, np.nan))
        rows += [
            np.where(
                has, np.bincount(owner, weights=act * recent, minlength=b) / np.maximum(n_recent, 1), np.nan
            ),
            np.where(has, act[last] if len(act) else 0.0, np.nan),
            np.where(has, np.log1p(np.maximum(t_req - (ts[last] if len(ts) else 0.0), 0.0) / 3600.0), np.nan),
            np.where(has, np.log1p(np.maximum(t_req - (ts[nth] if len(ts) else 0.0), 0.0) / 3600.0), np.nan),
            np.bincount(owner, weights=gap <= _DAY, minlength=b),
            np.bincount(owner, weights=gap <= _WEEK, minlength=b),
        ]
        cols.append(np.stack(rows))
    return np.concatenate(cols, axis=0).T.copy()


def _split_matrix(
    source: BatchSource, split: Split, batch_size: int, stats: TrainStats, max_batches: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features, labels ``[N, T]`` and label mask of one pass over ``split``."""
    n = source.num_batches(split, batch_size)
    if n is None:  # an endless training stream: as many batches as asked
        n = max_batches
    elif max_batches:
        n = min(n, max_batches)
    xs, ys, ms = [], [], []
    for i in range(n):
        b = source.get(split, i, batch_size).batch
        xs.append(batch_features(b, source.spec, stats))
        ys.append(b.labels.numpy())
        ms.append(b.label_mask.numpy())
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ms)


@dataclass
class GbdtResult:
    """What :func:`run_gbdt` chose and measured, per task."""

    params: dict[str, dict[str, Any]]  # task -> chosen grid point + n_trees
    valid: dict[str, BinaryMetrics]
    test: dict[str, BinaryMetrics]
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": "gbdt",
            "params": self.params,
            "valid": {t: m.as_dict() for t, m in self.valid.items()},
            "tasks": {t: m.as_dict() for t, m in self.test.items()},  # the test split, as eval.json
            "seconds": self.seconds,
        }

    def summary(self) -> str:
        lines = []
        for t, m in self.test.items():
            p = self.params[t]
            lines.append(
                f"  {t}: test NE {m.ne:.4f}  AUC {m.auc:.4f}  (valid NE {self.valid[t].ne:.4f}; "
                f"{p['n_trees']} trees, lr {p['learning_rate']}, {p['max_leaf_nodes']} leaves)"
            )
        return "\n".join(lines)


def run_gbdt(
    cfg: TrainConfig,
    source: BatchSource,
    grid: tuple[tuple[float, int, int, float], ...] = GBDT_GRID,
    max_iter: int = 400,
    max_train_batches: int = 0,
    threads: int = 1,
) -> GbdtResult:
    """Fit on the training split, choose the grid point and the number of trees on the validation split,
    report the test split (see the module doc). ``max_train_batches`` caps the training pass (needed for an
    endless stream; 0: one pass)."""
    try:
        from sklearn.ensemble import HistGradientBoostingClassifier  # type: ignore[import-untyped]
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            "gem-train baseline --model gbdt needs scikit-learn: pip install 'gem-train[gbdt]'"
        ) from None
    if not source.num_batches("valid", cfg.data.eval_batch_size):
        raise ConfigError(
            "the gbdt baseline chooses its trees on a validation split, and this dataset has none"
        )
    if source.num_batches("train", cfg.data.batch_size) is None and not max_train_batches:
        max_train_batches = 1000
    start = time.perf_counter()
    spec = source.spec
    bs, ebs = cfg.data.batch_size, cfg.data.eval_batch_size
    n_train = source.num_batches("train", bs) or max_train_batches
    if max_train_batches:
        n_train = min(n_train, max_train_batches)
    train_batches = [source.get("train", i, bs).batch for i in range(n_train)]
    stats = fit_train_stats(train_batches, spec)  # from the training split only
    x_tr = np.concatenate([batch_features(b, spec, stats, training=True) for b in train_batches])
    y_tr = np.concatenate([b.labels.numpy() for b in train_batches])
    m_tr = np.concatenate([b.label_mask.numpy() for b in train_batches])
    del train_batches
    x_va, y_va, m_va = _split_matrix(source, "valid", ebs, stats, 0)
    x_te, y_te, m_te = _split_matrix(source, "test", ebs, stats, 0)
    _, categorical = feature_names(spec)
    params: dict[str, dict[str, Any]] = {}
    valid: dict[str, BinaryMetrics] = {}
    test: dict[str, BinaryMetrics] = {}
    with threadpool_limits(threads):
        for j, task in enumerate(spec.tasks):
            tr, va, te = m_tr[:, j], m_va[:, j], m_te[:, j]
            if not (tr.any() and va.any() and te.any()):
                continue
            best: tuple[float, dict[str, Any], Any] | None = None
            for lr, leaves, min_leaf, l2 in grid:
                model = HistGradientBoostingClassifier(
                    learning_rate=lr, max_leaf_nodes=leaves, min_samples_leaf=min_leaf,
                    l2_regularization=l2, max_iter=max_iter, early_stopping=False,
                    categorical_features=np.array(categorical), random_state=cfg.run.seed,
                )  # fmt: skip
                model.fit(x_tr[tr], y_tr[tr, j])
                for k, p in enumerate(model.staged_predict_proba(x_va[va]), start=1):
                    ne = normalized_entropy(p[:, 1], y_va[va, j])
                    if best is None or ne < best[0]:
                        point = {
                            "learning_rate": lr, "max_leaf_nodes": leaves, "min_samples_leaf": min_leaf,
                            "l2_regularization": l2, "n_trees": k,
                        }  # fmt: skip
                        best = (ne, point, model)
            assert best is not None  # the grid is not empty
            _, point, model = best
            p_va = _staged(model, x_va[va], int(point["n_trees"]))
            p_te = _staged(model, x_te[te], int(point["n_trees"]))
            params[task] = point
            valid[task] = binary_metrics(p_va, y_va[va, j])
            test[task] = binary_metrics(p_te, y_te[te, j])
    return GbdtResult(params, valid, test, time.perf_counter() - start)


def _staged(model: Any, x: np.ndarray, k: int) -> np.ndarray:
    """P(label = 1) of the first ``k`` trees."""
    for i, p in enumerate(model.staged_predict_proba(x), start=1):
        if i == k:
            return np.asarray(p[:, 1], np.float64)
    raise ValueError(f"the model has fewer than {k} trees")


def write_gbdt_result(result: GbdtResult, out_dir: Path) -> Path:
    """``out_dir/eval.json`` (atomic)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "eval.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result.as_dict(), indent=2), encoding="utf-8")
    tmp.replace(path)
    return path
