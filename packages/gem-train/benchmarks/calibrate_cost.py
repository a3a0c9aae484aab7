"""Calibrate the load balancer's cost model: time fwd+bwd of a gem-model config on batches of different
length mixes and fit ``step_ms = a * sum(L) + b * sum(L**2) + c`` (L: a user's merged history length).

Each batch is a ``gem_model.random_batch`` of ``--batch-size`` users whose log-normal history lengths have
their own median (``max_len / 64`` to ``max_len / 2.5``) and sigma (0.2 to 1.5), so that sum(L) and sum(L**2)
vary independently enough to separate a from b. Every batch runs once untimed (kernels compile and
autotune for its shapes), then ``--repeats`` times timed; its time is the median. The fit (least squares,
:func:`gem_parallel.balance.fit_mix_cost`), its R**2, the fit through the origin (``c = 0``) and every
measured point go to ``DIR/cost_<config>_<device>.json``, the file the simulator reads with ``--cost-file``
(and the shuffler with ``cost=PATH``). Ship a fit as the default by copying it to
``packages/gem-parallel/src/gem_parallel/balance/data/cost_default.json``.

Usage (H200, ~1-2 min; PYTHONPATH must hold packages/*/src):
    python packages/gem-train/benchmarks/calibrate_cost.py --config base --batch-size 256 --out $OUT
CPU check of the script (tiny config, ~1 min):
    python packages/gem-train/benchmarks/calibrate_cost.py --config tiny --batch-size 64 --batches 12 \
        --repeats 2 --out /tmp/cal

It measures gem-parallel's mechanisms on GEM, so it lives with gem-train (which may import every package);
it was ``packages/gem-parallel/benchmarks/calibrate_cost.py``.
Results: ``packages/gem-parallel/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import time
from pathlib import Path

import torch

import gem_model as gm
from gem_parallel.balance import fit_mix_cost


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(model: gm.GemModel, batch: gm.GemBatch, device: str) -> None:
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(batch)
    loss, _ = gm.multitask_loss(logits, batch)
    loss.backward()


def _merged_lengths(batch: gm.GemBatch) -> torch.Tensor:
    """``[B]`` float64: each user's sequences are concatenated by the model, so L is their sum."""
    return torch.stack([s.lengths.cpu() for s in batch.sequences.values()]).sum(0).to(torch.float64)


def _mixes(n: int, seed: int) -> list[tuple[float, float]]:
    """(median fraction of max_len, sigma) per batch: a grid in log-median x sigma, shuffled."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        frac = math.exp(
            math.log(1 / 64) + (math.log(1 / 2.5) - math.log(1 / 64)) * ((i * 7) % n) / max(n - 1, 1)
        )
        sigma = 0.2 + 1.3 * float(torch.rand(1, generator=g))
        out.append((frac, sigma))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="base", choices=gm.CONFIG_NAMES)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--batches", type=int, default=36, help="length mixes measured (>= 30 for a real fit)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per batch (median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=200.0,
        help="stop measuring new batches after this long; the fit uses what was measured",
    )
    ap.add_argument("--out", required=True, help="directory for the fitted JSON")
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = args.device
    config = gm.get_config(args.config)
    torch.manual_seed(args.seed)
    model = gm.GemModel(config, device="meta")
    model.to_empty(device=device)
    model.init_weights()
    max_len = min(s.max_len for s in config.features.sequences)
    points = []
    print(
        f"{args.config} on {device}, batch {args.batch_size}, {args.batches} length mixes, max_len {max_len}"
    )
    print("| batch | median | sigma | sum L | sum L^2 | ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, (frac, sigma) in enumerate(_mixes(args.batches, args.seed)):
        batch = gm.random_batch(
            config.features, args.batch_size, seed=args.seed * 1000 + i,
            length_median=max(frac * max_len, 1.0), length_sigma=sigma,
        ).to(device)  # fmt: skip
        if time.perf_counter() - t_start > args.max_seconds:
            print(f"stopping after {len(points)} batches: --max-seconds {args.max_seconds:.0f} passed")
            break
        lengths = _merged_lengths(batch)
        try:
            _step(model, batch, device)  # compile / autotune for these shapes, untimed
            times = []
            for _ in range(args.repeats):
                _sync(device)
                t0 = time.perf_counter()
                _step(model, batch, device)
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
        except torch.OutOfMemoryError:  # a heavy mix that does not fit: skip it, keep the others
            print(f"| {i} | {frac * max_len:.0f} | {sigma:.2f} | out of memory: skipped |")
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        ms = statistics.median(times)
        s1, s2 = float(lengths.sum()), float(lengths.square().sum())
        points.append({"sum_len": s1, "sum_len2": s2, "ms": ms, "median": frac * max_len, "sigma": sigma})
        print(f"| {i} | {frac * max_len:.0f} | {sigma:.2f} | {s1:.0f} | {s2:.3g} | {ms:.2f} |", flush=True)
    device_name = (
        torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    )
    meta = {
        "config": args.config, "batch_size": args.batch_size, "device": device_name,
        "date": datetime.date.today().isoformat(), "torch": torch.__version__, "repeats": args.repeats,
        "autocast": "bf16" if device == "cuda" else "off", "points": points,
        "model": "a * sum(L) + b * sum(L^2) + c per batch of batch_size users; L = merged history length",
    }  # fmt: skip
    cols = ([p["sum_len"] for p in points], [p["sum_len2"] for p in points], [p["ms"] for p in points])
    # The same points through the origin (c = 0): how much of the step the lengths explain on their own
    # (cost_fit_report.py prints both from any stored file).
    bare, bare_r2 = fit_mix_cost(*cols, constant=False)
    meta["fit_without_constant"] = {"a": bare.a, "b": bare.b, "r2": bare_r2}
    model_fit, r2 = fit_mix_cost(*cols, units="ms", meta=meta)
    out = Path(args.out) / f"cost_{args.config}_{device}.json"
    model_fit.to_json(out)
    pred = [model_fit.a * p["sum_len"] + model_fit.b * p["sum_len2"] + model_fit.c for p in points]
    worst = max(abs(p["ms"] - q) / p["ms"] for p, q in zip(points, pred, strict=True))
    print(
        f"\nfit: a = {model_fit.a:.4g} ms/token, b = {model_fit.b:.4g} ms/token^2, c = {model_fit.c:.4g} ms"
    )
    print(f"R^2 = {r2:.4f} over {len(points)} batches; worst relative error {worst:.1%}")
    print(f"without c: a = {bare.a:.4g}, b = {bare.b:.4g}, R^2 = {bare_r2:.4f} (what lengths explain alone)")
    print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
