"""Cost models (fit recovers known coefficients, JSON round trip, shipped default) and the simulator."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gem_parallel.balance import (
    AttentionCost,
    LinearCost,
    MixCost,
    default_cost_file,
    fit_mix_cost,
    get_cost_model,
)
from gem_parallel.balance.__main__ import main as cli
from gem_parallel.balance.simulation import SimConfig, sample_lengths, simulate


def test_cost_models_on_ragged_lengths() -> None:
    lengths = torch.tensor([[0, 3], [1, 0], [4, 5]])  # two sequences per sample, merged: L = 3, 1, 9
    torch.testing.assert_close(
        LinearCost().sample_costs(lengths), torch.tensor([3.0, 1.0, 9.0], dtype=torch.float64)
    )
    torch.testing.assert_close(
        AttentionCost().sample_costs([3, 1, 9]), torch.tensor([9.0, 1, 81], dtype=torch.float64)
    )
    mix = MixCost(2.0, 0.5, 7.0)
    torch.testing.assert_close(mix.sample_costs([0, 2]), torch.tensor([0.0, 6.0], dtype=torch.float64))
    assert mix.step_constant == 7.0
    with pytest.raises(ValueError, match=">= 0"):
        LinearCost().sample_costs([1, -2])
    with pytest.raises(ValueError, match="finite"):
        MixCost(float("nan"), 0, 0)
    with pytest.raises(ValueError, match="unknown cost"):
        get_cost_model("quadratic")


def test_fit_recovers_known_coefficients() -> None:
    """Batches with independent sum(L) and sum(L^2). Exact times: a, b, c come back to 1e-6. With 0.5%
    noise on each time (~5 ms here, about 1/10 of c): a and b to 3%, R^2 > 0.99."""
    g = torch.Generator().manual_seed(0)
    a, b, c = 3e-3, 2e-6, 40.0
    s1, s2 = [], []
    for i in range(40):
        lengths = torch.exp(math.log(50 + 40 * i) + (0.2 + (i % 5) * 0.3) * torch.randn(256, generator=g))
        lengths = lengths.round().clamp(0, 8000).double()
        s1.append(float(lengths.sum()))
        s2.append(float(lengths.square().sum()))
    t1, t2 = torch.tensor(s1), torch.tensor(s2)
    exact = a * t1 + b * t2 + c
    fit, r2 = fit_mix_cost(t1, t2, exact)
    assert (fit.a, fit.b, fit.c) == pytest.approx((a, b, c), rel=1e-6) and r2 == pytest.approx(1.0)
    noisy = exact * (1 + 0.005 * torch.randn(40, generator=g, dtype=torch.float64))
    fit, r2 = fit_mix_cost(t1, t2, noisy)
    assert fit.a == pytest.approx(a, rel=0.03) and fit.b == pytest.approx(b, rel=0.03)
    assert r2 > 0.99 and fit.meta["r2"] == r2
    with pytest.raises(ValueError, match=">= 3"):
        fit_mix_cost([1.0], [1.0], [1.0])


def test_fit_drops_an_invisible_term() -> None:
    # Purely linear times: the L^2 coefficient must not come out negative.
    s1 = torch.linspace(1e3, 1e5, 20, dtype=torch.float64)
    s2 = s1 * torch.linspace(1, 300, 20, dtype=torch.float64).flip(0)
    fit, r2 = fit_mix_cost(s1, s2, 1e-3 * s1 + 5 + 1e-3 * torch.sin(s1))
    assert fit.b >= 0 and fit.a == pytest.approx(1e-3, rel=0.01) and r2 > 0.999


def test_json_round_trip_and_default(tmp_path) -> None:
    fit = MixCost(1e-3, 2e-7, 12.5, meta={"device": "test", "batch_size": 256})
    path = tmp_path / "sub" / "cost.json"
    fit.to_json(path)
    assert not list(path.parent.glob(".*tmp"))  # the temp file was renamed
    back = get_cost_model(str(path))
    assert isinstance(back, MixCost) and (back.a, back.b, back.c) == (fit.a, fit.b, fit.c)
    assert back.meta["device"] == "test"
    default = json.loads(default_cost_file().read_text())
    assert {"a", "b", "c", "device", "date"} <= default.keys()
    assert isinstance(get_cost_model("mix"), MixCost)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="keys a, b, c"):
        MixCost.from_json(tmp_path / "bad.json")


def test_length_distributions() -> None:
    g = torch.Generator().manual_seed(0)
    for dist in ("lognormal", "zipf"):
        x = sample_lengths(dist, 100_000, g)
        assert float(x.min()) >= 1 and float(x.max()) <= 16384
    z = sample_lengths("zipf", 100_000, g)
    assert float((z == 1).double().mean()) > 0.05 and float(z.max()) > 8000  # mass at 1, a long tail
    with pytest.raises(ValueError, match="unknown length"):
        sample_lengths("pareto", 3, g)


def test_simulator_small() -> None:
    """A small run (16 sim ranks, batches of 64): the methods are ordered as expected, the global balancer
    is within 1% of perfect, and where both exist the drawn estimate agrees with the direct one."""
    cfg = SimConfig(sub_batch_size=16, sub_batches_per_batch=4, pool_batches=4, steps=24, warmup=24,
                    history=200, sim_ranks=16, global_steps=2)  # fmt: skip
    res = simulate(AttentionCost(), "lognormal", [8, 64], cfg)
    for r in (8, 64):
        row = res["results"][r]
        assert row["random"] > row["bbs_snake"] > row["bbs_sliding"] > 1.0
        assert row["global_kk_swaps"] <= row["global_kk"] and row["global_kk_swaps"] < 1.01
    assert res["results"][64]["random"] > res["results"][8]["random"]  # the max of more ranks is higher
    for name, v in res["drawn_vs_direct"].items():
        assert v["drawn"] == pytest.approx(v["direct"], rel=0.05), name


def test_cli(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    rc = cli(["simulate", "--ranks", "4", "--dist", "zipf", "--cost", "linear", "--sub-batch-size", "8",
              "--sub-batches-per-batch", "2", "--steps", "4", "--warmup", "4", "--sim-ranks", "4",
              "--global-steps", "1", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["runs"][0]["dist"] == "zipf" and "4" in data["runs"][0]["results"]
    assert "| 4 |" in capsys.readouterr().out
