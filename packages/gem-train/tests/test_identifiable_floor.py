"""The identifiable floor of the synthetic data (``SyntheticBatch.identifiable_probs``) and its benchmark
script on the tiny-cpu config: the identifiable prediction integrates the stated residual out of the true
logit, the residual has zero mean and the stated variance, and the floor lies between the Bayes floor and
the base rate."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from gem_train.config import load_config
from gem_train.data.synthetic import SyntheticAds, expected_sigmoid

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_scripts import load_benchmark


def test_expected_sigmoid_quadrature():
    mean = np.array([-2.0, 0.0, 1.5])
    assert np.allclose(expected_sigmoid(mean, np.zeros(3)), 1.0 / (1.0 + np.exp(-mean)), atol=1e-15)
    # Symmetry: E[sigmoid(Z s)] = 1/2; and the probit approximation of E[sigmoid(m + s Z)] to ~1e-2.
    assert expected_sigmoid(np.zeros(1), np.full(1, 2.0))[0] == pytest.approx(0.5, abs=1e-12)
    approx = 1.0 / (1.0 + np.exp(-1.5 / math.sqrt(1.0 + math.pi * 0.5 / 8.0)))
    assert abs(expected_sigmoid(np.array([1.5]), np.array([0.5]))[0] - approx) < 1e-2
    # Against a Monte Carlo estimate at a large variance.
    z = np.random.default_rng(0).standard_normal(400_000)
    mc = (1.0 / (1.0 + np.exp(-(0.7 + 1.5 * z)))).mean()
    assert expected_sigmoid(np.array([0.7]), np.array([2.25]))[0] == pytest.approx(mc, abs=3e-3)


@pytest.mark.parametrize("n_dense", [8, 3])  # with the user-bias view as a feature, and without it
def test_residual_and_its_variance(n_dense):
    cfg = load_config("tiny-cpu", [f"data.synthetic.n_dense={n_dense}"]).data.synthetic
    ds = SyntheticAds(cfg, seed=1)
    sbs = [ds.make_batch("test", i, 1024) for i in range(4)]
    r = np.concatenate([sb.ctr_residual for sb in sbs])
    var = np.concatenate([sb.ctr_residual_var for sb in sbs])
    # known = logit(true) - r, and the identifiable prediction is E[sigmoid(known + r')], r' ~ N(0, var).
    for sb in sbs:
        p = sb.true_probs[:, 0]
        known = np.log(p / (1 - p)) - sb.ctr_residual
        assert np.allclose(expected_sigmoid(known, sb.ctr_residual_var), sb.identifiable_probs, atol=1e-12)
    # Zero mean, and the stated variance is the spread (4,096 rows: ~5% relative standard error).
    assert abs(r.mean()) < 4 * math.sqrt(var.mean() / len(r))
    assert (r**2).mean() / var.mean() == pytest.approx(1.0, abs=0.15)
    # Without the view the bias residual is the whole prior (0.16), with it the posterior (0.08).
    assert var.min() >= (0.16 if n_dense <= 4 else 0.08) - 1e-12


def test_identifiable_floor_script_tiny_cpu(tmp_path):
    out = tmp_path / "floor.json"
    res = load_benchmark("identifiable_floor").main(
        ["--config", "tiny-cpu", "--batches", "2", "--batch-size", "512", "--json", str(out)]
    )
    assert res["rows"] == 1024
    assert res["floor_ne"] <= res["identifiable_ne"] < 1.0
    assert json.loads(out.read_text())["identifiable_ne"] == res["identifiable_ne"]


def test_data_synthetic_prints_both_floors(capsys):
    import re

    from gem_train.cli import main

    assert main(["data", "synthetic", "--config", "tiny-cpu"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("ctr:"))
    floor, ident = (float(v) for v in re.findall(r"floor (\d\.\d+)", line))
    assert floor < ident < 1.0, line
