"""benchmarks/identifiable_floor.py on the tiny-cpu config (2 batches of 512 rows): the recomputed CTR logit
reproduces true_probs, and the identifiable floor lies between the Bayes floor and the base rate."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "identifiable_floor.py"


def _module():
    spec = importlib.util.spec_from_file_location("identifiable_floor", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_expected_sigmoid_quadrature():
    es = _module().expected_sigmoid
    mean = np.array([-2.0, 0.0, 1.5])
    assert np.allclose(es(mean, np.zeros(3)), 1.0 / (1.0 + np.exp(-mean)), atol=1e-15)
    # Symmetry: E[sigmoid(Z s)] = 1/2; and the probit approximation of E[sigmoid(m + s Z)] to ~1e-2.
    assert es(np.zeros(1), np.full(1, 2.0))[0] == pytest.approx(0.5, abs=1e-12)
    approx = 1.0 / (1.0 + np.exp(-1.5 / math.sqrt(1.0 + math.pi * 0.5 / 8.0)))
    assert abs(es(np.array([1.5]), np.array([0.5]))[0] - approx) < 1e-2


def test_identifiable_floor_tiny_cpu(tmp_path):
    out = tmp_path / "floor.json"
    res = _module().main(
        ["--config", "tiny-cpu", "--batches", "2", "--batch-size", "512", "--json", str(out)]
    )
    assert res["rows"] == 1024
    assert res["reproduce_max_abs_err"] <= 1e-9  # main raises past 1e-9 too
    assert res["identifiable_ne"] >= res["floor_ne"] - 1e-9
    assert res["identifiable_ne"] < 1.0
    assert json.loads(out.read_text())["identifiable_ne"] == res["identifiable_ne"]
