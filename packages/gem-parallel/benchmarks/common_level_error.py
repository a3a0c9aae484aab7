"""The error of a common level, by calibration sample size: how far the mean cost of K lengths lands from the
exact expected cost (no simulation of ranks; CPU, seconds).

For each length law (``lognormal``, ``zipf``: the simulator's :class:`~gem_parallel.balance.simulation.
LengthLaw`) and each K, the relative error of ``common_level(cost, law, K, seed)`` over ``--seeds`` seeds
(one calibration sample each): its standard deviation and quantiles, and the share of seeds outside the
capped policy's window — below ``-headroom / (1 + headroom)`` (every cap under the true mean: the pools hold
an ever-growing deficit) or above ``--high`` (the heaviest rank then exceeds ~(1 + headroom)(1 + high)).
The error at the simulator's fixed ``COMMON_SEED`` (what ``--levels common:K`` uses) is given beside.

Usage:
    python packages/gem-parallel/benchmarks/common_level_error.py [--k 1024 4096 16384 65536 262144]
        [--seeds 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gem_parallel.balance import MixCost
from gem_parallel.balance.simulation import DISTRIBUTIONS, LengthLaw, common_level


def errors(cost: MixCost, law: LengthLaw, k: int, seeds: int) -> tuple[torch.Tensor, float]:
    """``[seeds]`` float64 relative errors of the K-sample level (seeds 0..), and the error at COMMON_SEED."""
    per_len = cost.sample_costs(torch.arange(1, law.max_len + 1, dtype=torch.float64))
    mu = float((law.pmf() * per_len).sum())
    errs = torch.tensor(
        [common_level(cost, law, k, seed=s) / mu - 1 for s in range(seeds)], dtype=torch.float64
    )
    return errs, common_level(cost, law, k) / mu - 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 262144])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--headroom", type=float, default=0.02)
    ap.add_argument("--high", type=float, default=0.007, help="the error above which 1.03 x global is lost")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cost = MixCost(512.0, 1.0, 0.0)
    low = -a.headroom / (1 + a.headroom)
    q = torch.tensor([0.01, 0.05, 0.5, 0.95, 0.99], dtype=torch.float64)
    rows = []
    print(f"| dist | K | error at COMMON_SEED | std | q1 / q5 / q50 / q95 / q99 | below {100 * low:.2f}% | "
          f"above {100 * a.high:+.2f}% |\n|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for dist in DISTRIBUTIONS:
        for k in a.k:
            errs, fixed = errors(cost, LengthLaw(dist), k, a.seeds)
            qs = torch.quantile(errs, q).tolist()
            row = {"dist": dist, "k": k, "seeds": a.seeds, "fixed_seed_error": fixed,
                   "std": float(errs.std()),
                   "quantiles": dict(zip(("q1", "q5", "q50", "q95", "q99"), qs, strict=True)),
                   "below_low": float((errs < low).double().mean()),
                   "above_high": float((errs > a.high).double().mean())}  # fmt: skip
            rows.append(row)
            print(
                f"| {dist} | {k} | {100 * fixed:+.2f}% | {100 * row['std']:.2f}% | "
                + " / ".join(f"{100 * x:+.2f}" for x in qs)
                + f" | {100 * row['below_low']:.1f}% | {100 * row['above_high']:.1f}% |",
                flush=True,
            )
    print(f"(CV / sqrt(K) predicts the std; {a.seeds} seeds each)")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"headroom": a.headroom, "high": a.high, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
