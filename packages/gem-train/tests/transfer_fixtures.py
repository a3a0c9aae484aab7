"""Shared pieces of the knowledge-transfer tests: a small synthetic run, a checkpoint, shard reading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from gem_train.config import TrainConfig, load_config

# A small synthetic world and model; held-out splits whose sizes are not multiples of the batch size.
SMALL = (
    "data.batch_size=16",
    "data.eval_batch_size=32",
    "data.synthetic.eval_examples=75",
    "data.synthetic.valid_examples=41",
    "data.synthetic.max_len=8",
    "data.synthetic.num_users=200",
    "data.synthetic.num_items=120",
    "data.synthetic.seed=5",
    "model.overrides.n_layers=1",
    'model.overrides.attention="full"',
    "train.log_every=2",
    "train.progress_bar=false",
    "train.eval_every=0",
    "optim.warmup_steps=1",
    "checkpoint.every=0",
)


def small_config(out: Path, *extra: str) -> TrainConfig:
    return load_config("tiny-cpu", [*SMALL, f"run.out_dir={out}", *extra])


def train_checkpoint(out: Path, *extra: str, steps: int = 2) -> Path:
    """A trained checkpoint of the small run (``steps`` steps)."""
    from gem_train.loop.trainer import Trainer

    res = Trainer(small_config(out, f"train.steps={steps}", *extra)).fit()
    assert res.last_checkpoint is not None
    return res.last_checkpoint


def read_split(out: Path, split: str) -> dict[str, np.ndarray]:
    """Every column of every shard of ``split`` (in shard order), the embedding as ``[n, D]``."""
    tables = [pq.read_table(p) for p in sorted(out.glob(f"{split}-*.parquet"))]
    cols: dict[str, np.ndarray] = {}
    for name in tables[0].column_names:
        parts = []
        for t in tables:
            c = t.column(name).combine_chunks()
            if name == "embedding":
                parts.append(c.flatten().to_numpy().reshape(len(t), -1))
            else:
                parts.append(c.to_numpy(zero_copy_only=False))
        cols[name] = np.concatenate(parts)
    return cols
