"""The gradient-boosted-trees baseline (``gem-train baseline --model gbdt``) on strictly causal features.

The features (:mod:`gem_train.evaluation.baselines.gbdt_features`) are the ones a practitioner builds, from
what the data source declares: the user's like rate and mean action over all, the last 3 and the last 10 of
their strictly earlier events, the time since the last one, the user's like rate on the candidate's genres
(any attribute of the item), the candidate item's popularity, positive rate and mean action on the training
split (a training row's own label kept out by 5-fold target encoding), and the static features. On MovieLens
the trees read every earlier event of the user (``model.gbdt.max_history``), not only the model's window.

The library is ``model.gbdt.library`` (XGBoost by default: it beat LightGBM and scikit-learn's
HistGradientBoosting on MovieLens's validation split over 5 seeds; the gem-train README has the table). For
each task, one model per point of a small grid (:data:`~gem_train.evaluation.baselines.gbdt_fit.GRID`) is
fitted on the training split; the grid point *and the number of trees* (early stopping) are chosen on the
validation NE, and the choice is reported on the test split. The test split takes no part in any choice, and
no statistic is computed from the held-out splits.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gem_train.config import ConfigError, TrainConfig
from gem_train.data.loader import BatchSource
from gem_train.evaluation.baselines.gbdt_features import FeatureOptions
from gem_train.evaluation.baselines.gbdt_fit import GRID, GridPoint, fit_on_validation, import_library
from gem_train.evaluation.baselines.gbdt_matrix import GbdtFeatureBuilder
from gem_train.evaluation.metrics import BinaryMetrics, binary_metrics

__all__ = ["GbdtResult", "build_gbdt_source", "like_action", "run_gbdt", "write_gbdt_result"]

_EVERY_EARLIER_EVENT = 1_000_000  # a MovieLens window longer than any user's history


def like_action(cfg: TrainConfig) -> int:
    """The smallest history action id that counts as a like: ``model.gbdt.like_action``, else MovieLens's
    ``like_threshold`` (the label's own rule), else 1."""
    if cfg.model.gbdt.like_action:
        return cfg.model.gbdt.like_action
    return cfg.data.movielens.like_threshold if cfg.data.source == "movielens-100k" else 1


def build_gbdt_source(cfg: TrainConfig) -> BatchSource:
    """The run's data source, with MovieLens's history window widened to ``model.gbdt.max_history`` (0:
    every earlier event): the same examples and splits, longer histories."""
    from gem_train.loop.build import build_source

    if cfg.data.source == "movielens-100k":
        cfg = copy.deepcopy(cfg)
        cfg.data.movielens.max_len = cfg.model.gbdt.max_history or _EVERY_EARLIER_EVENT
    return build_source(cfg)


@dataclass
class GbdtResult:
    """What :func:`run_gbdt` chose and measured, per task."""

    params: dict[str, dict[str, Any]]  # task -> chosen grid point + n_trees
    valid: dict[str, BinaryMetrics]
    test: dict[str, BinaryMetrics]
    seconds: float
    library: str = "xgboost"
    features: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": "gbdt",
            "library": self.library,
            "params": self.params,
            "valid": {t: m.as_dict() for t, m in self.valid.items()},
            "tasks": {t: m.as_dict() for t, m in self.test.items()},  # the test split, as eval.json
            "features": self.features,
            "seconds": self.seconds,
        }

    def summary(self) -> str:
        lines = []
        for t, m in self.test.items():
            p = self.params[t]
            lines.append(
                f"  {t}: test NE {m.ne:.4f}  AUC {m.auc:.4f}  (valid NE {self.valid[t].ne:.4f}; "
                f"{self.library}, {p['n_trees']} trees, lr {p['learning_rate']}, {p['leaves']} leaves)"
            )
        return "\n".join(lines)


def run_gbdt(
    cfg: TrainConfig,
    source: BatchSource,
    grid: tuple[GridPoint, ...] = GRID,
    max_trees: int = 2000,
    patience: int = 50,
    max_train_batches: int = 0,
    options: FeatureOptions | None = None,
) -> GbdtResult:
    """Fit on the training split, choose the grid point and the number of trees on the validation split,
    report the test split (see the module doc). ``max_train_batches`` caps the training pass (needed for an
    endless stream, 1000 batches when 0; else 0: one pass). ``source``: :func:`build_gbdt_source` (any
    source works; MovieLens's own window only gives shorter histories)."""
    g = cfg.model.gbdt
    import_library(g.library)  # a missing library fails before any work
    if not source.num_batches("valid", cfg.data.eval_batch_size):
        raise ConfigError(
            "the gbdt baseline chooses its trees on a validation split, and this dataset has none "
            "(data.movielens.valid_fraction, data.synthetic.valid_examples, data.parquet.valid or "
            "data.parquet.valid_fraction)"
        )
    n_train = source.num_batches("train", cfg.data.batch_size)
    if n_train is None:  # an endless stream: as many batches as asked
        n_train = max_train_batches or 1000
    elif max_train_batches:
        n_train = min(n_train, max_train_batches)
    start = time.perf_counter()
    builder = GbdtFeatureBuilder(
        source,
        g,
        like_action(cfg),
        cfg.data.batch_size,
        cfg.data.eval_batch_size,
        n_train,
        options,
        cfg.run.seed,
    )
    builder.fit()  # the training split only
    train = builder.train_matrix()
    valid, test = builder.held_out_matrix("valid"), builder.held_out_matrix("test")
    params: dict[str, dict[str, Any]] = {}
    valid_m: dict[str, BinaryMetrics] = {}
    test_m: dict[str, BinaryMetrics] = {}
    for j, task in enumerate(source.spec.tasks):
        tr, va, te = train.mask[:, j], valid.mask[:, j], test.mask[:, j]
        if not (tr.any() and va.any() and te.any()):
            continue  # a task without labels in a split: nothing to fit or report
        best, _ = fit_on_validation(
            g.library, train.x[tr], train.y[tr, j], valid.x[va], valid.y[va, j], builder.categorical,
            grid=grid, max_trees=max_trees, patience=patience, seed=cfg.run.seed, threads=g.threads,
        )  # fmt: skip
        params[task] = best.params()
        valid_m[task] = binary_metrics(best.predict(valid.x[va]), valid.y[va, j])
        test_m[task] = binary_metrics(best.predict(test.x[te]), test.y[te, j])
    if not params:
        raise ConfigError("no task has labels in all three splits: nothing for the gbdt baseline to fit")
    seconds = time.perf_counter() - start
    return GbdtResult(params, valid_m, test_m, seconds, g.library, builder.names)


def write_gbdt_result(result: GbdtResult, out_dir: Path) -> Path:
    """``out_dir/eval.json`` (atomic)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "eval.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result.as_dict(), indent=2), encoding="utf-8")
    tmp.replace(path)
    return path
