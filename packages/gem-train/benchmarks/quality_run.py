"""Quality and loop speed of precision recipes: ``gem-train train`` for N steps per recipe, test NE against
the synthetic data's ground-truth floor, the loop's steady step rate, and the warm-up, evaluation and
checkpoint costs, each measured apart.

Each recipe trains in its own process (the trainer itself, :class:`gem_train.loop.trainer.Trainer`, with
timers wrapped around its step, evaluation and checkpoint calls; nothing else changes), into
``DIR/<recipe>/``, and writes ``DIR/<recipe>/quality_recipe.json``. Every invocation then merges whatever
recipes ``DIR`` holds into ``DIR/quality.json`` and ``DIR/quality_ne.png`` (the test NE curves of all recipes
with the floor drawn), so recipes can run as separate commands (e.g. one per device call) into one directory.

What is measured, per recipe:

- test NE of the task (``--task``, default ctr) at every evaluation (``train.eval_every``) and at the end, the
  floor (``<task>/ground_truth_ne`` of the test rows: :func:`gem_train.evaluation.metrics.ground_truth_ne`,
  the one place gem-train computes it) and the final gap ``NE / floor - 1``;
- steady state from the logged ``train`` windows (``train.log_every`` steps each): windows that start
  after ``--warmup-steps`` and hold no evaluation or checkpoint (those run right after a logged step, inside
  the next window): median step time, examples/s and MFU; beside it the median of the trainer's step calls;
- warm-up: the first step alone and the excess of the first ``--warmup-steps`` steps over the steady step time
  (compilation, autotuning), and the trainer's construction (model, data, compile wrappers);
- evaluation: seconds per call (device synchronized), and what its window lost against a steady window;
- checkpoint: seconds of the ``save`` call (the write itself continues in the background) and what its window
  lost against a steady window.

Recipes: ``bf16`` (no conversion, under the config's autocast) or any ``precision.recipe`` (``fp8_rowwise``,
``mxfp8``, ...). ``--parallel`` runs the recipes as concurrent processes (on one GPU they share it: the NE is
unaffected, the step rates are not the loop's own then).

    # CPU check of the plumbing (a few minutes on a loaded machine):
    python packages/gem-train/benchmarks/quality_run.py --config tiny-cpu --steps 20 --out /tmp/quality
    # H200, one recipe per command into one directory (~5 min each), then both are merged:
    python packages/gem-train/benchmarks/quality_run.py --config base-h200 --recipes bf16 --out DIR
    python packages/gem-train/benchmarks/quality_run.py --config base-h200 --recipes fp8_rowwise --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

RECIPE_FILE = "quality_recipe.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def schedule(
    steps: int, eval_every: int | None, ckpt_every: int | None, warmup: int | None, log_every: int
) -> dict[str, int]:
    """Evaluation, checkpoint and warm-up step counts (defaults scale with ``steps``: 2,000 steps evaluate
    every 500, checkpoint once, one log window after the middle (so its cost is apart from an evaluation's),
    and treat the first 100 as warm-up)."""
    ev = eval_every if eval_every is not None else (500 if steps >= 1000 else max(1, steps // 4))
    ck = ckpt_every if ckpt_every is not None else max(1, steps // 2 + log_every)
    wu = warmup if warmup is not None else min(100, max(1, steps // 4))
    return {"eval_every": ev, "checkpoint_every": ck, "warmup_steps": wu}


def overrides_for(recipe: str, steps: int, sched: dict[str, int], log_every: int, out: Path) -> list[str]:
    conversion = "none" if recipe == "bf16" else recipe
    return [
        f"precision.recipe={conversion}",
        f"train.steps={steps}",
        f"train.eval_every={sched['eval_every']}",
        f"train.log_every={log_every}",
        f"checkpoint.every={sched['checkpoint_every']}",
        f"run.out_dir={out}",
        f"run.name={recipe}",
        "train.progress_bar=false",
        # No validation split (gem-train validates by default since issue 34): the steady windows and the
        # costs measured here are the training loop's, evaluations and checkpoints apart, as before.
        "data.synthetic.valid_examples=0",
    ]


def steady_windows(train_rows: list[dict[str, Any]], events: list[int], warmup: int) -> list[dict[str, Any]]:
    """Logged train windows starting at or after step ``warmup`` with no event (evaluation or checkpoint at a
    step ``s``: it runs after step s is logged, inside the window ``(b, e]`` with ``b <= s < e``)."""
    out, prev = [], 0
    for r in sorted(train_rows, key=lambda r: r["step"]):
        b, e = prev, int(r["step"])
        prev = e
        if b >= warmup and not any(b <= s < e for s in events):
            out.append(r)
    return out


def window_excess(train_rows: list[dict[str, Any]], at_step: int, steady_step_s: float) -> float | None:
    """Seconds the window holding an event after step ``at_step`` took beyond ``steady_step_s`` per step."""
    rows = sorted(train_rows, key=lambda r: r["step"])
    prev = 0
    for r in rows:
        if prev <= at_step < r["step"]:
            n = r["step"] - prev
            return float(r["step_time_s"] * n - steady_step_s * n)
        prev = r["step"]
    return None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_recipe(args: argparse.Namespace, recipe: str) -> dict[str, Any]:
    """Train one recipe in this process with timers around the trainer's step, evaluation and save."""
    from gem_train.config import load_config
    from gem_train.loop.metrics_log import read_metrics
    from gem_train.loop.trainer import Trainer

    out = Path(args.out) / recipe
    probe = load_config(args.config, args.overrides)
    log_every = args.log_every or min(probe.train.log_every, max(1, args.steps // 10))
    sched = schedule(args.steps, args.eval_every, args.checkpoint_every, args.warmup_steps, log_every)
    cfg = load_config(
        args.config, [*args.overrides, *overrides_for(recipe, args.steps, sched, log_every, out)]
    )
    device = torch.device(cfg.run.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - t0
    step_s: dict[int, float] = {}
    evals: list[dict[str, Any]] = []
    saves: list[dict[str, Any]] = []
    run, orig_step, orig_queue, orig_eval, orig_save = (
        trainer.built_run,
        trainer.built_run.train_step,
        trainer.built_run.queue_step,
        trainer.evaluate,
        trainer.save,
    )

    profiler = None
    if args.profile_at:
        from loop_profile import LoopProfiler  # this folder (the script's) is on sys.path

        profiler = LoopProfiler(args.profile_at, args.profile_steps, device.type == "cuda")

    starts: dict[int, float] = {}  # 1-based step -> when the loop called it (overlapped or not)

    def timed_step(batch: Any, step: int) -> Any:
        starts[step + 1] = time.perf_counter()
        if profiler is not None:
            profiler.after(step)  # step ``step`` (1-based) ended with the last call; the loop's host work too
            profiler.before(step + 1)
        t = time.perf_counter()
        res = orig_step(batch, step)  # returns host floats: synchronized
        step_s[step + 1] = time.perf_counter() - t
        return res

    def queued_step(batch: Any, step: int) -> Any:  # the loop's overlapped steps: not timed one by one
        starts[step + 1] = time.perf_counter()
        if profiler is not None:
            profiler.after(step)
            profiler.before(step + 1)
        return orig_queue(batch, step)

    def timed_eval(step: int, *a: Any, **k: Any) -> Any:
        sync()
        t = time.perf_counter()
        res = orig_eval(step, *a, **k)
        sync()
        evals.append({"step": step, "s": time.perf_counter() - t, "final": step == cfg.train.steps})
        return res

    def timed_save(step: int) -> Any:
        sync()
        t = time.perf_counter()
        res = orig_save(step)
        saves.append({"step": step, "call_s": time.perf_counter() - t, "final": step == cfg.train.steps})
        return res

    # Instance attributes shadow the methods the loop calls (self.evaluate, self.save,
    # self.built_run.train_step).
    run.train_step = timed_step  # type: ignore[method-assign]
    run.queue_step = queued_step  # type: ignore[method-assign]
    trainer.evaluate = timed_eval  # type: ignore[method-assign]
    trainer.save = timed_save  # type: ignore[method-assign]
    t1 = time.perf_counter()
    result = trainer.fit()
    fit_s = time.perf_counter() - t1
    rows = read_metrics(trainer.run_dir.metrics)
    train_rows = [r for r in rows if r["split"] == "train"]
    test_rows = [r for r in rows if r["split"] == "test" and f"{args.task}/ne" in r]
    loop_events = [e["step"] for e in evals + saves if not e["final"]]
    steady = steady_windows(train_rows, loop_events, sched["warmup_steps"])
    steady_step = _median([r["step_time_s"] for r in steady])
    in_loop = [s for st, s in step_s.items() if st > sched["warmup_steps"]]
    wu = [step_s[s] for s in range(1, sched["warmup_steps"] + 1) if s in step_s]
    n_wu = sched["warmup_steps"]
    if 1 in starts and n_wu + 1 in starts and len(wu) < n_wu:
        # Overlapped steps (Run.queue_step) return before the device ran them: time the warm-up between the
        # loop's calls instead (each is at most one step ahead of the device).
        wu = [starts[s + 1] - starts[s] for s in range(1, n_wu + 1)]
        step_s.setdefault(1, wu[0])
    ref = steady_step if steady_step is not None else _median(in_loop)
    floor = next((r[f"{args.task}/ground_truth_ne"] for r in reversed(test_rows)
                  if f"{args.task}/ground_truth_ne" in r), None)  # fmt: skip
    curve = [(int(r["step"]), float(r[f"{args.task}/ne"])) for r in test_rows]
    final_ne = curve[-1][1] if curve else None
    for e in evals + saves:
        if not e["final"] and ref is not None:
            e["window_excess_s"] = window_excess(train_rows, e["step"], ref)
            # Another event in the same window: the excess is theirs together.
            e["window_shared"] = sum(window_excess(train_rows, s, ref) == e["window_excess_s"]
                                     for s in loop_events) > 1  # fmt: skip
    res: dict[str, Any] = {
        "recipe": recipe,
        "config": args.config,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "status": result.status,
        "steps": result.step,
        "batch_size": cfg.data.batch_size,
        "schedule": {**sched, "log_every": log_every},
        "run_dir": str(result.run_dir),
        "build_s": build_s,
        "fit_s": fit_s,
        "first_step_s": step_s.get(1),
        "warmup_steps_s": sum(wu),
        "warmup_excess_s": sum(wu) - len(wu) * ref if ref is not None else None,
        "steady": {
            "windows": len(steady),
            "window_step_s_median": steady_step,
            "examples_per_s_median": _median([r["examples_per_s"] for r in steady]),
            "mfu_median": _median([r["mfu"] for r in steady if "mfu" in r]),
            "step_call_s_median": _median(in_loop),
        },
        "evaluations": evals,
        "checkpoints": saves,
        "task": args.task,
        "test_ne": curve,
        "floor": floor,
        "final_ne": final_ne,
        "gap_to_floor": final_ne / floor - 1 if final_ne is not None and floor else None,
    }
    if profiler is not None and profiler.summary is not None:
        _write_json(out / "loop_profile.json", profiler.summary)
        res["loop_profile"] = {k: v for k, v in profiler.summary.items() if not isinstance(v, (dict, list))}
    _write_json(out / RECIPE_FILE, res)
    return res


def merge(out: Path, task: str) -> dict[str, Any]:
    """``quality.json`` and ``quality_ne.png`` from every ``<recipe>/quality_recipe.json`` under ``out``."""
    from gem_train.evaluation.plots import plot_ne_comparison

    recipes = {}
    for p in sorted(out.glob(f"*/{RECIPE_FILE}")):
        r = json.loads(p.read_text())
        recipes[r["recipe"]] = r
    summary: dict[str, Any] = {"recipes": recipes}
    base = recipes.get("bf16")
    for name, r in recipes.items():
        if base is None or name == "bf16":
            continue
        if r["final_ne"] is not None and base["final_ne"] is not None:
            summary[f"{name}_vs_bf16_ne_rel"] = r["final_ne"] / base["final_ne"] - 1  # target |.| <= 0.5%
        a, b = r["steady"]["window_step_s_median"], base["steady"]["window_step_s_median"]
        if r.get("device") != base.get("device"):
            # Recipes run on different devices (one per device session) compare in NE only: a step-rate
            # ratio across devices would measure the devices.
            summary[f"{name}_vs_bf16_step_rate"] = None
            summary[f"{name}_vs_bf16_devices"] = [r.get("device"), base.get("device")]
        elif a and b:
            summary[f"{name}_vs_bf16_step_rate"] = b / a  # target >= 1.2
    floors = [r["floor"] for r in recipes.values() if r["floor"] is not None]
    if recipes:
        summary["png"] = str(plot_ne_comparison(
            {n: [tuple(p) for p in r["test_ne"]] for n, r in recipes.items()},
            floors[0] if floors else None, out / "quality_ne.png", task,
        ))  # fmt: skip
    _write_json(out / "quality.json", summary)
    return summary


def _table(summary: dict[str, Any]) -> str:
    def f(x: Any, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    lines = ["| recipe | final test NE | floor | gap | steady ms/step | ex/s | MFU % | warm-up excess s | "
             "first step s | eval s (mean) | checkpoint call s (mean) |", "|" + "---|" * 11]  # fmt: skip
    for name, r in summary["recipes"].items():
        st = r["steady"]
        ev = [e["s"] for e in r["evaluations"]]
        ck = [c["call_s"] for c in r["checkpoints"]]
        ms = st["window_step_s_median"] * 1e3 if st["window_step_s_median"] else None
        mfu = 100 * st["mfu_median"] if st["mfu_median"] is not None else None
        lines.append(
            f"| {name} | {f(r['final_ne'], '.4f')} | {f(r['floor'], '.4f')} | "
            f"{f(r['gap_to_floor'] and 100 * r['gap_to_floor'], '.2f')}% | {f(ms, '.1f')} | "
            f"{f(st['examples_per_s_median'], ',.0f')} | {f(mfu, '.1f')} | "
            f"{f(r['warmup_excess_s'], '.1f')} | {f(r['first_step_s'], '.1f')} | "
            f"{f(_median(ev), '.2f')} | {f(_median(ck), '.2f')} |"
        )
    for k, v in summary.items():
        if k.endswith(("_ne_rel", "_step_rate")):
            lines.append(f"{k}: {f(v, '.4f')}")
        elif k.endswith("_devices"):
            lines.append(f"{k}: {' vs '.join(v)} (no step-rate ratio across devices)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="base-h200")
    p.add_argument("--recipes", default="bf16,fp8_rowwise")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--log-every", type=int, default=None, help="default: the config's (at most steps / 10)")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--task", default="ctr")
    p.add_argument("--out", required=True)
    p.add_argument("--parallel", action="store_true", help="the recipes as concurrent processes")
    p.add_argument("--merge-only", action="store_true", help="only merge the recipes already in --out")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--profile-at", type=int, default=0,
        help="profile the loop from this (1-based) step: <out>/<recipe>/loop_profile.json",
    )  # fmt: skip
    p.add_argument("--profile-steps", type=int, default=5, help="steps in the profiled window")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    args = p.parse_args(argv)
    out = Path(args.out)
    failed: list[str] = []
    if args.child:
        run_recipe(args, args.child)
        return 0
    if not args.merge_only:
        base = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])]
        procs = []
        for recipe in args.recipes.split(","):
            cmd = [*base, "--child", recipe]
            procs.append((recipe, subprocess.Popen(cmd, env=os.environ.copy())))
            if not args.parallel:
                procs[-1][1].wait()
        failed = [r for r, pr in procs if pr.wait() != 0]
        if failed:
            print(f"quality_run: recipes failed: {failed} (see their output above)", file=sys.stderr)
    summary = merge(out, args.task)
    print(_table(summary))
    print(f"wrote {out / 'quality.json'} and {summary.get('png')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
