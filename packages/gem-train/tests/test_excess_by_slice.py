"""``benchmarks/excess_by_slice.py``: the excess over the identifiable oracle is attributed to the right
slices, and the script reads a trained run's checkpoint end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from gem_train.loop.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_scripts import load_benchmark


def _rows(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    truth = rng.uniform(0.1, 0.9, n)
    return {
        "truth": truth,
        "label": (rng.uniform(size=n) < truth).astype(np.float64),
        "history_len": rng.integers(0, 60, n).astype(np.float64),
        "category_share": rng.uniform(0, 1, n),
        "clicked_before": (rng.uniform(size=n) < 0.1).astype(np.float64),
        "ad_id": rng.integers(0, 5000, n).astype(np.float64),
        "user_id": rng.integers(0, 20000, n).astype(np.float64),
    }


def test_excess_sits_where_the_model_is_worse():
    mod = load_benchmark("excess_by_slice")
    rng = np.random.default_rng(0)
    d = _rows(2000, rng)
    logit = np.log(d["truth"] / (1 - d["truth"]))
    d["oracle"] = 1 / (1 + np.exp(-(logit + rng.normal(0, 0.2, 2000))))
    frequent = d["user_id"] < 1000
    # the model is the oracle on frequent users and worse everywhere else
    d["model"] = np.where(frequent, d["oracle"], 1 / (1 + np.exp(-(logit + rng.normal(0, 0.8, 2000)))))
    s = mod.summarise(d)
    assert s["rows"] == 2000
    ne = s["expected_ne"]
    assert ne["truth"] < ne["oracle"] < ne["model"]
    for rows in s["slices"].values():  # each slicing covers every row once, so the shares add up to 1
        assert sum(r["rows"] for r in rows) == 2000
        assert abs(sum(r["share_of_excess"] for r in rows) - 1.0) < 1e-9
    users = {tuple(r["range"]): r for r in s["slices"]["user_id"]}
    assert users[(0, 100)]["share_of_excess"] == 0.0 and users[(100, 1000)]["share_of_excess"] == 0.0
    assert users[(0, 100)]["kl_model"] == users[(0, 100)]["kl_oracle"]
    assert users[(5000, 1e9)]["kl_model"] > users[(5000, 1e9)]["kl_oracle"]


def test_script_reads_a_trained_run(tmp_path, small_config):
    Trainer(small_config(tmp_path, "train.steps=2", "checkpoint.every=2")).fit()
    (run_dir,) = (p for p in tmp_path.iterdir() if (p / "config.toml").exists())
    mod = load_benchmark("excess_by_slice")
    d = mod.collect(run_dir, "step_00000002", "valid", batches=1)
    assert len(d["model"]) == 128 and np.isfinite(d["model"]).all()
    s = mod.summarise(d)
    assert s["expected_ne"]["truth"] <= s["expected_ne"]["oracle"]
    assert set(s["slices"]) == set(mod.SLICES)
