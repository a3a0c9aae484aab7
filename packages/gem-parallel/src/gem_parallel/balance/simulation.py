"""Simulated load balance across data-parallel ranks: random batches, Base Batch Shuffling, global KK.

The metric, per method and rank count R: the mean over steps of (heaviest rank's batch cost) / (mean rank's
batch cost), batch cost = the cost model's sum over the batch's samples plus its per-step constant.

Sample lengths are production-like histories, capped at ``max_len`` (16k): ``lognormal`` (median 1024,
sigma 1) or ``zipf`` (P(L) ~ L**-1.05 on 1..max_len, the distribution recsys-examples measured on).

How each method is simulated:

- Per-rank methods (random, the BBS policies) need no communication, so the ranks are independent and
  identically distributed. ``sim_ranks`` ranks are run step by step through the very policy code the
  shuffler runs (:mod:`gem_parallel.balance.policies`), after ``warmup`` steps that bring the sliding pool
  to its steady state. For R <= sim_ranks the metric is read off the first R simulated ranks, step by step.
  For larger R, each step's R batch costs are drawn without replacement from all simulated (rank, step)
  costs: R independent ranks of the same stationary process. (The direct and the drawn estimates agree at
  R = sim_ranks; see BENCHMARKS.md.)
- The sliding policy's running mean starts as if the rank had already read ``history`` batches (its
  value is drawn from the normal law of a mean of that many samples), as in a run past its first steps.
- Global balancing (all ranks' samples of a step, Karmarkar–Karp, with and without the swap refinement) is
  simulated jointly for every R, on ``global_steps`` steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gem_parallel.balance.cost import CostModel
from gem_parallel.balance.partition import karmarkar_karp, part_sums, refine_partition
from gem_parallel.balance.policies import plan_pool, sliding_select

__all__ = ["DISTRIBUTIONS", "SimConfig", "sample_lengths", "simulate"]

DISTRIBUTIONS = ("lognormal", "zipf")
ZIPF_ALPHA = 1.05


def sample_lengths(dist: str, n: int, generator: torch.Generator, *, max_len: int = 16384) -> torch.Tensor:
    """``[n]`` float64 history lengths in ``[1, max_len]`` (see the module docstring)."""
    if dist == "lognormal":
        z = torch.randn(n, generator=generator, dtype=torch.float64)
        return torch.exp(math.log(1024.0) + z).round().clamp(1, max_len)
    if dist == "zipf":
        k = torch.arange(1, max_len + 1, dtype=torch.float64)
        cdf = torch.cumsum(k.pow(-ZIPF_ALPHA), 0)
        u = torch.rand(n, generator=generator, dtype=torch.float64) * cdf[-1]
        return (torch.searchsorted(cdf, u) + 1).clamp(max=max_len).to(torch.float64)
    raise ValueError(f"unknown length distribution {dist!r}; choose from {DISTRIBUTIONS}")


@dataclass
class SimConfig:
    """Knobs of :func:`simulate` (defaults: the shuffler's)."""

    sub_batch_size: int = 128
    sub_batches_per_batch: int = 8
    pool_batches: int = 4
    feedback: float = 0.02
    max_wait: int | None = None
    steps: int = 100
    warmup: int = 100
    history: int = 1000
    sim_ranks: int = 128
    global_steps: int = 4
    seed: int = 0

    @property
    def batch(self) -> int:
        return self.sub_batch_size * self.sub_batches_per_batch


def _costs(cost: CostModel, dist: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    n = math.prod(shape)
    return cost.sample_costs(sample_lengths(dist, n, g)).view(shape)


def _sliding(
    cost: CostModel, dist: str, cfg: SimConfig, g: torch.Generator, stats: tuple[float, float]
) -> torch.Tensor:
    """``[steps, sim_ranks]`` batch costs of the sliding policy (after warm-up)."""
    r, b, m = cfg.sim_ranks, cfg.batch, cfg.pool_batches
    p = m * b
    max_wait = 8 * m if cfg.max_wait is None else cfg.max_wait
    mean, std = stats
    pool = _costs(cost, dist, (r, p), g)
    age = torch.zeros((r, p), dtype=torch.int64)
    seen_n = float(cfg.history * b)
    # The running mean after `history` batches: a mean of history * b samples.
    seen_sum = (mean + std / math.sqrt(seen_n) * torch.randn(r, generator=g, dtype=torch.float64)) * seen_n
    seen_sum = seen_sum + pool.sum(1)
    seen_n += p
    valid = torch.ones((r, p), dtype=torch.bool)
    out = []
    for step in range(cfg.warmup + cfg.steps):
        mu = seen_sum / seen_n
        target = b * mu + cfg.feedback * (pool.sum(1) - p * mu)
        sel = sliding_select(pool, valid, age >= max_wait, b, target)
        if step >= cfg.warmup:
            out.append(torch.where(sel, pool, 0.0).sum(1))
        new = _costs(cost, dist, (r * b,), g)
        pool = pool.masked_scatter(sel, new)
        age = torch.where(sel, 0, age + 1)
        seen_sum = seen_sum + new.view(r, b).sum(1)
        seen_n += b
    return torch.stack(out) + cost.step_constant


def _pooled(cost: CostModel, dist: str, cfg: SimConfig, g: torch.Generator, policy: str) -> torch.Tensor:
    """``[steps, sim_ranks]`` batch costs of a pool policy (``"random"`` included)."""
    r, b, m = cfg.sim_ranks, cfg.batch, cfg.pool_batches
    out: list[torch.Tensor] = []
    while len(out) < cfg.steps:
        c = _costs(cost, dist, (r, m * b), g)
        lab = plan_pool(c, m, policy, g)
        sums = torch.zeros((r, m), dtype=torch.float64).scatter_add_(1, lab, c)
        out += list(sums.T)
    return torch.stack(out[: cfg.steps]) + cost.step_constant


def _ratio_direct(costs: torch.Tensor, ranks: int) -> float:
    c = costs[:, :ranks]
    return float((c.max(1).values / c.mean(1)).mean())


def _ratio_drawn(costs: torch.Tensor, ranks: int, steps: int, g: torch.Generator) -> float:
    flat = costs.flatten()
    if flat.numel() < ranks:
        raise ValueError(f"simulate: {flat.numel()} simulated rank-steps cannot stand for {ranks} ranks; "
                         "raise steps or sim_ranks")  # fmt: skip
    vals = []
    for _ in range(steps):
        pick = flat[torch.randperm(flat.numel(), generator=g)[:ranks]]
        vals.append(float(pick.max() / pick.mean()))
    return sum(vals) / len(vals)


def _global(cost: CostModel, dist: str, ranks: int, cfg: SimConfig, g: torch.Generator) -> dict[str, float]:
    kk, ref, secs = [], [], 0.0
    for _ in range(cfg.global_steps):
        c = _costs(cost, dist, (ranks * cfg.batch,), g)
        t0 = time.perf_counter()
        part = karmarkar_karp(c, ranks)
        s = part_sums(c, part, ranks) + cost.step_constant
        kk.append(float(s.max() / s.mean()))
        part = refine_partition(c, part, ranks)
        s = part_sums(c, part, ranks) + cost.step_constant
        ref.append(float(s.max() / s.mean()))
        secs += time.perf_counter() - t0
    return {"global_kk": sum(kk) / len(kk), "global_kk_swaps": sum(ref) / len(ref),
            "global_partition_s": secs / cfg.global_steps}  # fmt: skip


def simulate(
    cost: CostModel, dist: str, ranks: list[int], cfg: SimConfig | None = None, *, log: Any = None
) -> dict[str, Any]:
    """Runs every method for every rank count on one length distribution.

    Returns:
        ``{"dist", "config", "results": {R: {method: mean max/mean ratio, ...}}, "seconds"}`` where methods
        are ``random``, ``bbs_pair``, ``bbs_lpt``, ``bbs_snake``, ``bbs_sliding``, ``global_kk``,
        ``global_kk_swaps`` (and the partition's seconds per step, ``global_partition_s``).
    """
    cfg = cfg or SimConfig()
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed)
    probe = _costs(cost, dist, (1 << 20,), g)
    stats = (float(probe.mean()), float(probe.std()))
    per_rank: dict[str, torch.Tensor] = {}
    for policy in ("random", "pair", "lpt", "snake"):
        t0 = time.perf_counter()
        per_rank["random" if policy == "random" else f"bbs_{policy}"] = _pooled(cost, dist, cfg, g, policy)
        if log:
            log(f"  {dist}: {policy} simulated on {cfg.sim_ranks} ranks in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    per_rank["bbs_sliding"] = _sliding(cost, dist, cfg, g, stats)
    if log:
        log(f"  {dist}: sliding simulated on {cfg.sim_ranks} ranks in {time.perf_counter() - t0:.0f} s")
    results: dict[int, dict[str, float]] = {}
    for r in ranks:
        row = {}
        for name, costs in per_rank.items():
            if r <= cfg.sim_ranks:
                row[name] = _ratio_direct(costs, r)
            else:
                row[name] = _ratio_drawn(costs, r, cfg.steps, g)
        t0 = time.perf_counter()
        row.update(_global(cost, dist, r, cfg, g))
        if log:
            log(f"  {dist}: global balancer on {r} ranks in {time.perf_counter() - t0:.0f} s")
        results[r] = row
    # At R = sim_ranks both estimates exist: they should agree (the drawn one stands in beyond it).
    check = {}
    for name, c in per_rank.items():
        check[name] = {
            "direct": _ratio_direct(c, cfg.sim_ranks),
            "drawn": _ratio_drawn(c, cfg.sim_ranks, cfg.steps, g),
        }
    return {"dist": dist, "cost": getattr(cost, "name", type(cost).__name__), "config": asdict(cfg),
            "sample_cost_mean": stats[0], "sample_cost_std": stats[1], "results": results,
            "drawn_vs_direct": check, "seconds": time.perf_counter() - t_start}  # fmt: skip
