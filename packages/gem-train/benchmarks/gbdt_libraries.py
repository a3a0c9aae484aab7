"""LightGBM, XGBoost and scikit-learn's HistGradientBoosting on the GBDT baseline's features, per seed.

For every seed the features are built once (:mod:`gem_train.evaluation.baselines.gbdt_matrix`, exactly as
``gem-train baseline --model gbdt`` builds them); each library then fits every point of the same grid with
early stopping on the validation split, and its point of lowest validation NE is reported on the test split
(nothing is chosen on test). Prints one table per library (validation NE of every grid point, mean over the
seeds) and the chosen models' validation / test NE and AUC (mean ± std); writes ``<out>/gbdt_libraries.json``.
XGBoost and scikit-learn are gem-train's own fitters (:mod:`gem_train.evaluation.baselines.gbdt_fit`, the
``gbdt`` extra); LightGBM's, below, needs ``pip install lightgbm``.

    uv run --no-sync python packages/gem-train/benchmarks/gbdt_libraries.py --seeds 0 --lr 0.03 0.1 \
        --leaves 15 31 63 --min-leaf 50 200
    uv run --no-sync python packages/gem-train/benchmarks/gbdt_libraries.py --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

LIBRARIES = ("xgboost", "lightgbm", "sklearn")


def _lightgbm(x, y, xv, yv, cat, p, max_trees, patience, seed, threads):  # type: ignore[no-untyped-def]
    """LightGBM with the grid point's meaning of :mod:`gem_train.evaluation.baselines.gbdt_fit` (a Fitter)."""
    try:
        import lightgbm as lgb
    except ImportError:
        raise SystemExit(
            "gbdt_libraries.py: LightGBM is not a gem dependency: pip install lightgbm"
        ) from None

    from gem_train.evaluation.baselines.gbdt_fit import Fitted

    params = {
        "objective": "binary", "metric": "binary_logloss", "learning_rate": p.learning_rate,
        "num_leaves": p.leaves, "min_data_in_leaf": p.min_leaf, "lambda_l2": p.l2, "max_depth": -1,
        "num_threads": threads, "seed": seed, "deterministic": True, "force_row_wise": True, "verbose": -1,
    }  # fmt: skip
    train = lgb.Dataset(x, y, categorical_feature=cat or "auto", free_raw_data=False)
    valid = lgb.Dataset(xv, yv, reference=train, categorical_feature=cat or "auto")
    evals: dict[str, Any] = {}
    booster = lgb.train(
        params, train, num_boost_round=max_trees, valid_sets=[valid], valid_names=["valid"],
        callbacks=[lgb.early_stopping(patience, verbose=False), lgb.record_evaluation(evals)],
    )  # fmt: skip
    k = int(booster.best_iteration) or booster.current_iteration()
    loss = float(evals["valid"]["binary_logloss"][k - 1])
    return Fitted(p, k, loss, lambda a: np.asarray(booster.predict(a, num_iteration=k), np.float64))


def _grid(lrs: list[float] | None, leaves: list[int] | None, min_leaf: list[int] | None) -> tuple[Any, ...]:
    """The shipped grid (:data:`gem_train.evaluation.baselines.gbdt_fit.GRID`), or the product of the lists
    given."""
    from gem_train.evaluation.baselines.gbdt_fit import GRID, GridPoint

    if not (lrs or leaves or min_leaf):
        return GRID
    return tuple(
        GridPoint(lr, n, m, 1.0)
        for lr, n, m in itertools.product(
            lrs or sorted({p.learning_rate for p in GRID}),
            leaves or sorted({p.leaves for p in GRID}),
            min_leaf or sorted({p.min_leaf for p in GRID}),
        )
    )


def _seed(
    config: str, overrides: list[str], seed: int, libraries: list[str], grid: tuple[Any, ...], encoding: str
) -> dict:
    from gem_train.evaluation.baselines.gbdt_features import FeatureOptions
    from gem_train.evaluation.baselines.gbdt_fit import FITTERS, fit_on_validation

    FITTERS.setdefault("lightgbm", _lightgbm)
    from gem_train.config import load_config
    from gem_train.evaluation.baselines.gbdt import build_gbdt_source, like_action
    from gem_train.evaluation.baselines.gbdt_matrix import GbdtFeatureBuilder
    from gem_train.evaluation.metrics import binary_entropy, binary_metrics

    cfg = load_config(config, [*overrides, f"run.seed={seed}"])
    source = build_gbdt_source(cfg)
    t0 = time.perf_counter()
    n_train = source.num_batches("train", cfg.data.batch_size) or 1000
    b = GbdtFeatureBuilder(
        source, cfg.model.gbdt, like_action(cfg), cfg.data.batch_size, cfg.data.eval_batch_size, n_train,
        FeatureOptions(item_encoding=encoding), seed=seed,
    )  # fmt: skip
    b.fit()
    tr, va, te = b.train_matrix(), b.held_out_matrix("valid"), b.held_out_matrix("test")
    h = binary_entropy(float(va.y[:, 0].mean()))  # NE = log loss / h on the validation labels
    out: dict[str, Any] = {"feature_seconds": time.perf_counter() - t0, "features": b.names}
    for lib in libraries:
        t0 = time.perf_counter()
        best, fits = fit_on_validation(
            lib, tr.x, tr.y[:, 0], va.x, va.y[:, 0], b.categorical, grid=grid, seed=seed,
            threads=cfg.model.gbdt.threads,
        )  # fmt: skip
        v = binary_metrics(best.predict(va.x), va.y[:, 0])
        t = binary_metrics(best.predict(te.x), te.y[:, 0])
        out[lib] = {
            "valid_ne": v.ne, "valid_auc": v.auc, "ne": t.ne, "auc": t.auc, "params": best.params(),
            "grid": [{**f.params(), "valid_ne": f.valid_log_loss / h} for f in fits],
            "seconds": time.perf_counter() - t0,
        }  # fmt: skip
        print(
            f"seed {seed} {lib}: valid NE {v.ne:.4f} test NE {t.ne:.4f} AUC {t.auc:.4f} "
            f"{best.params()} ({out[lib]['seconds']:.0f} s)",
            flush=True,
        )
    return out


def _ms(vals: list[float]) -> str:
    a = np.array(vals)
    return f"{a.mean():.4f} ± {a.std(ddof=1):.4f}" if len(a) > 1 else f"{a.mean():.4f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="movielens")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    p.add_argument("--lr", type=float, nargs="+", help="grid learning rates (default: the shipped grid's)")
    p.add_argument("--leaves", type=int, nargs="+", help="grid leaves per tree")
    p.add_argument("--min-leaf", type=int, nargs="+", help="grid smallest leaf (rows)")
    p.add_argument("--out", type=Path, default=Path("runs/gbdt_libraries"))
    p.add_argument(
        "--item-encoding", choices=("kfold", "causal", "loo", "in_sample"), default="kfold",
        help="how a training row's item statistics keep its own label out (loo, in_sample: they leak)",
    )  # fmt: skip
    p.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = p.parse_args(argv)
    grid = _grid(args.lr, args.leaves, args.min_leaf)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict] = {}
    for seed in args.seeds:
        results[seed] = _seed(args.config, args.overrides, seed, args.libraries, grid, args.item_encoding)
        tmp = args.out / "gbdt_libraries.json.tmp"
        tmp.write_text(
            json.dumps({"config": args.config, "encoding": args.item_encoding, "results": results}, indent=2)
        )
        os.replace(tmp, args.out / "gbdt_libraries.json")
    for lib in args.libraries:
        print(
            f"\n{lib}: validation NE per grid point (mean over seeds {args.seeds}), trees by early stopping"
        )
        print("| lr | leaves | min leaf | valid NE | trees |\n|---|---|---|---|---|")
        for k in range(len(grid)):
            pts = [results[s][lib]["grid"][k] for s in args.seeds]
            ne = np.mean([q["valid_ne"] for q in pts])
            trees = np.mean([q["n_trees"] for q in pts])
            q = pts[0]
            print(f"| {q['learning_rate']} | {q['leaves']} | {q['min_leaf']} | {ne:.4f} | {trees:.0f} |")
    print("\n| library | seeds | valid NE | test NE | test AUC | seconds (grid) |\n|---|---|---|---|---|---|")
    for lib in args.libraries:
        rs = [results[s][lib] for s in args.seeds]
        print(
            f"| {lib} | {len(rs)} | {_ms([r['valid_ne'] for r in rs])} | {_ms([r['ne'] for r in rs])} | "
            f"{_ms([r['auc'] for r in rs])} | {np.mean([r['seconds'] for r in rs]):.0f} |"
        )
    print(f"wrote {args.out / 'gbdt_libraries.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
