"""benchmarks/quality_run.py: which logged windows count as steady, what an event costs, and (slow) the whole
script on the CPU with two recipes: the per-recipe JSON, the merged JSON and the PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_scripts import load_benchmark


def _rows(step_times: dict[int, float]) -> list[dict]:
    return [
        {"step": s, "split": "train", "step_time_s": t, "examples_per_s": 1 / t}
        for s, t in step_times.items()
    ]


def test_steady_windows_skip_warmup_and_event_windows():
    q = load_benchmark("quality_run")
    rows = _rows({10: 5.0, 20: 1.0, 30: 3.0, 40: 1.0, 50: 1.1, 60: 2.0})
    # Warm-up 10 steps; an evaluation after step 20 (in window (20, 30]); a checkpoint after step 55 (in
    # (50, 60]).
    got = [r["step"] for r in q.steady_windows(rows, events=[20, 55], warmup=10)]
    assert got == [20, 40, 50]
    assert q.window_excess(rows, 20, 1.0) == pytest.approx(20.0)  # 10 steps of 3 s against 1 s
    assert q.window_excess(rows, 55, 1.0) == pytest.approx(10.0)
    assert q.window_excess(rows, 60, 1.0) is None  # after the last window (the final evaluation)


def test_schedule_defaults():
    q = load_benchmark("quality_run")
    assert q.schedule(2000, None, None, None, 50) == {
        "eval_every": 500,
        "checkpoint_every": 1050,
        "warmup_steps": 100,
    }
    assert q.schedule(20, None, None, None, 2) == {"eval_every": 5, "checkpoint_every": 12, "warmup_steps": 5}
    assert q.schedule(20, 7, 3, 1, 2) == {"eval_every": 7, "checkpoint_every": 3, "warmup_steps": 1}
    assert "precision.recipe=none" in q.overrides_for(
        "bf16", 20, q.schedule(20, None, None, None, 2), 2, Path("x")
    )


def _recipe(name: str, device: str, step_s: float, ne: float) -> dict:
    steady = {"window_step_s_median": step_s, "examples_per_s_median": 512 / step_s, "mfu_median": 0.1}
    return {
        "recipe": name, "device": device, "steady": steady, "final_ne": ne, "floor": 0.6,
        "gap_to_floor": ne / 0.6 - 1, "test_ne": [[500, ne + 0.05], [1000, ne]], "warmup_excess_s": 90.0,
        "first_step_s": 95.0, "evaluations": [{"s": 5.0}], "checkpoints": [{"call_s": 4.0}],
    }  # fmt: skip


@pytest.mark.parametrize("fp8_device", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_merge_compares_step_rates_on_one_device_only(tmp_path, fp8_device):
    """Recipes merged from two device sessions compare in NE; their step-rate ratio is left out (None, with
    both devices named) unless both ran on the same device."""
    q = load_benchmark("quality_run")
    for r in (_recipe("bf16", "NVIDIA H200", 0.27, 0.7742), _recipe("fp8_rowwise", fp8_device, 0.33, 0.7746)):
        (tmp_path / r["recipe"]).mkdir()
        (tmp_path / r["recipe"] / q.RECIPE_FILE).write_text(json.dumps(r))
    summary = q.merge(tmp_path, "ctr")
    assert summary["fp8_rowwise_vs_bf16_ne_rel"] == pytest.approx(0.7746 / 0.7742 - 1)
    if fp8_device == "NVIDIA H200":
        assert summary["fp8_rowwise_vs_bf16_step_rate"] == pytest.approx(0.27 / 0.33)
        assert "fp8_rowwise_vs_bf16_devices" not in summary
    else:
        assert summary["fp8_rowwise_vs_bf16_step_rate"] is None
        assert summary["fp8_rowwise_vs_bf16_devices"] == [fp8_device, "NVIDIA H200"]
    assert Path(summary["png"]).stat().st_size > 1000
    table = q._table(summary)  # the printed table takes the missing ratio too
    assert ("no step-rate ratio across devices" in table) == (fp8_device != "NVIDIA H200")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quality_run_tiny_cpu(tmp_path):
    """Two recipes (one process each), 4 steps of tiny-cpu with one-batch evaluations: NE curves, the floor,
    steady windows and event costs are in the JSON, and the PNG exists (194 s on the loaded 2-core box)."""
    argv = "--config tiny-cpu --steps 4 --eval-every 2 --checkpoint-every 3 --log-every 1 --warmup-steps 1"
    extra = ["--set", "train.eval_batches=1", "--out", str(tmp_path)]
    rc = load_benchmark("quality_run").main([*argv.split(), *extra])
    assert rc == 0
    data = json.loads((tmp_path / "quality.json").read_text())
    assert set(data["recipes"]) == {"bf16", "fp8_rowwise"}
    for r in data["recipes"].values():
        assert [s for s, _ in r["test_ne"]] == [2, 4] and r["floor"] is not None and 0 < r["floor"] < 1
        assert r["gap_to_floor"] == pytest.approx(r["final_ne"] / r["floor"] - 1)
        assert r["steady"]["windows"] >= 1 and r["steady"]["window_step_s_median"] > 0
        assert [e["step"] for e in r["evaluations"]] == [2, 4]
        assert r["evaluations"][0]["window_excess_s"] is not None
        assert [c["step"] for c in r["checkpoints"]] == [3, 4] and r["first_step_s"] > 0
    assert "fp8_rowwise_vs_bf16_ne_rel" in data and Path(data["png"]).stat().st_size > 1000
