"""The loss curve of an N-process gem-train run (torchrun, gloo on the CPU or NCCL on GPUs) against one
process trained on the same global batches, and the peak memory of every rank.

    python packages/gem-train/benchmarks/parallel_curve.py --nproc 4 --steps 30 --out DIR \\
        parallel.dp_replicate=2 parallel.dp_shard=2 parallel.ep=2 parallel.strategy=2d \\
        parallel.group_size=2 parallel.balancer=base_batch_shuffling

It runs ``torchrun --standalone --nproc_per_node=N -m gem_train.cli train --config tiny-cpu ...`` (one
train row per step), then ``same_batches_losses`` of ``benchmarks/one_process_reference.py`` in this process
(it follows the overrides: each rank's balanced stream, the global balancer's partition, 2D tables' replica
averaging), prints a table, writes ``DIR/parallel_curve.json`` and the plot ``DIR/loss_curve.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from one_process_reference import same_batches_losses

from gem_train.config import load_config

SMALL = [
    "data.batch_size=16", "data.eval_batch_size=128", "data.synthetic.eval_examples=512",
    "data.synthetic.max_len=16", "data.synthetic.num_users=500", "data.synthetic.num_items=300",
    "train.log_every=1", "train.progress_bar=false", "optim.warmup_steps=5", "checkpoint.every=0",
    "data.synthetic.valid_examples=0",  # the training curves alone (no validation, no early stop)
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--config", default="tiny-cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides (the [parallel] layout)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*SMALL, f"train.steps={a.steps}", *a.overrides]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
        "-m", "gem_train.cli", "train", "--config", a.config, *overrides, f"run.out_dir={out / 'runs'}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    print("$ " + " ".join(cmd[2:]).replace("torch.distributed.run", "torchrun"), flush=True)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    run = sorted((out / "runs").iterdir())[-1]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    multi = [r["loss"] for r in train]
    memory = {k.split("/")[1]: max(r[k] for r in train) for k in train[-1] if k.startswith("memory_gib/")}
    # The reference: one process, the same global batches (no [parallel] section applies to one process).
    cfg = load_config(a.config, [*overrides, f"run.out_dir={out / 'ref'}"])
    single = same_batches_losses(cfg, a.nproc)
    rel = [abs(x - y) / abs(y) for x, y in zip(multi, single, strict=True)]
    print(f"{'step':>4} {a.nproc}-process loss  1-process loss  rel. diff")
    for i, (x, y, d) in enumerate(zip(multi, single, rel, strict=True), 1):
        print(f"{i:>4} {x:>14.8f} {y:>15.8f} {d:>10.2e}")
    print(f"max relative difference {max(rel):.2e}; peak memory per rank (GiB): "
          + ", ".join(f"{k} {v:.3f}" for k, v in memory.items()))  # fmt: skip
    result = {
        "nproc": a.nproc, "steps": a.steps, "overrides": a.overrides, "multi": multi, "single": single,
        "max_rel_diff": max(rel), "peak_memory_gib": memory, "run_dir": str(run),
    }  # fmt: skip
    (out / "parallel_curve.json").write_text(json.dumps(result, indent=2))
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[3, 1])
    steps = range(1, len(multi) + 1)
    ax.plot(
        steps,
        single,
        "k-",
        lw=3,
        alpha=0.35,
        label="1 process, the same batches (benchmarks/one_process_reference.py)",
    )
    layout = " ".join(o.removeprefix("parallel.") for o in a.overrides)
    label = "\n".join(textwrap.wrap(f"{a.nproc} processes: {layout}", 70))
    ax.plot(steps, multi, "o", ms=4, label=label)
    ax.set_ylabel("training loss (mean over the ranks' batches)")
    ax.legend(fontsize=8)
    bx.semilogy(steps, [max(d, 1e-12) for d in rel], ".-")
    bx.set_ylabel("relative diff.")
    bx.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=110)
    print(f"wrote {out / 'loss_curve.png'} and {out / 'parallel_curve.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
