"""Gradient-boosted trees from XGBoost or scikit-learn, the number of trees chosen on validation.

:func:`fit_on_validation` fits one model per grid point on the training rows, each boosting until the
validation log loss has not improved for ``patience`` trees, keeps the number of trees of the lowest
validation log loss (NE is log loss over a constant of the validation labels: the same choice), and returns
the grid point whose best is lowest. Every library gets the same grid: learning rate, leaves per tree,
smallest leaf (rows; XGBoost's is a hessian sum, so ``rows / 4``, the hessian of a row at p = 0.5) and L2.
XGBoost is the default: on MovieLens's validation split it beat scikit-learn's HistGradientBoosting and
LightGBM (whose fitter is in ``benchmarks/gbdt_libraries.py``, which registers it in :data:`FITTERS`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gem_train.config.checks import ConfigError
from gem_train.config.gbdt import Library
from gem_train.evaluation.metrics import log_loss

__all__ = ["FITTERS", "GRID", "Fitted", "Fitter", "GridPoint", "fit_on_validation", "import_library"]


@dataclass(frozen=True)
class GridPoint:
    learning_rate: float
    leaves: int
    min_leaf: int
    l2: float


# Learning rate, leaves, smallest leaf and L2. On MovieLens's validation split (seed 0, lr 0.03 and 0.1 x
# 15-255 leaves x 50-400 rows per leaf: gem-train README) 63-127 leaves and 50 rows were best, with the
# points within ~0.002 validation NE of each other (a single fit's noise): the grid keeps both learning
# rates and a smaller tree size.
GRID: tuple[GridPoint, ...] = tuple(
    GridPoint(lr, leaves, min_leaf, 1.0)
    for lr, leaves, min_leaf in itertools.product((0.03, 0.1), (31, 127), (50,))
)

_INSTALL = {"xgboost": "xgboost-cpu", "sklearn": "scikit-learn"}


def import_library(library: Library) -> Any:
    """The library's module (``sklearn.ensemble`` for scikit-learn), or a :class:`ConfigError` saying how to
    install it."""
    try:
        if library == "xgboost":
            import xgboost  # type: ignore[import-not-found,unused-ignore]

            return xgboost
        import sklearn.ensemble  # type: ignore[import-untyped,unused-ignore]

        return sklearn.ensemble
    except ImportError:
        dist = _INSTALL[library]
        raise ConfigError(
            f"gem-train baseline --model gbdt with model.gbdt.library = {library!r} needs {dist}: "
            f"pip install 'gem-train[gbdt]' (or pip install {dist})"
        ) from None


@dataclass
class Fitted:
    """The chosen model: ``predict(x) -> P(label = 1)`` ``[N]`` float64 with the chosen number of trees."""

    point: GridPoint
    trees: int
    valid_log_loss: float
    predict: Callable[[np.ndarray], np.ndarray]

    def params(self) -> dict[str, Any]:
        return {
            "learning_rate": self.point.learning_rate, "leaves": self.point.leaves,
            "min_leaf": self.point.min_leaf, "l2": self.point.l2, "n_trees": self.trees,
        }  # fmt: skip


def _xgboost(
    x: np.ndarray, y: np.ndarray, xv: np.ndarray, yv: np.ndarray, cat: list[int], p: GridPoint,
    max_trees: int, patience: int, seed: int, threads: int,
) -> Fitted:  # fmt: skip
    xgb = import_library("xgboost")
    types = ["c" if j in set(cat) else "q" for j in range(x.shape[1])]

    def matrix(a: np.ndarray, label: np.ndarray | None = None) -> Any:
        return xgb.DMatrix(a, label=label, feature_types=types, enable_categorical=True, nthread=threads)

    params = {
        "objective": "binary:logistic", "eval_metric": "logloss", "eta": p.learning_rate,
        "tree_method": "hist", "grow_policy": "lossguide", "max_leaves": p.leaves, "max_depth": 0,
        "min_child_weight": p.min_leaf / 4.0, "lambda": p.l2, "nthread": threads, "seed": seed,
        "max_cat_to_onehot": 1,
    }  # fmt: skip
    evals: dict[str, Any] = {}
    booster = xgb.train(
        params, matrix(x, y), num_boost_round=max_trees, evals=[(matrix(xv, yv), "valid")],
        early_stopping_rounds=patience, evals_result=evals, verbose_eval=False,
    )  # fmt: skip
    k = int(booster.best_iteration) + 1
    loss = float(evals["valid"]["logloss"][k - 1])
    return Fitted(
        p, k, loss, lambda a: np.asarray(booster.predict(matrix(a), iteration_range=(0, k)), np.float64)
    )


def _sklearn(
    x: np.ndarray, y: np.ndarray, xv: np.ndarray, yv: np.ndarray, cat: list[int], p: GridPoint,
    max_trees: int, patience: int, seed: int, threads: int,
) -> Fitted:  # fmt: skip
    ens = import_library("sklearn")
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped,unused-ignore]

    mask = np.zeros(x.shape[1], bool)
    mask[cat] = True
    model = ens.HistGradientBoostingClassifier(
        learning_rate=p.learning_rate, max_leaf_nodes=p.leaves, min_samples_leaf=p.min_leaf,
        l2_regularization=p.l2, max_iter=max_trees, early_stopping=True, scoring="loss",
        n_iter_no_change=patience, tol=0.0, categorical_features=mask, random_state=seed,
    )  # fmt: skip
    with threadpool_limits(threads):
        model.fit(x, y, X_val=xv, y_val=yv)
        losses = [log_loss(q[:, 1], yv) for q in model.staged_predict_proba(xv)]
    k = int(np.argmin(losses)) + 1

    def predict(a: np.ndarray) -> np.ndarray:
        with threadpool_limits(threads):
            for i, q in enumerate(model.staged_predict_proba(a), start=1):
                if i == k:
                    return np.asarray(q[:, 1], np.float64)
        raise AssertionError("fewer trees than chosen")

    return Fitted(p, k, float(losses[k - 1]), predict)


class Fitter(Protocol):
    """Fit one grid point with early stopping on the validation rows (``cat``: categorical columns)."""

    def __call__(
        self, x: np.ndarray, y: np.ndarray, xv: np.ndarray, yv: np.ndarray, cat: list[int], p: GridPoint,
        max_trees: int, patience: int, seed: int, threads: int,
    ) -> Fitted: ...  # fmt: skip


# The libraries by name (model.gbdt.library); a benchmark may register more (LightGBM).
FITTERS: dict[str, Fitter] = {"xgboost": _xgboost, "sklearn": _sklearn}


def fit_on_validation(
    library: str,
    x: np.ndarray,
    y: np.ndarray,
    x_valid: np.ndarray,
    y_valid: np.ndarray,
    categorical: list[bool],
    grid: tuple[GridPoint, ...] = GRID,
    max_trees: int = 2000,
    patience: int = 50,
    seed: int = 0,
    threads: int = 1,
) -> tuple[Fitted, list[Fitted]]:
    """The best grid point by validation log loss (and every point's fit, for the report).

    ``x`` ``[N, F]`` float64 (NaN: missing; categorical columns hold non-negative integer ids), ``y``
    ``[N]`` in {0, 1}; the validation rows likewise.
    """
    if library not in FITTERS:
        raise ConfigError(f"unknown GBDT library {library!r}; known: {sorted(FITTERS)}")
    if not grid:
        raise ValueError("the grid is empty")
    if len(y) == 0 or len(y_valid) == 0:
        raise ValueError("no training or no validation rows with this task's label")
    cat = [j for j, c in enumerate(categorical) if c]
    fit = FITTERS[library]
    fits = [fit(x, y, x_valid, y_valid, cat, p, max_trees, patience, seed, threads) for p in grid]
    return min(fits, key=lambda f: f.valid_log_loss), fits
