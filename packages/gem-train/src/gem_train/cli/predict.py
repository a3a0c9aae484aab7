"""``gem-train predict``: batch inference of a checkpoint into Parquet shards (gem_train.transfer.predict).

    gem-train predict --checkpoint CKPT --out DIR [--split train|valid|test|all] [--embeddings]
                      [--train-batches N] [--shard-rows N] [--compile] [key=value ...]

The overrides apply to the checkpoint's config, e.g. ``data.synthetic.window=1`` to score later data with an
older model, or ``data.parquet.test=[...]`` to score other files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]

_SPLITS = ("train", "valid", "test", "all")


def add_parser(sub: Any, count: Any, ov_help: str) -> None:
    """The ``predict`` subcommand on ``sub`` (an argparse subparsers object); ``count(minimum)`` parses
    counts."""
    p = sub.add_parser(
        "predict",
        help="score a dataset with a checkpoint: Parquet shards of keys, probabilities, logits (and "
        "representations) plus a manifest; resumable, one process or torchrun",
    )
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory (or a run dir: its newest)")
    p.add_argument("--out", required=True, help="the output directory (a rerun skips complete shards)")
    p.add_argument("--split", choices=_SPLITS, default="all", help="the split(s) to score (default all)")
    p.add_argument(
        "--embeddings",
        action="store_true",
        help="also write the model's representation (the task heads' shared input) per row",
    )
    p.add_argument(
        "--train-batches",
        type=count(0),
        default=0,
        help="synthetic data's endless training stream: score its first N batches (0: one epoch)",
    )
    p.add_argument("--shard-rows", type=count(1), default=65_536, help="rows per output shard (about)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model's layers (minutes of warm-up the first time; for large splits)",
    )
    p.add_argument("overrides", nargs="*", help=ov_help + " (applied to the checkpoint's config)")


def run(args: argparse.Namespace, checkpoint_config: Any) -> int:
    """Run ``predict``; ``checkpoint_config(path, overrides) -> (cfg, resolved checkpoint)``."""
    from gem_train.transfer.predict import run_predict

    cfg, ckpt = checkpoint_config(Path(args.checkpoint), args.overrides)
    splits = ("train", "valid", "test") if args.split == "all" else (args.split,)
    res = run_predict(
        cfg,
        ckpt,
        args.out,
        splits,
        embeddings=args.embeddings,
        train_batches=args.train_batches,
        shard_rows=args.shard_rows,
        progress=not args.no_progress,
        compile=args.compile,
    )
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        rows = ", ".join(f"{s} {n:,}" for s, n in res.rows.items())
        print(
            f"predictions of {ckpt} (step {res.manifest['step']}) in {res.out}: {rows} rows; "
            f"{res.predicted_rows:,} predicted now in {res.seconds:.1f} s ({res.examples_per_s:,.0f} "
            "examples/s)"
        )
        emb = res.manifest.get("embedding")
        if emb:
            print(f"  embedding: {emb['dim']} floats, {emb['tensor']}", file=sys.stderr)
    return 0
