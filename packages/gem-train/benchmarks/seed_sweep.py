"""Seed sweep: GEM, the MLP baseline and the GBDT baseline on one dataset, each selected on validation.

For every seed, GEM (``--config``, default ``movielens``) and the MLP baseline (the same config with
``model.arch = "mlp"``) train with ``run.seed = <seed>``; the checkpoint of the lowest validation NE is
evaluated on the test split (the config's early stopping, if any, applies). The GBDT baseline
(:mod:`gem_train.evaluation.baselines.gbdt`, its grid point and trees chosen on validation) runs on the same
seed's batches. Prints mean ± std of test NE / AUC per model, each seed's relative NE gain of GEM over GBDT,
writes ``<out>/seed_sweep.json`` (every number) and ``<out>/seed_sweep.png``.

    uv run --no-sync python packages/gem-train/benchmarks/seed_sweep.py --seeds 0 1 2 3 4 --out runs/sweep
    uv run --no-sync python packages/gem-train/benchmarks/seed_sweep.py --models gbdt mlp --seeds 0 1
    ... --seeds 3 --out runs/s3 --no-plot; ... --merge runs/s*/seed_sweep.json --out runs/sweep  # in parallel
    ... --gem model.overrides.dropout=0.1 --all train.steps=600     # overrides: GEM only / every torch model

The quality suite (issue 35): on a synthetic config the same command also computes, per seed, the CTR floors
of the test rows the trainer evaluates (:mod:`identifiable_floor`: the Bayes floor and the identifiable floor)
and reports each model's gap to them, in the table and as lines in the PNG, and the torch models' test NE
against the test rows' true probabilities beside the identifiable oracle's (``expected_ne``,
``expected_oracle_ne``: :mod:`excess_by_slice`; free of the sampled labels' noise). Synthetic data has no
validation split unless asked for, and the models select on one:

    # CPU: tiny synthetic (each model its steps; the GBDT reads as many training batches)
    uv run --no-sync python packages/gem-train/benchmarks/seed_sweep.py --config tiny-cpu --seeds 0 \\
        --all train.valid_every=500 data.synthetic.valid_examples=8192 train.steps=3000 --out runs/suite_tiny
    # GPU: base-h200 synthetic, GEM and the MLP
    uv run --no-sync python packages/gem-train/benchmarks/seed_sweep.py --config base-h200 --models gem mlp \\
        --seeds 0 --all train.valid_every=1000 data.synthetic.valid_examples=32768 --out runs/suite_h200
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

MODELS = ("gem", "mlp", "gbdt")


def _torch_run(config: str, overrides: list[str], out: Path) -> dict[str, Any]:
    from gem_train.config import load_config
    from gem_train.loop.trainer import Trainer

    cfg = load_config(config, [*overrides, f"run.out_dir={out}", "train.progress_bar=false"])
    if not cfg.train.valid_every:
        raise SystemExit("seed_sweep: the config must select on validation (train.valid_every > 0)")
    t0 = time.perf_counter()
    res = Trainer(cfg).fit()
    chosen = res.best_eval or res.final_eval
    assert chosen is not None, f"run {res.run_dir} ended with status {res.status}"
    task = cfg.train.select_task if cfg.train.select_task in chosen.tasks else next(iter(chosen.tasks))
    m = chosen.tasks[task]
    out = {
        "ne": m.ne, "auc": m.auc, "best_step": res.best_step, "last_step": res.step,
        "early_stopped": res.early_stopped, "valid_ne": res.best_valid_ne,
        "seconds": time.perf_counter() - t0, "run_dir": str(res.run_dir),
    }  # fmt: skip
    if cfg.data.source == "synthetic" and (res.run_dir / "checkpoints" / "best").exists():
        out.update(_expected_ne(cfg, res.run_dir))
    return out


def _expected_ne(cfg: Any, run_dir: Path) -> dict[str, float]:
    """The chosen checkpoint's CTR NE on the test rows against their true probabilities, and the identifiable
    oracle's (:mod:`excess_by_slice`): no label noise, so nearby settings that 8,192 sampled labels cannot
    tell apart are resolved."""
    import excess_by_slice

    ne = excess_by_slice.summarise(excess_by_slice.collect(run_dir, "best", "test", _test_batches(cfg)))
    return {"expected_ne": ne["expected_ne"]["model"], "expected_oracle_ne": ne["expected_ne"]["oracle"]}


def _test_batches(cfg: Any) -> int:
    """Batches of ``data.eval_batch_size`` rows the trainer evaluates on a synthetic config's test split."""
    return cfg.train.eval_batches or -(-cfg.data.synthetic.eval_examples // cfg.data.eval_batch_size)


def _gbdt_run(config: str, overrides: list[str]) -> dict[str, Any]:
    from gem_train.config import load_config
    from gem_train.evaluation.baselines.gbdt import build_gbdt_source, run_gbdt

    cfg = load_config(config, overrides)
    # An endless stream (synthetic): as many training batches as the torch models' steps.
    steps = cfg.train.steps if cfg.data.source == "synthetic" else 0
    res = run_gbdt(cfg, build_gbdt_source(cfg), max_train_batches=steps)
    task = cfg.train.select_task if cfg.train.select_task in res.test else next(iter(res.test))
    m = res.test[task]
    return {"ne": m.ne, "auc": m.auc, "valid_ne": res.valid[task].ne, "params": res.params[task],
            "seconds": res.seconds}  # fmt: skip


def _floors(config: str, overrides: list[str]) -> dict[str, Any] | None:
    """The CTR floors of the test rows the trainer evaluates (synthetic configs only; else None)."""
    from gem_train.config import load_config

    cfg = load_config(config, overrides)
    if cfg.data.source != "synthetic":
        return None
    import identifiable_floor

    bs = cfg.data.eval_batch_size
    res = identifiable_floor.compute(cfg.data.synthetic, _test_batches(cfg), bs, "test", cfg.run.seed)
    return {"floor_ne": res["floor_ne"], "identifiable_ne": res["identifiable_ne"], "rows": res["rows"]}


def _gap(results: dict[str, Any], m: str, key: str) -> list[float]:
    """Model ``m``'s test NE over the seed's floor ``key``, minus 1, per seed that has a floor."""
    floors = results.get("floors", {})
    return [r["ne"] / floors[s][key] - 1 for s, r in results[m].items() if s in floors]


def _plot(results: dict[str, dict[int, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if results.get(m)]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in ((axes[0], "ne", "test NE (lower is better)"), (axes[1], "auc", "test AUC")):
        for i, m in enumerate(models):
            vals = np.array([r[key] for r in results[m].values()])
            ax.bar(i, vals.mean(), yerr=vals.std(ddof=1) if len(vals) > 1 else 0.0, capsize=4, alpha=0.7)
            ax.scatter(np.full(len(vals), i), vals, color="k", s=10, zorder=3)
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel(label)
        lo = min(r[key] for m in models for r in results[m].values())
        hi = max(r[key] for m in models for r in results[m].values())
        floors = list(results.get("floors", {}).values())
        if key == "ne" and floors:  # synthetic: the seeds' mean floors as lines
            lines = (("floor_ne", ":", "Bayes floor"), ("identifiable_ne", "--", "identifiable"))
            for fkey, style, name in lines:
                y = float(np.mean([f[fkey] for f in floors]))
                ax.axhline(y, color="k", linestyle=style, linewidth=1, label=f"{name} {y:.4f}")
                lo = min(lo, y)
            ax.legend(fontsize=7, loc="upper right")
        ax.set_ylim(lo - 0.02, hi + 0.02)
    seeds = sorted({s for m in models for s in results[m]})
    fig.suptitle(f"selected on validation, seeds {seeds} (mean ± std, dots: seeds)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _mean_std(vals: list[float]) -> str:
    a = np.array(vals)
    return f"{a.mean():.4f} ± {a.std(ddof=1):.4f}" if len(a) > 1 else f"{a.mean():.4f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="movielens")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--out", type=Path, default=Path("runs/seed_sweep"))
    p.add_argument("--all", nargs="*", default=[], help="overrides for every model (key=value)")
    p.add_argument("--gem", nargs="*", default=[], help="overrides for GEM only")
    p.add_argument("--mlp", nargs="*", default=[], help="overrides for the MLP only")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (no matplotlib needed)")
    p.add_argument(
        "--merge", type=Path, nargs="+", default=[],
        help="train nothing: merge these seed_sweep.json files (e.g. one per seed, run in parallel)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.merge:
        return _merge(args.merge, args.out, plot=not args.no_plot)

    import torch

    torch.set_num_threads(1)  # a shared CPU: one thread per process (see RunConfig.cpu_threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict[str, Any]]] = {m: {} for m in args.models}
    summary_path = args.out / "seed_sweep.json"
    for seed in args.seeds:
        common = [*args.all, f"run.seed={seed}"]
        floors = _floors(args.config, common)
        if floors is not None:
            results.setdefault("floors", {})[seed] = floors
            print(f"seed {seed} floors: Bayes {floors['floor_ne']:.4f}, identifiable "
                  f"{floors['identifiable_ne']:.4f} ({floors['rows']} test rows)", flush=True)  # fmt: skip
        for m in args.models:
            if m == "gem":
                r = _torch_run(args.config, [*common, *args.gem], args.out)
            elif m == "mlp":
                r = _torch_run(args.config, ["model.arch=mlp", *common, *args.mlp], args.out)
            else:
                r = _gbdt_run(args.config, common)
            results[m][seed] = r
            print(
                f"seed {seed} {m}: test NE {r['ne']:.4f} AUC {r['auc']:.4f} ({r['seconds']:.0f} s)",
                flush=True,
            )
            tmp = summary_path.with_suffix(".json.tmp")
            tmp.write_text(
                json.dumps({"config": args.config, "results": results}, indent=2), encoding="utf-8"
            )
            os.replace(tmp, summary_path)  # after every run: a partial sweep is still readable
    _report(results, args.out, plot=not args.no_plot)
    return 0


def _merge(paths: list[Path], out: Path, plot: bool) -> int:
    """Union of several sweeps' results (a seed in two files: the later file wins), reported as one."""
    results: dict[str, dict[int, dict[str, Any]]] = {}
    configs = set()
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        configs.add(doc["config"])
        for m, by_seed in doc["results"].items():  # the models, and "floors" on synthetic data
            results.setdefault(m, {}).update({int(s): r for s, r in by_seed.items()})
    if len(configs) != 1:
        raise SystemExit(f"seed_sweep --merge: the files come from different configs {sorted(configs)}")
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "seed_sweep.json"
    tmp = summary_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"config": configs.pop(), "results": results}, indent=2), encoding="utf-8")
    os.replace(tmp, summary_path)
    _report(results, out, plot=plot)
    return 0


def _report(results: dict[str, dict[int, dict[str, Any]]], out: Path, plot: bool) -> None:
    """Print mean ± std per model (validation NE too: what selects a variant) and GEM's gain over the
    GBDT per seed; write the PNG."""
    synthetic = bool(results.get("floors"))
    extra = " over Bayes floor | over identifiable floor | expected NE over the oracle |" if synthetic else ""
    print(f"\n| model | seeds | valid NE | test NE | test AUC |{extra}\n|---|---|---|---|---|"
          + ("---|---|---|" if synthetic else ""))  # fmt: skip
    for m in [m for m in MODELS if results.get(m)]:
        rs = results[m]
        gaps = ""
        if synthetic:
            gaps = "".join(
                f" {100 * np.mean(g):+.2f}% |" if (g := _gap(results, m, k)) else " — |"
                for k in ("floor_ne", "identifiable_ne")
            )
            expected = [
                r["expected_ne"] / r["expected_oracle_ne"] - 1 for r in rs.values() if "expected_ne" in r
            ]
            gaps += f" {100 * np.mean(expected):+.2f}% |" if expected else " — |"
        print(f"| {m} | {len(rs)} | {_mean_std([r['valid_ne'] for r in rs.values()])} | "
              f"{_mean_std([r['ne'] for r in rs.values()])} | "
              f"{_mean_std([r['auc'] for r in rs.values()])} |{gaps}")  # fmt: skip
    if synthetic:
        fl = list(results["floors"].values())
        print(f"floors (mean over seeds): Bayes {_mean_std([f['floor_ne'] for f in fl])}, identifiable "
              f"{_mean_std([f['identifiable_ne'] for f in fl])}")  # fmt: skip
    for base in ("gbdt", "mlp"):  # issue 35's targets: GEM's NE gain per seed, and its AUC lead
        if not (results.get("gem") and results.get(base)):
            continue
        both = sorted(set(results["gem"]) & set(results[base]))
        gains = {s: 1 - results["gem"][s]["ne"] / results[base][s]["ne"] for s in both}
        auc = np.mean([results["gem"][s]["auc"] - results[base][s]["auc"] for s in both])
        print(f"GEM vs {base.upper()}: relative NE gain per seed "
              + ", ".join(f"{s}: {100 * g:+.2f}%" for s, g in gains.items())
              + f"; mean {100 * np.mean(list(gains.values())):+.2f}%; AUC {auc:+.4f}")  # fmt: skip
    if plot:
        _plot(results, out / "seed_sweep.png")
    print(f"wrote {out / 'seed_sweep.json'}" + (f" and {out / 'seed_sweep.png'}" if plot else ""))


if __name__ == "__main__":
    raise SystemExit(main())
