"""Cost models (fit recovers known coefficients, with and without the constant, JSON round trip, shipped
default) and the simulator (length laws, the global partition, a small run, the CLI)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gem_parallel.balance import (
    AttentionCost,
    LinearCost,
    MixCost,
    calibration_level,
    default_cost_file,
    fit_mix_cost,
    get_cost_model,
)
from gem_parallel.balance.__main__ import main as cli
from gem_parallel.balance.simulation import (
    COMMON_SEED,
    LengthLaw,
    SimConfig,
    _shared_level,
    common_level,
    global_largest_first,
    parse_level,
    sample_lengths,
    simulate,
    simulate_bbs,
)


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


def test_fit_without_constant() -> None:
    """Times with no constant: both fits recover a and b. Times with a large constant: the fit through the
    origin cannot explain them (R^2 far below the fit with c), which is what the report shows."""
    s1 = torch.linspace(1e3, 1e5, 20, dtype=torch.float64)
    s2 = s1 * torch.linspace(1, 300, 20, dtype=torch.float64).flip(0)
    bare = 2e-3 * s1 + 1e-6 * s2
    fit, r2 = fit_mix_cost(s1, s2, bare, constant=False)
    assert (fit.a, fit.b, fit.c) == pytest.approx((2e-3, 1e-6, 0.0), rel=1e-6, abs=1e-12) and r2 > 0.999999
    with_c, r2_c = fit_mix_cost(s1, s2, bare + 500.0)
    without_c, r2_0 = fit_mix_cost(s1, s2, bare + 500.0, constant=False)
    assert with_c.c == pytest.approx(500.0) and r2_c > 0.999999
    assert without_c.c == 0.0 and r2_0 < r2_c - 0.05


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


def test_length_laws() -> None:
    """Exact tables: they sum to 1; log-normal (mean 512, sigma 1, clipped to 4096) has the clipped mean of
    the law (below 512 by the clipped tail), zipf is L**-1.05; samples follow the table (5 sigma per cell)."""
    g = torch.Generator().manual_seed(0)
    k = torch.arange(1, 4097, dtype=torch.float64)
    ln, zipf = LengthLaw("lognormal"), LengthLaw("zipf")
    for law in (ln, zipf):
        p = law.pmf()
        assert p.shape == (4096,) and float(p.sum()) == pytest.approx(1.0) and float(p.min()) >= 0
        x = law.sample((200_000,), g)
        assert float(x.min()) >= 1 and float(x.max()) <= 4096
        counts = torch.bincount(x.long() - 1, minlength=4096).double()
        expect = 200_000 * p
        for lo, hi in ((0, 1), (1, 8), (8, 64), (64, 512), (512, 4095), (4095, 4096)):
            c, e = float(counts[lo:hi].sum()), float(expect[lo:hi].sum())
            assert abs(c - e) <= 5 * e**0.5 + 1, (law.dist, lo, hi, c, e)
    mean = float((ln.pmf() * k).sum())
    assert 490 < mean < 512  # the unclipped law's mean is 512; clipping at 4096 takes ~1.8%
    zp = zipf.pmf()
    assert float(zp[1] / zp[0]) == pytest.approx(2**-1.05)
    assert sample_lengths("zipf", 10, g).shape == (10,)
    with pytest.raises(ValueError, match="unknown length"):
        LengthLaw("pareto")


def test_global_largest_first() -> None:
    """Every sample placed once (the sums add up), equal counts, and near-perfect on a heavy-tailed step;
    a hand case: one sample far heavier than the rest stays alone at the top."""
    g = torch.Generator().manual_seed(0)
    c = torch.exp(torch.randn((64, 32), generator=g, dtype=torch.float64))
    s = global_largest_first(c)
    assert float(s.sum()) == pytest.approx(float(c.sum()))
    assert float(s.max() / s.mean()) < 1.01 < float(c.sum(1).max() / c.sum(1).mean())
    hand = torch.tensor([[100.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    assert sorted(global_largest_first(hand).tolist()) == [2.0, 2.0, 101.0]


def test_simulator_small() -> None:
    """16 ranks, batches of 16, log-normal lengths: the methods are ordered as expected; the global partition
    is within 5% of perfect; the running level is worse than the known one (its spread over ranks); waits
    stay within max_wait; a run is a function of its seed."""
    cfg = SimConfig(ranks=16, batch=16, pool_batches=4, steps=12, warmup=4, global_steps=1, rank_chunk=16,
                    law=LengthLaw("lognormal", mean=64.0, max_len=256))  # fmt: skip
    res = simulate(MixCost(64.0, 1.0, 7.0), cfg)
    m = res["methods"]
    assert m["unbalanced"]["mean"] > m["bbs_capped_known"]["mean"] > 1.0
    assert m["global_largest_first"]["mean"] < 1.05
    assert m["bbs_capped_running"]["mean"] > m["bbs_capped_known"]["mean"]
    for name, max_wait in (("bbs_capped_known", 64), ("bbs_sliding_running", 32)):  # 16 / 8 pool batches
        assert m[name]["wait_max"] <= max_wait and m[name]["worst"] >= m[name]["mean"] >= 1.0
    assert res["step_constant"] == 7.0  # reported, not folded in
    assert res["batch_cost_mean"] == pytest.approx(16 * res["sample_cost_mean"])
    a, b = (simulate_bbs(MixCost(64.0, 1.0, 7.0), cfg, "capped", "running", 1e3, seed=5) for _ in range(2))
    assert torch.equal(a["costs"], b["costs"]) and torch.equal(
        a["wait_hist"], b["wait_hist"]
    )  # deterministic
    with pytest.raises(ValueError, match="policies"):
        SimConfig(policies=("nope",))


def test_cli(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    rc = cli(["simulate", "--ranks", "4", "--batch", "8", "--pool-batches", "2", "--dist", "zipf",
              "--steps", "4", "--warmup", "2", "--global-steps", "1", "--max-len", "256",
              "--cost-c", "3", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["config"]["law"]["dist"] == "zipf" and run["step_constant"] == 3.0
    assert {"unbalanced", "global_largest_first", "bbs_capped_running", "bbs_sliding_known"} <= run[
        "methods"
    ].keys()
    printed = capsys.readouterr().out
    assert "| zipf | 4 | 8 | 2 | 0 | 0.02 | bbs_capped_running |" in printed and "step constant 3" in printed


def test_shared_level_is_the_mean_of_everything_read_at_step_0() -> None:
    """``shared``: one number for every rank, the plain mean over all samples every rank has read before its
    first batch (history and first pool, chunked ranks); close to the exact level, and the shared run balances
    like the known one, better than the ranks' own running means."""
    law = LengthLaw("lognormal", mean=64.0, max_len=256)
    cost = MixCost(64.0, 1.0, 0.0)
    levels, capped = ("running", "known", "shared"), ("capped",)
    cfg = SimConfig(ranks=12, batch=8, pool_batches=4, steps=10, warmup=4, history=2, global_steps=1,
                    rank_chunk=5, levels=levels, policies=capped, law=law)  # fmt: skip
    read = []
    for c0 in range(0, 12, 5):  # the draws of each chunk: its first pool, then its history
        g = torch.Generator().manual_seed(3 * 1_000_003 + c0)
        r = min(5, 12 - c0)
        read += [cost.sample_costs(law.sample((r * 32,), g)), cost.sample_costs(law.sample((r * 16,), g))]
    reference = torch.cat(read).mean()
    assert _shared_level(cost, cfg, 3) == pytest.approx(float(reference), rel=1e-12)
    pmf = law.pmf()
    mu = float((pmf * cost.sample_costs(torch.arange(1, 257, dtype=torch.float64))).sum())
    assert abs(float(reference) / mu - 1) < 0.1  # the mean of 576 samples
    cfg = SimConfig(ranks=64, batch=16, pool_batches=4, steps=30, warmup=5, global_steps=1,
                    levels=levels, policies=capped, law=law)  # fmt: skip
    m = simulate(cost, cfg)["methods"]
    assert m["bbs_capped_shared"]["mean"] < m["bbs_capped_running"]["mean"]
    assert abs(m["bbs_capped_shared"]["mean"] - m["bbs_capped_known"]["mean"]) < 0.02


def test_calibration_level_is_the_plain_mean_and_order_free() -> None:
    """``calibration_level``: the mean of the cost model over a calibration sample's ragged ``[n, S]``
    lengths (0 and 1 included), equal to a plain float64 mean to 1e-12 (fsum vs torch's pairwise sum), and
    bit-identical under any permutation of the rows (ranks reading the same rows in another order)."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 300, (1001, 3), generator=g)
    lengths[:5] = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [299, 299, 299]])
    cost = MixCost(3.0, 0.25, 100.0)
    tot = lengths.sum(1).double()
    reference = float((3.0 * tot + 0.25 * tot * tot).mean())
    level = calibration_level(cost, lengths)
    assert level == pytest.approx(reference, rel=1e-12)
    for seed in range(3):
        perm = torch.randperm(1001, generator=torch.Generator().manual_seed(seed))
        assert calibration_level(cost, lengths[perm]) == level  # bit-identical
    assert calibration_level("linear", torch.tensor([[2, 3], [0, 0]])) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="empty"):
        calibration_level(cost, torch.zeros(0, 2, dtype=torch.int64))


def test_common_level_is_one_number_for_every_rank() -> None:
    """``common:K``: the mean cost of K lengths drawn with ``COMMON_SEED`` alone: equal to a plain reference
    mean of those draws; the same whatever the run's seed or its chunking of ranks (every rank uses it, as
    ``level_error`` shows); a common level from a large sample balances like the known one, better than the
    ranks' own running means; bad level names are refused."""
    law = LengthLaw("lognormal", mean=64.0, max_len=256)
    cost = MixCost(64.0, 1.0, 0.0)
    draws = law.sample((4096,), torch.Generator().manual_seed(COMMON_SEED))
    reference = float((64.0 * draws + draws * draws).mean())
    assert common_level(cost, law, 4096) == pytest.approx(reference, rel=1e-12)
    assert common_level(cost, law, 4096) != common_level(cost, law, 4096, seed=COMMON_SEED + 1)
    pmf = law.pmf()
    mu = float((pmf * cost.sample_costs(torch.arange(1, 257, dtype=torch.float64))).sum())
    errors = set()
    for seed, chunk in ((1, 3), (2, 8), (9, 5)):
        cfg = SimConfig(ranks=8, batch=8, pool_batches=4, steps=3, warmup=1, global_steps=1, rank_chunk=chunk,
                        law=law)  # fmt: skip
        errors.add(simulate_bbs(cost, cfg, "capped", "common:4096", mu, seed)["level_error"])
    assert errors == {reference / mu - 1}
    levels = ("running", "known", "common:65536")
    cfg = SimConfig(ranks=64, batch=16, pool_batches=4, steps=30, warmup=5, global_steps=1,
                    levels=levels, policies=("capped",), law=law)  # fmt: skip
    m = simulate(cost, cfg)["methods"]
    assert abs(m["bbs_capped_common:65536"]["level_error"]) < 0.02  # sigma CV / 256 < 1% here
    assert m["bbs_capped_common:65536"]["mean"] < m["bbs_capped_running"]["mean"]
    assert abs(m["bbs_capped_common:65536"]["mean"] - m["bbs_capped_known"]["mean"]) < 0.02
    assert parse_level("common:16384") == ("common", 16384.0) and parse_level("known:0.98") == ("known", 0.98)
    for bad in ("common", "common:0", "common:1.5", "known:-1", "shared:2", "oracle"):
        with pytest.raises(ValueError, match="level"):
            parse_level(bad)
