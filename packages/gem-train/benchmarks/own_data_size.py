"""How many rows a model needs: GEM and the MLP trained on own-data Parquet tables of several sizes.

The user's path of issue 34: an impressions table written with pyarrow (not with gem's generator), the
README's config shape (hashed ids, a history, three dense columns in their natural units: a price in
dollars, a 7-day CTR, an age in years), trained with gem-train's defaults (a validation split cut from the
training period by time, about 10 validations, early stopping). Labels come from a hidden logistic model of
the user's taste for the ad's category, the ad's quality, the user's bias and the price; its own NE and AUC
on the test rows is the floor a model can approach. The test rows are a later period of the same world.

For each table size the script trains each model once (``--seeds`` for more) and records the best
validation NE, the selected checkpoint's test NE and AUC, the dense parameters per training row and the
health warnings the run gave: the measurements behind ``gem_train.evaluation.health.PARAMS_PER_EXAMPLE``.

    uv run --no-sync python packages/gem-train/benchmarks/own_data_size.py --rows 4000 20000 \\
        --out /tmp/own_data [--models gem mlp] [--normalize] [key=value ...]

Results: ``OUT/results.json`` (one entry per run) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

N_USERS, N_ADS, N_CATS = 3000, 600, 20
T0 = 1_700_000_000  # request times: seconds from here, one row every 30 s on average


class World:
    """The hidden world: user tastes and biases, ad categories and qualities (seeded)."""

    def __init__(self, seed: int = 0, signal: float = 1.0) -> None:
        rng = np.random.default_rng([seed, 1])
        self.taste = rng.normal(0.0, 1.0, (N_USERS, N_CATS))
        self.bias = rng.normal(0.0, 0.5, N_USERS)
        self.cat = rng.integers(0, N_CATS, N_ADS)
        self.quality = rng.normal(0.0, 0.5, N_ADS)
        self.signal = signal

    def table(self, n: int, start: int, seed: int) -> tuple[pa.Table, np.ndarray]:
        """``n`` rows from row number ``start`` on (time order), and the hidden click probabilities."""
        rng = np.random.default_rng([seed, 2, start])
        user = rng.integers(0, N_USERS, n)
        ad = rng.integers(0, N_ADS, n)
        t = T0 + 30 * (start + np.arange(n)) + rng.integers(0, 30, n)
        lengths = np.minimum(rng.poisson(12, n), 64)
        hist_items, hist_actions, hist_ts = [], [], []
        for i in range(n):
            k = int(lengths[i])
            # Past ads, mostly of the categories the user likes.
            liked = np.argsort(-self.taste[user[i]])[:3]
            pool = np.flatnonzero(np.isin(self.cat, liked))
            items = np.where(rng.uniform(size=k) < 0.7, rng.choice(pool, k), rng.integers(0, N_ADS, k))
            hist_items.append(items.tolist())
            hist_actions.append(rng.integers(0, 4, k).tolist())
            hist_ts.append(np.sort(t[i] - rng.integers(60, 30 * 86400, k)).tolist())
        price = np.exp(rng.normal(3.5, 0.8, n))  # dollars
        age = 18 + 50 * rng.beta(2, 3, n)  # years
        logit = -1.6 + self.signal * (
            0.6 * self.taste[user, self.cat[ad]]
            + self.quality[ad]
            + self.bias[user]
            - 0.3 * (np.log(price) - 3.5)
        )
        p = 1 / (1 + np.exp(-logit))
        ctr_7d = np.clip(p * rng.uniform(0.5, 1.5, n) * 0.05, 0, 1)  # a noisy, small-scale rate
        click = (rng.uniform(size=n) < p).astype(np.int8)
        cols = {
            "user_id": pa.array(user * 7919 + 13, pa.int64()),  # raw ids, hashed by the config
            "ad_id": pa.array(ad * 104729 + 7, pa.int64()),
            "price": pa.array(price, pa.float64()),
            "ctr_7d": pa.array(ctr_7d, pa.float64()),
            "age": pa.array(age, pa.float64()),
            "hist_item": pa.array([[x * 104729 + 7 for x in h] for h in hist_items], pa.list_(pa.int64())),
            "hist_action": pa.array(hist_actions, pa.list_(pa.int64())),
            "hist_ts": pa.array(hist_ts, pa.list_(pa.int64())),
            "ts": pa.array(t, pa.int64()),
            "click": pa.array(click, pa.int8()),
        }
        return pa.table(cols), p


def config(root: Path, name: str) -> str:
    """The README's own-data config shape for these tables (one task)."""
    return f"""
[run]
name = "{name}"
device = "cpu"

[model]
name = "tiny"

[data]
source = "parquet"
batch_size = 256

[data.parquet]
root = "{root}"
train = ["train.parquet"]
test = ["test.parquet"]
request_time = "ts"

[data.parquet.dense]
columns = ["price", "ctr_7d", "age"]

[data.parquet.sparse.user_id]
num_embeddings = 20000
ids = "hash"

[data.parquet.sparse.ad_id]
num_embeddings = 5000
ids = "hash"

[data.parquet.sequences.history]
items = "hist_item"
actions = "hist_action"
timestamps = "hist_ts"
num_items = 5000
num_actions = 4
max_len = 64
ids = "hash"

[data.parquet.labels]
ctr = "click"

[train]
progress_bar = false
"""


def floor(p: np.ndarray, y: np.ndarray) -> dict[str, float]:
    from gem_train.evaluation.metrics import binary_metrics

    m = binary_metrics(p, y)
    return {"ne": m.ne, "auc": m.auc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[4000, 20000])
    ap.add_argument("--test-rows", type=int, default=10_000)
    ap.add_argument("--models", nargs="+", default=["gem"], choices=("gem", "mlp"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--signal", type=float, default=1.0, help="scale of the hidden logit (1: as documented)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("overrides", nargs="*", help="key=value overrides of every run")
    args = ap.parse_args(argv)

    from gem_train.config import load_config
    from gem_train.loop.trainer import Trainer

    results = []
    world = World(0, args.signal)
    for rows in args.rows:
        root = args.out / f"table_{rows}"
        root.mkdir(parents=True, exist_ok=True)
        train, _ = world.table(rows, 0, seed=0)
        test, p_test = world.table(args.test_rows, 10_000_000, seed=0)
        pq.write_table(train, root / "train.parquet", row_group_size=2048)
        pq.write_table(test, root / "test.parquet", row_group_size=2048)
        truth = floor(p_test, test.column("click").to_numpy())
        toml = root / "config.toml"
        toml.write_text(config(root, f"own{rows}"), encoding="utf-8")
        for model in args.models:
            for seed in args.seeds:
                extra = ["model.arch=mlp"] if model == "mlp" else []
                cfg = load_config(
                    str(toml),
                    [f"run.out_dir={args.out / 'runs'}", f"run.seed={seed}", *extra, *args.overrides],
                )
                t0 = time.perf_counter()
                trainer = Trainer(cfg)
                res = trainer.fit()
                dense = sum(p.numel() for p in trainer.model.dense_parameters())
                summary = json.loads((res.run_dir / "eval.json").read_text())
                best = summary.get("best", {})
                entry = {
                    "rows": rows, "model": model, "seed": seed, "dense_params": dense,
                    "params_per_row": dense / trainer.schedule.train_rows, "steps": res.step,
                    "best_step": res.best_step, "best_valid_ne": res.best_valid_ne,
                    "best_test_ne": best.get("tasks", {}).get("ctr", {}).get("ne"),
                    "best_test_auc": best.get("tasks", {}).get("ctr", {}).get("auc"),
                    "final_test_ne": res.final_eval.tasks["ctr"].ne if res.final_eval else None,
                    "truth_test_ne": truth["ne"], "truth_test_auc": truth["auc"],
                    "health": [n["check"] for n in summary.get("health", [])],
                    "seconds": time.perf_counter() - t0, "run_dir": str(res.run_dir),
                }  # fmt: skip
                results.append(entry)
                print(json.dumps(entry), flush=True)
                (args.out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(
        "\nrows  model  dense/row  best valid NE  test NE (best)  test AUC  truth NE/AUC  health",
        file=sys.stderr,
    )
    for e in results:
        print(
            f"{e['rows']:>6} {e['model']:>4} {e['params_per_row']:>9.1f} {e['best_valid_ne']:>13.4f} "
            f"{e['best_test_ne']:>14.4f} {e['best_test_auc']:>9.4f}  {e['truth_test_ne']:.4f}/"
            f"{e['truth_test_auc']:.4f}  {','.join(e['health'])}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
