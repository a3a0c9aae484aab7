"""``python -m gem_parallel.balance simulate ...``: the load-balance simulator (see simulation.py).

Example (the table in BENCHMARKS.md)::

    python -m gem_parallel.balance simulate --ranks 8 64 1024 4096 --dist lognormal zipf --json sim.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from gem_parallel.balance.cost import MixCost, default_cost_file, get_cost_model
from gem_parallel.balance.simulation import DISTRIBUTIONS, SimConfig, simulate

METHODS = ("random", "bbs_pair", "bbs_lpt", "bbs_snake", "bbs_sliding", "global_kk", "global_kk_swaps")


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gem_parallel.balance")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="heaviest / mean rank cost of each balancing method")
    s.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024, 4096])
    s.add_argument("--dist", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    s.add_argument("--cost-file", default=None, help="fitted mix-cost JSON (default: the shipped fit)")
    s.add_argument("--cost", default=None, help="linear | attention | mix (overrides --cost-file)")
    s.add_argument("--json", default=None, help="write the results to this file")
    d = SimConfig()
    for name in ("sub_batch_size", "sub_batches_per_batch", "pool_batches", "steps", "warmup", "history",
                 "sim_ranks", "global_steps", "seed"):  # fmt: skip
        s.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    s.add_argument("--feedback", type=float, default=d.feedback)
    s.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: best on a shared machine)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cost = get_cost_model(a.cost) if a.cost else MixCost.from_json(a.cost_file or default_cost_file())
    cfg = SimConfig(**{k: getattr(a, k) for k in ("sub_batch_size", "sub_batches_per_batch", "pool_batches",
                                                  "steps", "warmup", "history", "sim_ranks", "global_steps",
                                                  "seed", "feedback")})  # fmt: skip
    if any(r < 1 for r in a.ranks):
        ap.error("--ranks must be >= 1")
    if isinstance(cost, MixCost):
        where = ", ".join(f"{k} {cost.meta[k]}" for k in ("config", "device", "date", "r2") if k in cost.meta)
        print(f"cost: mix a={cost.a:.4g} b={cost.b:.4g} c={cost.c:.4g} {cost.units} ({where})", flush=True)
    else:
        print(f"cost: {cost.name}", flush=True)
    runs = []
    for dist in a.dist:
        res = simulate(
            cost, dist, sorted(a.ranks), cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True)
        )
        runs.append(res)
        print(f"\n{dist} ({res['seconds']:.0f} s): mean over steps of max-rank / mean-rank batch cost")
        print("| ranks | " + " | ".join(METHODS) + " |")
        print("|---:|" + "---:|" * len(METHODS))
        for r, row in res["results"].items():
            print(f"| {r} | " + " | ".join(f"{row[m]:.4f}" for m in METHODS) + " |")
    out = {"cost": {"name": getattr(cost, "name", ""), **({"a": cost.a, "b": cost.b, "c": cost.c, **cost.meta}
                                                          if isinstance(cost, MixCost) else {})},
           "runs": runs}  # fmt: skip
    if a.json:
        _write_json(Path(a.json), out)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
