"""Simulated load balance across data-parallel ranks, every rank run: unbalanced batches, Base Batch
Shuffling (each rank on its own stream, no communication) and a global largest-first partition.

The metric, per step: the heaviest rank's batch cost / the mean rank's, over the ``ranks`` ranks of that step,
of the **variable** cost (the cost model's sum over the batch's samples). A per-step constant (``c`` of a
fitted :class:`~gem_parallel.balance.cost.MixCost`) is the same on every rank: it is reported beside the
ratio, never folded into it (it would pull every ratio towards 1). Reported over the measured steps (after
``warmup`` steps): the mean, the worst step, and the mean of the last half.

History lengths follow :class:`LengthLaw`: ``lognormal`` (mean ``mean`` = 512, ``sigma`` 1, rounded, clipped
to ``1..max_len`` = 4096) or ``zipf`` (P(L) ~ L**-1.05 on ``1..max_len``). Both are sampled from their exact
probability table, so the expected cost of a sample (the ``known`` level) is exact.

Methods, all from independent streams (rank r reads its own ``batch`` samples per step):

- ``unbalanced``: each rank trains the batch it read.
- ``global_largest_first``: every step, all ranks' samples, heaviest first, each to the rank that is lightest
  so far among those not yet full (LPT with equal counts; full information, the reference for any balancer).
- ``bbs_<policy>_<level>``: every rank runs its own :class:`~gem_parallel.balance.BaseBatchShuffler` policy
  (the same policy functions, batched over ranks), ``level`` being the expected cost per sample the policy
  aims at: ``known`` (exact, an oracle) or ``running`` (the mean over the samples the rank has read, as the
  shuffler builds it when not given ``mean_cost``; ``history`` batches are counted as read before step 0:
  0 is a cold start) or ``shared`` (the mean over every rank's running sums at step 0, after each has filled
  its first pool, then fixed: what one all-reduce of two numbers per rank at the start gives, passed to every
  rank's shuffler as ``mean_cost``; not simulated by default) or ``common:K`` (the mean cost of one
  calibration sample of ``K`` lengths drawn from the stream's law with the fixed seed
  :data:`COMMON_SEED`, independent of every rank's stream: what every rank computes identically from data
  every rank can read, with no communication; its error is common to all ranks) or ``known:s`` (the exact
  level times ``s``: a level off by a known factor, e.g. ``known:0.98``, to map the margin).

Every rank is simulated (no extrapolation); ranks are processed in chunks of ``rank_chunk`` to bound memory.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gem_parallel.balance.cost import CostModel, calibration_level
from gem_parallel.balance.policies import capped_target, sliding_select, take_overdue

__all__ = [
    "COMMON_SEED",
    "DISTRIBUTIONS",
    "LengthLaw",
    "SimConfig",
    "common_level",
    "global_largest_first",
    "parse_level",
    "sample_lengths",
    "simulate",
    "simulate_bbs",
]

DISTRIBUTIONS = ("lognormal", "zipf")
ZIPF_ALPHA = 1.05
SIM_POLICIES = ("capped", "sliding")
LEVELS = ("running", "known", "shared", "common:K", "known:s")
COMMON_SEED = 20_261_206  # the calibration sample's generator: not any rank's stream seed


def parse_level(level: str) -> tuple[str, float | None]:
    """``"running"`` / ``"known"`` / ``"shared"`` -> ``(name, None)``; ``"common:K"`` -> ``("common", K)``
    (K an int >= 1); ``"known:s"`` -> ``("known", s)`` (s > 0). Raises ``ValueError`` on anything else."""
    name, _, arg = level.partition(":")
    if not arg and name in ("running", "known", "shared"):
        return name, None
    try:
        if name == "common" and int(arg) >= 1 and str(int(arg)) == arg:
            return name, float(int(arg))
        if name == "known" and math.isfinite(float(arg)) and float(arg) > 0:
            return name, float(arg)
    except ValueError:
        pass
    raise ValueError(f"unknown level {level!r}; choose from {LEVELS} (K an int >= 1, s > 0)")


def common_level(cost: CostModel, law: LengthLaw, samples: int, seed: int = COMMON_SEED) -> float:
    """The ``common:K`` level: the mean cost of ``samples`` lengths of ``law`` drawn with ``seed`` alone, so
    every rank (any rank, any chunk) gets the same number (``calibration_level`` of them).
    """
    lengths = law.sample((samples,), torch.Generator().manual_seed(seed))
    return calibration_level(cost, lengths)


@dataclass(frozen=True)
class LengthLaw:
    """A history-length distribution on ``1..max_len``.

    ``lognormal``: ``round(exp(N(m, sigma**2)))`` clipped to ``[1, max_len]``, ``m`` such that the unclipped
    mean is ``mean``. ``zipf``: ``P(L) ~ L**-alpha``.
    """

    dist: str = "lognormal"
    mean: float = 512.0
    sigma: float = 1.0
    max_len: int = 4096
    alpha: float = ZIPF_ALPHA

    def __post_init__(self) -> None:
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"unknown length distribution {self.dist!r}; choose from {DISTRIBUTIONS}")
        if self.max_len < 1 or self.mean <= 0 or self.sigma <= 0:
            raise ValueError(f"LengthLaw needs max_len >= 1, mean > 0, sigma > 0, got {self}")

    def pmf(self) -> torch.Tensor:
        """``[max_len]`` float64: P(L = k) for k = 1..max_len."""
        k = torch.arange(1, self.max_len + 1, dtype=torch.float64)
        if self.dist == "zipf":
            w = k.pow(-self.alpha)
            return w / w.sum()
        m = math.log(self.mean) - self.sigma**2 / 2
        # P(round(exp(X)) = k) = P(k - 1/2 <= exp(X) < k + 1/2); the ends take the clipped mass.
        edges = torch.cat([k - 0.5, k[-1:] + 0.5])
        cdf = torch.special.ndtr((torch.log(edges) - m) / self.sigma)
        cdf[0], cdf[-1] = 0.0, 1.0
        return cdf.diff()

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """``shape`` float64 lengths."""
        cdf = torch.cumsum(self.pmf(), 0)
        u = torch.rand(math.prod(shape), generator=generator, dtype=torch.float64) * cdf[-1]
        idx = torch.searchsorted(cdf, u).clamp(max=self.max_len - 1)
        return (idx + 1).to(torch.float64).view(shape)


def sample_lengths(dist: str, n: int, generator: torch.Generator, **law: Any) -> torch.Tensor:
    """``[n]`` float64 history lengths of ``LengthLaw(dist, **law)``."""
    return LengthLaw(dist, **law).sample((n,), generator)


@dataclass
class SimConfig:
    """Knobs of :func:`simulate` (BBS defaults: the shuffler's, with ``sub_batches_per_batch = 1``)."""

    ranks: int = 1024
    batch: int = 64  # samples (sequences) per rank per step
    pool_batches: int = 8
    steps: int = 300  # measured steps, after `warmup`
    warmup: int = 40
    history: int = 0  # batches the running mean has read before step 0 (0: a cold start)
    headroom: float = 0.02
    feedback: float = 0.01
    max_wait: int | None = None  # default: the shuffler's (16 * pool_batches capped, 8 * sliding)
    soft_wait: int | None = None  # default 4 * pool_batches
    global_steps: int = 20
    rank_chunk: int = 256
    seed: int = 0
    policies: tuple[str, ...] = SIM_POLICIES
    levels: tuple[str, ...] = ("running", "known")
    law: LengthLaw = field(default_factory=LengthLaw)

    def __post_init__(self) -> None:
        for name in ("ranks", "batch", "pool_batches", "steps", "rank_chunk", "global_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.history < 0:
            raise ValueError("SimConfig.warmup and history must be >= 0")
        if bad := set(self.policies) - set(SIM_POLICIES):
            raise ValueError(f"SimConfig.policies: unknown {sorted(bad)}; choose from {SIM_POLICIES}")
        for level in self.levels:
            parse_level(level)

    def wait_bounds(self, policy: str) -> tuple[int, int]:
        """(max_wait, soft_wait) of ``policy``, the shuffler's defaults unless given."""
        hard = (
            (16 if policy == "capped" else 8) * self.pool_batches if self.max_wait is None else self.max_wait
        )
        return hard, 4 * self.pool_batches if self.soft_wait is None else self.soft_wait


def _costs(cost: CostModel, law: LengthLaw, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """``shape`` float64 costs of fresh samples (flat: ``sample_costs`` reads 2-D input as ``[n, S]``)."""
    return cost.sample_costs(law.sample((math.prod(shape),), g)).view(shape)


def _step_stats(costs: torch.Tensor, warmup: int) -> dict[str, float]:
    """``costs``: ``[T, R]`` batch costs; heaviest / mean per step, over the steps after ``warmup``."""
    ratio = (costs.max(1).values / costs.mean(1))[warmup:]
    late = ratio[ratio.numel() // 2 :]
    return {"mean": float(ratio.mean()), "worst": float(ratio.max()), "late": float(late.mean())}


def global_largest_first(costs: torch.Tensor) -> torch.Tensor:
    """Per-rank sums of the global largest-first partition of ``[R, b]`` sample costs: every sample, heaviest
    first, to the lightest rank that holds fewer than ``b`` (LPT with equal counts). ``[R]`` float64."""
    r, b = costs.shape
    items = torch.sort(costs.flatten(), descending=True).values.tolist()
    heap = [(0.0, k) for k in range(r)]  # (load, rank): a heap already (all loads equal)
    count = [0] * r
    load = [0.0] * r
    for x in items:
        s, k = heapq.heappop(heap)
        load[k] = s + x
        count[k] += 1
        if count[k] < b:
            heapq.heappush(heap, (load[k], k))
    return torch.tensor(load, dtype=torch.float64)


def _history_sums(cost: CostModel, cfg: SimConfig, r: int, g: torch.Generator) -> torch.Tensor:
    """``[r]`` cost sums of ``history * batch`` samples per rank: drawn exactly when small, else from the
    normal law of such a sum (its skew is then negligible)."""
    n = cfg.history * cfg.batch
    if n == 0:
        return torch.zeros(r, dtype=torch.float64)
    if r * n <= 1 << 24:
        return _costs(cost, cfg.law, (r, n), g).sum(1)
    pmf = cfg.law.pmf()
    c = cost.sample_costs(torch.arange(1, cfg.law.max_len + 1, dtype=torch.float64))
    mean = float((pmf * c).sum())
    var = float((pmf * (c - mean).square()).sum())
    return n * mean + math.sqrt(n * var) * torch.randn(r, generator=g, dtype=torch.float64)


def _shared_level(cost: CostModel, cfg: SimConfig, seed: int) -> float:
    """The ``shared`` level: every rank's running sum at step 0 (its history and first pool, drawn exactly as
    :func:`simulate_bbs` draws them), summed over all ranks, over all samples read."""
    total, n = 0.0, cfg.pool_batches * cfg.batch
    for c0 in range(0, cfg.ranks, cfg.rank_chunk):
        r = min(cfg.rank_chunk, cfg.ranks - c0)
        g = torch.Generator().manual_seed(seed * 1_000_003 + c0)
        pool = _costs(cost, cfg.law, (r, n), g)
        total += float(pool.sum() + _history_sums(cost, cfg, r, g).sum())
    return total / (cfg.ranks * (cfg.history * cfg.batch + n))


def simulate_bbs(
    cost: CostModel, cfg: SimConfig, policy: str, level: str, mu: float, seed: int
) -> dict[str, Any]:
    """One BBS policy on every rank, each on its own stream.

    Returns:
        ``{"costs": [warmup + steps, ranks] float64 batch costs, "wait_hist": [max_wait + 2] int64 count of
        samples emitted after waiting k batches (the last bin: more), "forced": samples taken at max_wait,
        "held_max": the largest pool excess over the true level, in mean sample costs}``.
    """
    b, n = cfg.batch, cfg.pool_batches * cfg.batch
    max_wait, soft_wait = cfg.wait_bounds(policy)
    total = cfg.warmup + cfg.steps
    out = torch.empty((total, cfg.ranks), dtype=torch.float64)
    wait_hist = torch.zeros(max_wait + 2, dtype=torch.int64)
    forced_n, held_max = 0, -math.inf
    kind, arg = parse_level(level)
    fixed = mu * (arg or 1.0)  # the level unless "running"
    if kind == "shared":
        fixed = _shared_level(cost, cfg, seed)
    elif kind == "common":
        fixed = common_level(cost, cfg.law, int(arg or 0))
    for c0 in range(0, cfg.ranks, cfg.rank_chunk):
        r = min(cfg.rank_chunk, cfg.ranks - c0)
        g = torch.Generator().manual_seed(seed * 1_000_003 + c0)
        pool = _costs(cost, cfg.law, (r, n), g)
        age = torch.zeros((r, n), dtype=torch.int64)
        valid = torch.ones((r, n), dtype=torch.bool)
        seen_sum = _history_sums(cost, cfg, r, g) + pool.sum(1)
        seen_n = float(cfg.history * b + n)
        known = torch.full((r,), fixed, dtype=torch.float64)
        for t in range(total):
            lvl = seen_sum / seen_n if kind == "running" else known
            excess = pool.sum(1) - n * lvl
            hard = age >= max_wait
            forced_n += int(hard.sum())
            if policy == "capped":
                target = capped_target(lvl, excess, b, cfg.headroom, cfg.feedback)
                forced = take_overdue(pool, valid, hard, age, b, target, soft_wait)
            else:
                target = b * lvl + cfg.feedback * excess
                forced = hard
            sel = sliding_select(pool, valid, forced, b, target)
            out[t, c0 : c0 + r] = torch.where(sel, pool, 0.0).sum(1)
            wait_hist += torch.bincount(age[sel].clamp(max=max_wait + 1), minlength=max_wait + 2)
            held_max = max(held_max, float((pool.sum(1) - n * mu).max()) / mu)
            new = _costs(cost, cfg.law, (r * b,), g)
            pool = pool.masked_scatter(sel, new)
            age = torch.where(sel, 0, age + 1)
            seen_sum = seen_sum + new.view(r, b).sum(1)
            seen_n += b
    return {
        "costs": out, "wait_hist": wait_hist, "forced": forced_n, "held_max": held_max,
        "level_error": fixed / mu - 1 if kind != "running" else None,
    }  # fmt: skip


def _wait_stats(hist: torch.Tensor) -> dict[str, float]:
    cum = torch.cumsum(hist, 0).double() / max(int(hist.sum()), 1)
    nz = torch.nonzero(hist).flatten()
    return {
        "wait_p50": int(torch.searchsorted(cum, torch.tensor([0.5], dtype=torch.float64))[0]),
        "wait_p99": int(torch.searchsorted(cum, torch.tensor([0.99], dtype=torch.float64))[0]),
        "wait_max": int(nz.max()) if nz.numel() else 0,
    }


def simulate(cost: CostModel, cfg: SimConfig | None = None, *, log: Any = None) -> dict[str, Any]:
    """Every method on ``cfg.ranks`` ranks for one length law and batch size.

    Returns:
        ``{"config", "sample_cost_mean", "sample_cost_cv", "batch_cost_mean" (variable), "step_constant",
        "methods": {name: {"mean", "worst", "late", ...}}, "seconds"}``; BBS methods add ``wait_p50``,
        ``wait_p99``, ``wait_max`` (batches a sample waited), ``forced`` (samples taken at ``max_wait``),
        ``held_max`` (the largest excess any pool held, in mean sample costs) and ``pool_samples``.
    """
    cfg = cfg or SimConfig()
    t_start = time.perf_counter()
    pmf = cfg.law.pmf()
    per_len = cost.sample_costs(torch.arange(1, cfg.law.max_len + 1, dtype=torch.float64))
    mu = float((pmf * per_len).sum())
    cv = math.sqrt(float((pmf * (per_len - mu).square()).sum())) / mu
    g = torch.Generator().manual_seed(cfg.seed)
    methods: dict[str, dict[str, Any]] = {}
    read = torch.stack(
        [_costs(cost, cfg.law, (cfg.ranks, cfg.batch), g).sum(1) for _ in range(cfg.warmup + cfg.steps)]
    )  # fmt: skip
    methods["unbalanced"] = _step_stats(read, cfg.warmup)
    t0 = time.perf_counter()
    shape = (cfg.ranks, cfg.batch)
    glob = torch.stack(
        [global_largest_first(_costs(cost, cfg.law, shape, g)) for _ in range(cfg.global_steps)]
    )
    methods["global_largest_first"] = {**_step_stats(glob, 0), "seconds_per_step": (time.perf_counter() - t0)
                                       / cfg.global_steps}  # fmt: skip
    for i, policy in enumerate(cfg.policies):
        for j, level in enumerate(cfg.levels):
            t0 = time.perf_counter()
            res = simulate_bbs(cost, cfg, policy, level, mu, cfg.seed * 101 + 10 * i + j + 1)
            methods[f"bbs_{policy}_{level}"] = {
                **_step_stats(res["costs"], cfg.warmup), **_wait_stats(res["wait_hist"]),
                "forced": res["forced"], "held_max": res["held_max"], "level_error": res["level_error"],
                "pool_samples": cfg.pool_batches * cfg.batch,
            }  # fmt: skip
            if log:
                m = methods[f"bbs_{policy}_{level}"]
                log(f"  {cfg.law.dist} b={cfg.batch} P={cfg.pool_batches} {policy}/{level}: {m['mean']:.4f} "
                    f"(worst {m['worst']:.4f}, held max {m['held_max']:.0f}, forced {m['forced']}) in "
                    f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return {
        "config": {**asdict(cfg), "law": asdict(cfg.law)},
        "cost": getattr(cost, "name", type(cost).__name__),
        "sample_cost_mean": mu,
        "sample_cost_cv": cv,
        "batch_cost_mean": mu * cfg.batch,
        "step_constant": float(cost.step_constant),
        "methods": methods,
        "seconds": time.perf_counter() - t_start,
    }
