"""Throughput of ``gem-train predict`` on the CPU (issue 36): examples/s end to end, and its parts.

For each model (GEM ``tiny`` and the MLP baseline, on the ``tiny-cpu`` synthetic data), a one-step
checkpoint (weights do not change the speed) predicts ``--rows`` test rows into a fresh directory, with
``data.num_workers`` 0 (data in the main process) and 1 (data in a loader process beside the model), and
``run.cpu_threads`` as given. Also timed apart: making the batches alone, and the model's forward alone on
batches made beforehand. Wall-clock rates depend on what else runs on the machine (it is shared: the load
average is recorded); ``*_per_cpu_s`` rates divide by this process's CPU time instead, what one dedicated
core would do. With ``--compile``, predict also runs with its layers compiled (``run_predict(compile=True)``),
twice: the first run compiles, the second loads inductor's on-disk caches. Writes ``OUT/bench_predict.json``.

    uv run --no-sync python packages/gem-train/benchmarks/bench_predict.py --out runs/bench_predict
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any


def _checkpoint(out: Path, arch: str) -> str:
    from gem_train.config import load_config
    from gem_train.loop.trainer import Trainer

    cfg = load_config("tiny-cpu", [f"model.arch={arch}", "train.steps=1", f"run.out_dir={out / arch}",
                                   "train.progress_bar=false", "train.eval_every=0", "checkpoint.every=0",
                                   "data.synthetic.eval_examples=1024"])  # fmt: skip
    res = Trainer(cfg).fit()
    return str(res.last_checkpoint)


def _parts(cfg: Any, ckpt: str, rows: int) -> dict[str, float]:
    """Batches made alone, and the model's forward alone, in examples/s."""
    import torch

    from gem_train.checkpoint import load_checkpoint
    from gem_train.loop.build import build_run
    from gem_train.transfer.predict import launch_forward

    run = build_run(cfg, training=False)
    load_checkpoint(ckpt, run.model, None, restore_rng=False)
    bs = cfg.data.eval_batch_size
    n = rows // bs
    t0, c0 = time.perf_counter(), time.process_time()
    batches = [run.source.get("test", j, bs).batch for j in range(n)]
    out = {"data_examples_per_s": n * bs / (time.perf_counter() - t0),
           "data_examples_per_cpu_s": n * bs / (time.process_time() - c0)}  # fmt: skip
    model = run.model.eval()
    launch_forward(model, batches[0], run.tasks, torch.device("cpu"), None).wait()  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    for b in batches:
        launch_forward(model, b, run.tasks, torch.device("cpu"), None).wait()
    out["forward_examples_per_s"] = n * bs / (time.perf_counter() - t0)
    out["forward_examples_per_cpu_s"] = n * bs / (time.process_time() - c0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int, default=32_768)
    p.add_argument("--threads", type=int, default=1, help="run.cpu_threads (torch intra-op threads)")
    p.add_argument("--models", nargs="+", default=["gem", "mlp"])
    p.add_argument("--compile", action="store_true", help="also predict with --compile (twice: the first "
                   "run compiles, the second finds inductor's caches)")  # fmt: skip
    args = p.parse_args()
    from gem_train.checkpoint import read_trainer_state
    from gem_train.config import TrainConfig, apply_overrides, config_from_dict
    from gem_train.transfer.predict import run_predict

    results: dict[str, Any] = {"rows": args.rows, "threads": args.threads, "cores": os.cpu_count(),
                               "load_average_before": os.getloadavg()}  # fmt: skip
    for arch in args.models:
        ckpt = _checkpoint(args.out, arch)
        entry: dict[str, Any] = {}
        for workers in (0, 1):
            over = [f"data.synthetic.eval_examples={args.rows}", f"data.num_workers={workers}",
                    f"run.cpu_threads={args.threads}"]  # fmt: skip
            cfg = config_from_dict(TrainConfig, apply_overrides(read_trainer_state(ckpt)["config"], over))
            dest = args.out / f"preds-{arch}-{workers}"
            shutil.rmtree(dest, ignore_errors=True)
            c0 = time.process_time()
            res = run_predict(cfg, ckpt, dest, ("test",), progress=False)
            entry[f"predict_workers{workers}_examples_per_s"] = res.examples_per_s
            if workers == 0:  # CPU seconds of this process, building the model included: what a core can do
                entry["predict_workers0_examples_per_cpu_s"] = args.rows / (time.process_time() - c0)
            if workers == 0:
                entry.update(_parts(cfg, ckpt, min(args.rows, 8192)))
            if workers == 0 and args.compile:
                for attempt in ("first", "second"):
                    shutil.rmtree(dest, ignore_errors=True)
                    c0, t0 = time.process_time(), time.perf_counter()
                    res = run_predict(cfg, ckpt, dest, ("test",), progress=False, compile=True)
                    key = f"predict_compiled_{attempt}"
                    entry[f"{key}_seconds_with_warmup"] = time.perf_counter() - t0
                    entry[f"{key}_examples_per_s"] = res.examples_per_s  # the warm-up included
                    entry[f"{key}_examples_per_cpu_s"] = args.rows / (time.process_time() - c0)
        results[arch] = entry
        print(arch, json.dumps(entry), flush=True)
    results["load_average_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_predict.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
