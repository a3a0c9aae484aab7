"""The run directory: one folder per run, holding everything the run writes.

Layout::

    <run.out_dir>/<run.name>-<UTC yyyymmdd-HHMMSS>/
        config.toml          the resolved config (overrides applied); `gem-train train --config` re-runs it
        metrics.jsonl        one JSON object per line: {"step", "split": "train"|"eval", "time", metrics...}
        tensorboard/         TensorBoard event files (`tensorboard --logdir <run dir>/tensorboard`)
        checkpoints/step_<N>/  torch.distributed.checkpoint snapshots (see gem_train.checkpoint)
        plots/               loss.png, ne.png, reliability.png (written at the end)
        eval.json            the final evaluation, per task
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunDir", "create_run_dir"]


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def eval_summary(self) -> Path:
        return self.root / "eval.json"

    def make(self) -> RunDir:
        for d in (self.root, self.tensorboard, self.checkpoints, self.plots):
            d.mkdir(parents=True, exist_ok=True)
        return self


def create_run_dir(out_dir: str | Path, name: str, now: _dt.datetime | None = None) -> RunDir:
    """Create ``<out_dir>/<name>-<UTC timestamp>`` (a numeric suffix if it exists already)."""
    now = now or _dt.datetime.now(_dt.UTC)
    base = Path(out_dir) / f"{name}-{now.strftime('%Y%m%d-%H%M%S')}"
    root, i = base, 1
    while root.exists():
        root = base.with_name(f"{base.name}-{i}")
        i += 1
    return RunDir(root).make()
