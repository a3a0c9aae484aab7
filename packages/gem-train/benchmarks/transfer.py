"""Knowledge-transfer benchmark (issue 36): a GEM teacher, small students, and what each transfer recipe buys.

Per suite, one teacher is trained and scored with ``gem-train predict --embeddings`` on the students' data,
then each recipe trains a student over ``--seeds`` (the student's initialisation and shuffles; the data is
fixed), every student selected on its validation split (the checkpoint of the lowest validation CTR NE),
its test split reported once:

- **synthetic** (drift): the ground truth moves with time (``data.synthetic.drift``). The teacher trains on
  window 0 (stream 0). *Fresh*: students train on window 0 (stream 1: other impressions of the same time);
  *stale*: on window 1 (the next 60 days), where the teacher's weights are a window old. Student = the MLP
  (``--student``), data-limited: ``--student-steps`` batches of 256. The adapter reads the teacher's age
  (days since the end of window 0).
- **movielens**: the teacher is the shipped ``movielens`` GEM (early stopping, selected on validation); the
  students the MLP baseline of the same config; the history-embedding recipe adds the mean stored
  representation of the user's earlier ratings (LoopFM's sequence of past representations).

Recipes: student alone, + distillation (soft labels into the serving head), + auxiliary head (ExFM's AH),
+ adapter (AH + ExFM's student adapter), + embeddings (LoopFM: the teacher's stored representation as a
dense input), all together. The *transfer ratio* of a recipe is (student alone's test NE - the recipe's) /
(student alone's - the teacher's), on the seeds' mean CTR NE. The best recipe is the one with the lowest
mean validation NE. Staleness: what it costs plain distillation (its NE gain over the student alone, fresh
minus stale) and the share of that the adapter recipe recovers (its stale gain minus plain distillation's).

    uv run --no-sync python packages/gem-train/benchmarks/transfer.py --out runs/transfer            # both
    uv run --no-sync python packages/gem-train/benchmarks/transfer.py --suite synthetic --out runs/transfer

Everything is cached in ``OUT`` (teacher runs, predictions, one JSON line per student run): a rerun
continues where it stopped. Writes ``OUT/transfer.json``, ``OUT/transfer.md`` and ``OUT/transfer.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

# The synthetic world (every run of the suite; the data seed is fixed, run.seed varies the models).
WORLD = [
    "data.synthetic.seed=0",
    "data.synthetic.max_len=32",
    "data.synthetic.eval_examples=8192",
    "data.synthetic.valid_examples=4096",
    "data.batch_size=256",
    "data.eval_batch_size=1024",
    "run.device=cpu",
    "train.progress_bar=false",
    "train.eval_every=0",
    # The tables' rate the recorded transfer tables (docs/results.md, 2026-12-07) were measured with;
    # tiny-cpu's default became 1.0 since, which makes the MLP student far stronger: re-measure before
    # changing it here.
    "optim.sparse_lr=0.05",
]
SETTINGS = {"fresh": ["data.synthetic.window=0", "data.synthetic.stream=1"],
            "stale": ["data.synthetic.window=1", "data.synthetic.stream=1"]}  # fmt: skip
ADAPTER = ["distill.adapter=linear"]


def recipes(suite: str, trained_until: int) -> dict[str, list[str]]:
    age = (
        ["distill.adapter_age=true", f"distill.teacher_trained_until={trained_until}"]
        if trained_until
        else []
    )
    out = {
        "student alone": [],
        "+ distillation": ["distill.mode=serving"],
        "+ auxiliary head": ["distill.mode=aux"],
        "+ adapter": ["distill.mode=aux", *ADAPTER, *age],
        "+ distillation + adapter": ["distill.mode=serving", *ADAPTER, *age],
        "+ embeddings": ["distill.embeddings=true"],
    }
    if suite == "movielens":
        out["+ history embeddings"] = ["distill.embeddings=true", "distill.embedding_history=true"]
    hist = ["distill.embedding_history=true"] if suite == "movielens" else []
    out["all together"] = ["distill.mode=aux", *ADAPTER, *age, "distill.embeddings=true", *hist]
    return out


# ----------------------------------------------------------------------------------------------------------
# Runs (cached)
# ----------------------------------------------------------------------------------------------------------


def _cached(path: Path, make: Any) -> Any:
    if path.exists():
        return json.loads(path.read_text())
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1))
    return value


def _train(config: str, overrides: list[str]) -> Any:
    from gem_train.config import load_config
    from gem_train.loop.trainer import Trainer

    res = Trainer(load_config(config, overrides)).fit()
    if res.status == "interrupted":  # a signal: never cache a half-trained run as a result
        raise SystemExit(f"interrupted at step {res.step} ({res.run_dir}): rerun to continue")
    return res


def _metrics(ev: Any) -> dict[str, dict[str, float]]:
    return {t: {"ne": m.ne, "auc": m.auc} for t, m in ev.tasks.items()}


def _evaluate(ckpt: str, overrides: list[str]) -> dict[str, Any]:
    """The teacher on the students' data: validation and test metrics of checkpoint ``ckpt``."""
    from gem_train.checkpoint import load_checkpoint, read_trainer_state
    from gem_train.config import TrainConfig, apply_overrides, config_from_dict
    from gem_train.evaluation.evaluate import evaluate_model
    from gem_train.loop.build import build_run

    cfg = config_from_dict(TrainConfig, apply_overrides(read_trainer_state(ckpt)["config"], overrides))
    run = build_run(cfg, training=False)
    load_checkpoint(ckpt, run.model, None, restore_rng=False)
    out = {}
    for split in ("valid", "test"):
        ev = evaluate_model(run.model, run.source, cfg, run.dist, run.autocast_dtype, 0, 0, split)
        out[split] = _metrics(ev)
        if ev.ground_truth_ne:
            out[f"{split}_floor"] = ev.ground_truth_ne
    return out


def _predict(ckpt: str, out: Path, overrides: list[str], train_batches: int) -> dict[str, Any]:
    from gem_train.checkpoint import read_trainer_state
    from gem_train.config import TrainConfig, apply_overrides, config_from_dict
    from gem_train.transfer.predict import run_predict

    cfg = config_from_dict(TrainConfig, apply_overrides(read_trainer_state(ckpt)["config"], overrides))
    cfg.validate()
    t0 = time.perf_counter()
    res = run_predict(cfg, ckpt, out, embeddings=True, train_batches=train_batches, progress=False)
    return {"rows": res.rows, "seconds": time.perf_counter() - t0, "examples_per_s": res.examples_per_s}


def _student(log: Path, key: str, config: str, overrides: list[str]) -> dict[str, Any]:
    """One student run (skipped when ``log`` already has ``key``): validation-selected test metrics."""
    done = {}
    if log.exists():
        done = {r["key"]: r for r in map(json.loads, log.read_text().splitlines())}
    if key in done:
        return done[key]
    t0 = time.perf_counter()
    res = _train(config, overrides)
    chosen = res.best_eval or res.final_eval
    row = {"key": key, "valid_ne": res.best_valid_ne, "best_step": res.best_step, "test": _metrics(chosen),
           "seconds": time.perf_counter() - t0, "run_dir": str(res.run_dir)}  # fmt: skip
    with log.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"  {key}: valid NE {row['valid_ne']:.4f}, test ctr NE {row['test']['ctr']['ne']:.4f} "
          f"({row['seconds']:.0f} s)", flush=True)  # fmt: skip
    return row


# ----------------------------------------------------------------------------------------------------------
# Suites
# ----------------------------------------------------------------------------------------------------------


def synthetic(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from gem_train.data.synthetic import T0, WINDOW_SECONDS

    world = [*WORLD, f"data.synthetic.drift={args.drift}"]
    teacher = _cached(root / "teacher.json", lambda: _teacher_synthetic(args, root, world))
    ckpt = teacher["checkpoint"]
    student_base = [*world, f"model.arch={args.student}", f"train.steps={args.student_steps}",
                    f"train.valid_every={max(args.student_steps // 6, 1)}", "checkpoint.every=0",
                    "checkpoint.keep_last=1", f"train.log_every={max(args.student_steps // 6, 1)}",
                    f"optim.warmup_steps={max(args.student_steps // 20, 1)}"]  # fmt: skip
    out: dict[str, Any] = {"teacher": teacher, "settings": {}}
    for name, setting in SETTINGS.items():
        preds = root / f"preds-{name}"
        p = _cached(root / f"predict-{name}.json",
                    lambda s=setting, o=preds: _predict(ckpt, o, s, args.student_steps))  # fmt: skip
        t_metrics = _cached(root / f"teacher-{name}.json", lambda s=setting: _evaluate(ckpt, s))
        rows = {}
        for recipe, extra in recipes("synthetic", T0 + WINDOW_SECONDS).items():
            teach = [f"distill.teacher={preds}"] if extra else []
            for seed in args.seeds:
                key = f"{name}/{recipe}/{seed}"
                over = [*student_base, *setting, *extra, *teach, f"run.seed={seed}",
                        f"run.out_dir={root / 'students'}", f"run.name={name}-s{seed}"]  # fmt: skip
                rows.setdefault(recipe, []).append(_student(root / "students.jsonl", key, "tiny-cpu", over))
        out["settings"][name] = {"predict": p, "teacher": t_metrics, "recipes": rows}
    return out


def _teacher_synthetic(args: argparse.Namespace, root: Path, world: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    over = [*world, f"model.name={args.teacher}", f"train.steps={args.teacher_steps}", "train.log_every=100",
            "checkpoint.every=0", f"run.out_dir={root / 'teacher'}", "run.name=teacher",
            "data.synthetic.window=0", "data.synthetic.stream=0"]  # fmt: skip
    res = _train("tiny-cpu", over)
    return {"checkpoint": str(res.last_checkpoint), "seconds": time.perf_counter() - t0,
            "model": args.teacher, "steps": args.teacher_steps}  # fmt: skip


def movielens(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    base = ["run.device=cpu", "train.progress_bar=false"]

    def teacher_run() -> dict[str, Any]:
        t0 = time.perf_counter()
        res = _train(
            "movielens", [*base, "run.seed=0", f"run.out_dir={root / 'teacher'}", "run.name=teacher"]
        )
        assert res.best_checkpoint is not None and res.best_eval is not None
        return {"checkpoint": str(res.best_checkpoint), "seconds": time.perf_counter() - t0,
                "valid_ne": res.best_valid_ne, "test": _metrics(res.best_eval),
                "best_step": res.best_step}  # fmt: skip

    teacher = _cached(root / "teacher.json", teacher_run)
    preds = root / "preds"
    p = _cached(root / "predict.json", lambda: _predict(teacher["checkpoint"], preds, [], 0))
    t_metrics = _cached(root / "teacher-eval.json", lambda: _evaluate(teacher["checkpoint"], []))
    rows: dict[str, list[dict[str, Any]]] = {}
    for recipe, extra in recipes("movielens", 0).items():
        teach = [f"distill.teacher={preds}"] if extra else []
        for seed in args.movielens_seeds or args.seeds:
            over = [*base, "model.arch=mlp", *extra, *teach, f"run.seed={seed}",
                    f"run.out_dir={root / 'students'}", f"run.name=student-s{seed}"]  # fmt: skip
            rows.setdefault(recipe, []).append(
                _student(root / "students.jsonl", f"movielens/{recipe}/{seed}", "movielens", over)
            )
    return {
        "teacher": teacher,
        "settings": {"movielens": {"predict": p, "teacher": t_metrics, "recipes": rows}},
    }


# ----------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------


def _ms(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def summarize(setting: dict[str, Any]) -> dict[str, Any]:
    """Mean ± std per recipe; transfer ratios; the recipe chosen on validation."""
    teacher_ne = setting["teacher"]["test"]["ctr"]["ne"]
    table = {}
    for recipe, runs in setting["recipes"].items():
        table[recipe] = {
            "valid_ne": _ms([r["valid_ne"] for r in runs]),
            "test_ne": _ms([r["test"]["ctr"]["ne"] for r in runs]),
            "test_auc": _ms([r["test"]["ctr"]["auc"] for r in runs]),
            "test_cvr_ne": _ms([r["test"]["cvr"]["ne"] for r in runs]) if "cvr" in runs[0]["test"] else None,
            "per_seed": [r["test"]["ctr"]["ne"] for r in runs],
        }
    alone = table["student alone"]["test_ne"][0]
    for row in table.values():
        gain = alone - row["test_ne"][0]
        row["gain_pct"] = 100.0 * gain / alone
        # Only meaningful where the teacher beats the student alone (else "n/a" in the table).
        row["transfer_ratio"] = gain / (alone - teacher_ne) if alone > teacher_ne else float("nan")
    best = min((r for r in table if r != "student alone"), key=lambda r: table[r]["valid_ne"][0])
    return {"teacher_test_ne": teacher_ne, "teacher_test_auc": setting["teacher"]["test"]["ctr"]["auc"],
            "teacher_valid_ne": setting["teacher"]["valid"]["ctr"]["ne"], "table": table, "best": best,
            "floor": setting["teacher"].get("test_floor", {}).get("ctr")}  # fmt: skip


def staleness(fresh: dict[str, Any], stale: dict[str, Any]) -> dict[str, float]:
    """What staleness costs plain distillation and the share the adapter recipe recovers."""

    def gain(s: dict[str, Any], r: str) -> float:
        return float(s["table"]["student alone"]["test_ne"][0] - s["table"][r]["test_ne"][0])

    def seeds(s: dict[str, Any], r: str) -> np.ndarray:
        return np.asarray(s["table"][r]["per_seed"])

    cost = gain(fresh, "+ distillation") - gain(stale, "+ distillation")
    out: dict[str, Any] = {"cost": cost}
    for name, recipe in (("adapter", "+ adapter"), ("serving_adapter", "+ distillation + adapter"),
                         ("aux_only", "+ auxiliary head")):  # fmt: skip
        recovered = gain(stale, recipe) - gain(stale, "+ distillation")
        out[f"recovered_{name}"] = recovered
        out[f"share_{name}"] = recovered / cost if cost > 0 else float("nan")
        # Per seed (the same run.seed pairs the runs): the stale NE plain distillation loses to the recipe.
        out[f"recovered_{name}_per_seed"] = (seeds(stale, "+ distillation") - seeds(stale, recipe)).tolist()
    return out


def _ratio(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def markdown(name: str, s: dict[str, Any]) -> str:
    floor = f"; Bayes floor {s['floor']:.4f}" if s["floor"] else ""
    head = "| recipe | valid NE | **test NE** | test AUC | test CVR NE | NE gain vs alone | transfer ratio |"
    lines = [f"**{name}**: teacher test CTR NE {s['teacher_test_ne']:.4f} / AUC {s['teacher_test_auc']:.4f} "
             f"(valid NE {s['teacher_valid_ne']:.4f}){floor}", "", head,
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for recipe, r in s["table"].items():
        cvr = f"{r['test_cvr_ne'][0]:.4f} ± {r['test_cvr_ne'][1]:.4f}" if r["test_cvr_ne"] else "-"
        mark = " (chosen on validation)" if recipe == s["best"] else ""
        lines.append(f"| {recipe}{mark} | {r['valid_ne'][0]:.4f} ± {r['valid_ne'][1]:.4f} | "
                     f"**{r['test_ne'][0]:.4f} ± {r['test_ne'][1]:.4f}** | {r['test_auc'][0]:.4f} ± "
                     f"{r['test_auc'][1]:.4f} | {cvr} | {r['gain_pct']:+.2f}% | "
                     f"{_ratio(r['transfer_ratio'])} |")  # fmt: skip
    return "\n".join(lines)


def plot(summaries: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(5.5 * len(summaries), 4.2), squeeze=False)
    for ax, (name, s) in zip(axes[0], summaries.items()):
        names = list(s["table"])
        means = [s["table"][r]["test_ne"][0] for r in names]
        stds = [s["table"][r]["test_ne"][1] for r in names]
        ax.bar(range(len(names)), means, yerr=stds, color=["gray"] + ["C0"] * (len(names) - 1), capsize=3)
        teacher = s["teacher_test_ne"]
        ax.axhline(teacher, color="C3", linestyle="--", label=f"teacher {teacher:.4f}")
        lo, hi = min(*means, teacher), max(*(m + d for m, d in zip(means, stds)), teacher)
        ax.set_ylim(lo - 0.15 * (hi - lo), hi + 0.1 * (hi - lo))
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=30, ha="right")
        floor = f"; Bayes floor {s['floor']:.3f}" if s["floor"] else ""
        ax.set_title(f"{name}: student test CTR NE, mean ± std over seeds{floor}", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--suite", choices=("synthetic", "movielens", "all"), default="all")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--movielens-seeds", type=int, nargs="+", help="MovieLens students' (default: --seeds)")
    p.add_argument("--teacher", default="tiny", help="the synthetic teacher's gem-model config")
    p.add_argument("--teacher-steps", type=int, default=1000)
    p.add_argument("--student", choices=("mlp", "gem"), default="mlp")
    p.add_argument("--student-steps", type=int, default=120)
    p.add_argument("--drift", type=float, default=0.5)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    suites = ("synthetic", "movielens") if args.suite == "all" else (args.suite,)
    for suite in suites:
        print(f"suite {suite}", flush=True)
        results[suite] = (synthetic if suite == "synthetic" else movielens)(args, args.out / suite)
    summaries = {f"{suite}/{name}": summarize(s) for suite, r in results.items()
                 for name, s in r["settings"].items()}  # fmt: skip
    text = [markdown(name, s) for name, s in summaries.items()]
    if "synthetic/fresh" in summaries and "synthetic/stale" in summaries:
        st = staleness(summaries["synthetic/fresh"], summaries["synthetic/stale"])
        results["staleness"] = st
        parts = [f"{label} {st[f'recovered_{k}']:.4f} ({100 * st[f'share_{k}']:.0f}%; per seed "
                 f"{', '.join(f'{x:+.4f}' for x in st[f'recovered_{k}_per_seed'])})" for k, label in (
            ("adapter", "+ adapter (AH + SA)"), ("serving_adapter", "+ distillation + adapter (SA into the "
            "serving head)"), ("aux_only", "+ auxiliary head alone"))]  # fmt: skip
        text.append(f"Staleness costs plain distillation {st['cost']:.4f} test NE of its gain. Recovered "
                    f"(the stale gain minus plain distillation's): {'; '.join(parts)}.")  # fmt: skip
    results["summaries"], results["seconds"] = summaries, time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transfer.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "transfer.md").write_text("\n\n".join(text) + "\n")
    plot(summaries, args.out / "transfer.png")
    print("\n\n".join(text))
    print(f"wall time {results['seconds']:.0f} s; {args.out}/transfer.{{json,md,png}}")


if __name__ == "__main__":
    main()
