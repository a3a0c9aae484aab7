"""``benchmarks/seed_sweep.py`` on synthetic data: the floors, and each torch model's test NE against the test
rows' true probabilities beside the identifiable oracle's (``expected_ne``), read from the checkpoint the
sweep chose."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_scripts import BENCHMARKS, load_benchmark


def test_sweep_reports_expected_ne_of_the_chosen_checkpoint(tmp_path, small_overrides, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling scripts, as when run
    threads = torch.get_num_threads()
    sweep = load_benchmark("seed_sweep")
    try:
        code = sweep.main([
            "--config", "tiny-cpu", "--models", "gem", "mlp", "--seeds", "0", "--no-plot",
            "--out", str(tmp_path),
            "--all", *small_overrides, "train.steps=4", "train.valid_every=2", "checkpoint.every=0",
        ])  # fmt: skip
    finally:
        torch.set_num_threads(threads)  # main() sets one thread for its process
    assert code == 0
    results = json.loads((tmp_path / "seed_sweep.json").read_text())["results"]
    excess = load_benchmark("excess_by_slice")
    for model in ("gem", "mlp"):
        r = results[model]["0"]
        run_dir = Path(r["run_dir"])
        # The chosen (best-validation) checkpoint on the test split's one batch of 128 rows.
        want = excess.summarise(excess.collect(run_dir, "best", "test", 1))["expected_ne"]
        assert r["expected_ne"] == want["model"] and r["expected_oracle_ne"] == want["oracle"]
        on_valid = excess.summarise(excess.collect(run_dir, "best", "valid", 1))["expected_ne"]
        assert on_valid["oracle"] != want["oracle"]  # not vacuous: the test rows, not the validation rows
        assert 0 < r["expected_oracle_ne"] < r["expected_ne"]  # four steps are far from the oracle
    assert "expected NE over the oracle" in capsys.readouterr().out
