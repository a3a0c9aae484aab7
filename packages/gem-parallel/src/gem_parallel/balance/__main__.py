"""``python -m gem_parallel.balance simulate ...``: the load-balance simulator (see simulation.py).

Every rank is run. The figures are heaviest / mean rank of the *variable* batch cost (the cost model's sum
over the batch); a per-step constant is printed beside them, not folded in. Lists (``--ranks``, ``--batch``,
``--pool-batches``, ``--history``, ``--headroom``) run every combination. Example (BENCHMARKS.md, "Load
balancing where it is hard")::

    python -m gem_parallel.balance simulate --ranks 1024 --batch 64 --dist lognormal zipf --json sim.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from gem_parallel.balance.cost import CostModel, MixCost, default_cost_file, get_cost_model
from gem_parallel.balance.simulation import (
    DISTRIBUTIONS,
    LEVELS,
    SIM_POLICIES,
    LengthLaw,
    SimConfig,
    parse_level,
    simulate,
)

COLUMNS = ("mean", "worst", "late", "wait_p99", "wait_max", "held_max", "forced", "level_error")


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _cost(a: argparse.Namespace) -> CostModel:
    if a.cost:
        return get_cost_model(a.cost)
    if a.cost_file:
        return MixCost.from_json(a.cost_file)
    return MixCost(a.cost_a, a.cost_b, a.cost_c, units="", meta={"source": "--cost-a/--cost-b/--cost-c"})


def _describe(cost: CostModel) -> str:
    if isinstance(cost, MixCost):
        where = ", ".join(f"{k} {cost.meta[k]}" for k in ("config", "device", "date", "r2") if k in cost.meta)
        return (
            f"a*L + b*L^2 with a={cost.a:.4g}, b={cost.b:.4g} (step constant c={cost.c:.4g} {cost.units}"
            + (f"; {where})" if where else ")")
        )
    return f"{cost.name} (step constant {cost.step_constant:.4g})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gem_parallel.balance")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="heaviest / mean rank of the variable batch cost, every rank run")
    d = SimConfig()
    s.add_argument("--ranks", type=int, nargs="+", default=[d.ranks])
    s.add_argument("--batch", type=int, nargs="+", default=[d.batch], help="samples per rank per step")
    s.add_argument("--pool-batches", type=int, nargs="+", default=[d.pool_batches])
    s.add_argument("--history", type=int, nargs="+", default=[d.history],
                   help="batches the running mean has read before step 0 (0: cold start)")  # fmt: skip
    s.add_argument("--headroom", type=float, nargs="+", default=[d.headroom])
    s.add_argument("--dist", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    s.add_argument("--policies", nargs="+", choices=SIM_POLICIES, default=list(d.policies))
    s.add_argument("--levels", nargs="+", default=list(d.levels), metavar="LEVEL",
                   help=f"of {LEVELS}; common:K = the mean cost of one calibration sample of K lengths, the "
                   "same on every rank (e.g. common:65536); known:s = the exact level times s")  # fmt: skip
    for name in ("steps", "warmup", "global_steps", "rank_chunk", "seed"):
        s.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    s.add_argument(
        "--max-wait", type=int, default=None, help="default 16 (capped) / 8 (sliding) * pool batches"
    )
    s.add_argument("--soft-wait", type=int, default=None, help="default 4 * pool batches")
    s.add_argument("--feedback", type=float, default=d.feedback)
    law = LengthLaw()
    s.add_argument("--length-mean", type=float, default=law.mean, help="log-normal mean before clipping")
    s.add_argument("--sigma", type=float, default=law.sigma)
    s.add_argument("--max-len", type=int, default=law.max_len)
    s.add_argument("--zipf-alpha", type=float, default=law.alpha)
    s.add_argument("--cost-a", type=float, default=512.0, help="cost a*L + b*L^2 per sample (default 512, 1)")
    s.add_argument("--cost-b", type=float, default=1.0)
    s.add_argument("--cost-c", type=float, default=0.0, help="per-step constant (reported, never folded in)")
    s.add_argument("--cost-file", default=None, help=f"a fitted mix-cost JSON (e.g. {default_cost_file()})")
    s.add_argument("--cost", default=None, help="linear | attention | mix (the shipped fit)")
    s.add_argument("--json", default=None, help="write every result to this file")
    s.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: best on a shared machine)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if any(v < 1 for v in (*a.ranks, *a.batch, *a.pool_batches)):
        ap.error("--ranks, --batch and --pool-batches must be >= 1")
    for level in a.levels:
        try:
            parse_level(level)
        except ValueError as e:
            ap.error(f"--levels: {e}")
    cost = _cost(a)
    print(f"cost: {_describe(cost)}", flush=True)
    print("metric: heaviest / mean rank of the variable batch cost per step, over the steps after --warmup "
          f"{a.warmup} (mean, worst step, mean of the last half); waits in batches; held_max: the largest "
          "pool excess, in mean sample costs", flush=True)  # fmt: skip
    header = "| dist | ranks | batch | pool | history | headroom | method | " + " | ".join(COLUMNS) + " |"
    print("\n" + header + "\n|" + "---|" * 7 + "---:|" * len(COLUMNS), flush=True)
    runs = []
    for dist, ranks, batch, pool, history, headroom in itertools.product(
        a.dist, a.ranks, a.batch, a.pool_batches, a.history, a.headroom
    ):
        cfg = SimConfig(
            ranks=ranks, batch=batch, pool_batches=pool, steps=a.steps, warmup=a.warmup, history=history,
            headroom=headroom, feedback=a.feedback, max_wait=a.max_wait, soft_wait=a.soft_wait,
            global_steps=a.global_steps, rank_chunk=a.rank_chunk, seed=a.seed, policies=tuple(a.policies),
            levels=tuple(a.levels), law=LengthLaw(dist, a.length_mean, a.sigma, a.max_len, a.zipf_alpha),
        )  # fmt: skip
        res = simulate(cost, cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        runs.append(res)
        for name, m in res["methods"].items():
            cells = [f"{m[c]:.4f}" if c in ("mean", "worst", "late") else
                     f"{100 * m[c]:+.2f}%" if c == "level_error" and m.get(c) is not None else
                     (f"{m[c]:.0f}" if m.get(c) is not None and c != "level_error" else "")
                     for c in COLUMNS]  # fmt: skip
            print(f"| {dist} | {ranks} | {batch} | {pool} | {history} | {headroom} | {name} | "
                  + " | ".join(cells) + " |", flush=True)  # fmt: skip
        print(
            f"<!-- {dist} ranks {ranks} batch {batch}: mean sample cost {res['sample_cost_mean']:.4g} "
            f"(CV {res['sample_cost_cv']:.3f}), mean variable batch cost {res['batch_cost_mean']:.4g}, "
            f"step constant {res['step_constant']:.4g} not included; {res['seconds']:.0f} s -->",
            flush=True,
        )
    if a.json:
        _write_json(Path(a.json), {"cost": _describe(cost), "runs": runs})
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
