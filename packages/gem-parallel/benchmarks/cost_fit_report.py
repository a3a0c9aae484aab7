"""The load balancer's cost fit, with and without its per-batch constant, from stored measurements (no GPU).

Reads fitted cost files that keep their measured points (``calibrate_cost.py`` writes every point: the shipped
``src/gem_parallel/balance/data/cost_default.json`` and ``benchmarks/results/cost_*.json``) and refits
``step_ms = a * sum(L) + b * sum(L^2) + c`` both ways: with ``c`` (the shipped model) and through the
origin (``c = 0``: what the lengths explain on their own). For each: a, b, c, R^2, the worst and the RMS
relative error, and the share of the mean step time that varies with lengths. A heaviest / mean ratio ``r`` of
the variable cost (what the simulator reports) is ``1 + (r - 1) * V / (V + c)`` of the whole step, V the mean
variable cost.

Usage:
    python packages/gem-parallel/benchmarks/cost_fit_report.py [FILE.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from gem_parallel.balance import default_cost_file, fit_mix_cost


def report(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    points = data.get("points") or []
    if len(points) < 3:
        return [f"{path}: no stored points, cannot refit"]
    s1 = [p["sum_len"] for p in points]
    s2 = [p["sum_len2"] for p in points]
    ms = [p["ms"] for p in points]
    rows = [
        f"{path.name}: {data.get('config', '?')} on {data.get('device', '?')}, "
        f"batch {data.get('batch_size', '?')}, {len(points)} length mixes ({data.get('date', '?')})",
        "| fit | a (ms/event) | b (ms/event^2) | c (ms/batch) | R^2 | worst rel. error | RMS rel. error | "
        "variable share of the mean step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for constant in (True, False):
        fit, r2 = fit_mix_cost(s1, s2, ms, constant=constant)
        pred = [fit.a * x1 + fit.b * x2 + fit.c for x1, x2 in zip(s1, s2, strict=True)]
        rel = [(q - y) / y for q, y in zip(pred, ms, strict=True)]
        rms = math.sqrt(sum(e * e for e in rel) / len(rel))
        variable = sum(fit.a * x1 + fit.b * x2 for x1, x2 in zip(s1, s2, strict=True)) / len(ms)
        rows.append(
            f"| {'with c' if constant else 'without c (c = 0)'} | {fit.a:.3g} | {fit.b:.3g} | {fit.c:.1f} | "
            f"{r2:.3f} | {max(abs(e) for e in rel):.0%} | {rms:.0%} | {variable / (sum(ms) / len(ms)):.0%} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help=f"default: {default_cost_file()}")
    args = ap.parse_args()
    for path in args.files or [default_cost_file()]:
        print("\n".join(report(path)) + "\n")


if __name__ == "__main__":
    main()
