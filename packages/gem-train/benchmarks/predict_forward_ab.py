"""The CPU forward of ``gem-train predict`` under alternatives, measured in turn in one process (issue 36).

On a shared machine two runs minutes apart differ by more than the changes worth measuring here, so each
round runs every variant once, in turn, on the same batches, and the table gives each variant's median
examples/s over the rounds and the median of its per-round ratio to the first variant. Variants:

- ``--chunks R1 R2 ...``: :data:`gem_model.rowwise.ROW_CHUNK` (a huge value turns row chunking off);
- ``--rows N1 N2 ...``: the rows of one forward (predict's
  :data:`~gem_train.transfer.predict.MIN_FORWARD_ROWS`).

A one-step checkpoint of GEM ``tiny`` on ``tiny-cpu`` (weights do not change the speed), one thread, glibc's
heap kept as predict keeps it. Run two at once to see what two ranks on two cores see.

    uv run --no-sync python packages/gem-train/benchmarks/predict_forward_ab.py --chunks 1000000000 4096
    uv run --no-sync python packages/gem-train/benchmarks/predict_forward_ab.py --rows 1024 256 512 2048 4096
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, nargs="+", default=None, help="ROW_CHUNK values (rows per chunk)")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="rows of one forward (default 2048)")
    p.add_argument("--examples", type=int, default=8192, help="examples a variant forwards each round")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    if args.chunks and args.rows:
        p.error("vary one thing: --chunks or --rows")

    from bench_predict import _checkpoint as one_step_checkpoint  # this folder's script

    import gem_model.rowwise as rowwise
    from gem_train.checkpoint import load_checkpoint
    from gem_train.config import load_config
    from gem_train.loop.build import build_run
    from gem_train.transfer.heap import keep_freed_memory
    from gem_train.transfer.predict import launch_forward

    torch.set_num_threads(1)
    keep_freed_memory()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = one_step_checkpoint(Path(tmp), "gem")
        cfg = load_config("tiny-cpu", [f"data.synthetic.eval_examples={2 * args.examples}"])
        run = build_run(cfg, training=False)
        load_checkpoint(ckpt, run.model, None, restore_rng=False)
    model, cpu = run.model.eval(), torch.device("cpu")
    rows = args.rows or [2048]
    chunks = args.chunks or [rowwise.ROW_CHUNK]
    variants = [(r, c) for r in rows for c in chunks]
    n_batches = {r: max(1, args.examples // r) for r in rows}
    batches = {r: [run.source.get("test", j, r).batch for j in range(n_batches[r])] for r in rows}
    rates: dict[tuple[int, int], list[float]] = {v: [] for v in variants}
    with torch.inference_mode():
        for r, c in variants:  # warm-up: plans, memos, the heap
            rowwise.ROW_CHUNK = c
            launch_forward(model, batches[r][0], run.tasks, cpu, None).wait()
        for _ in range(args.rounds):
            for r, c in variants:
                rowwise.ROW_CHUNK = c
                t0 = time.perf_counter()
                for b in batches[r]:
                    launch_forward(model, b, run.tasks, cpu, None).wait()
                rates[(r, c)].append(len(batches[r]) * r / (time.perf_counter() - t0))
    first = rates[variants[0]]
    print(f"GEM tiny forward, 1 thread, {args.rounds} rounds; {Path(__file__).name}")
    print(f"{'forward rows':>12} {'ROW_CHUNK':>12} {'median ex/s':>12} {'ratio':>7}")
    for v in variants:
        ratio = statistics.median(a / b for a, b in zip(rates[v], first, strict=True))
        print(f"{v[0]:>12} {v[1]:>12} {statistics.median(rates[v]):>12,.0f} {ratio:>7.3f}")


if __name__ == "__main__":
    main()
