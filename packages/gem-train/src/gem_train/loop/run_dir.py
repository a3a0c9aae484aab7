"""The run directory: one folder per run, holding everything the run writes.

Layout::

    <run.out_dir>/<run.name>-<UTC yyyymmdd-HHMMSS>/
        config.toml          the resolved config the run started with (overrides applied); `gem-train train
                             --config` re-runs it; a resume never rewrites it
        config_history.jsonl the start and every resume: config, changes, data identity (loop.run_history)
        metrics.jsonl  one JSON row per line: {"step", "split": "train"|"valid"|"test"|"best_test", ...}
        tensorboard/         TensorBoard event files (`tensorboard --logdir <run dir>/tensorboard`)
        checkpoints/step_<N>/  torch.distributed.checkpoint snapshots (see gem_train.checkpoint)
        plots/               loss.png, ne.png, reliability.png (written at the end)
        eval.json            the final evaluation, per task
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from gem_train.checkpoint import latest_checkpoint, resolve_checkpoint
from gem_train.config import TrainConfig, config_to_dict, dumps_toml
from gem_train.loop.distributed import DistInfo

__all__ = [
    "RunDir",
    "create_run_dir",
    "discard_if_unused",
    "pick_latest",
    "resolve_resume",
    "shared_run_dir",
]


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


def discard_if_unused(run: RunDir) -> bool:
    """Remove a new run's directory if the run wrote nothing of its own into it (a run that failed at its
    start: no metrics row but the start's health notes, which stderr also said, no checkpoint, not even a
    partial one, no plot, no evaluation); True if removed.
    Only for a run that created the directory: never call it for a resumed run's."""
    if not run.root.is_dir():
        return False
    kept = (
        _has_rows_beyond_health(run.metrics)
        or run.eval_summary.exists()
        or any(run.checkpoints.iterdir() if run.checkpoints.is_dir() else ())
        or any(run.plots.iterdir() if run.plots.is_dir() else ())
    )
    if kept:
        return False
    shutil.rmtree(run.root, ignore_errors=True)
    return not run.root.exists()


def _has_rows_beyond_health(metrics: Path) -> bool:
    """Whether ``metrics.jsonl`` holds a row other than the start's ``health`` notes (an unreadable line
    counts as a row: keep what cannot be judged)."""
    if not metrics.exists():
        return False
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            return True
        if not isinstance(row, dict) or row.get("split") != "health":
            return True
    return False


def resolve_resume(resume: str | Path, name: str, out_dir: str | Path) -> Path:
    """The checkpoint ``--resume`` names: a checkpoint directory, a run directory (its newest complete
    checkpoint), or ``"latest"`` (the newest checkpoint of the newest run named ``name`` under ``out_dir``).

    Raises FileNotFoundError naming what is missing.
    """
    if str(resume) == "latest":
        return pick_latest(name, out_dir)[0]
    return resolve_checkpoint(resume)


def pick_latest(name: str, out_dir: str | Path) -> tuple[Path, str]:
    """``--resume latest``: the newest complete checkpoint of the newest run named ``name`` under
    ``out_dir`` that has one, and a sentence saying which run that is and why.

    Raises FileNotFoundError naming what is missing.
    """
    # <name>-<yyyymmdd>-<HHMMSS>[-k] only: "tiny-cpu-*" must not match "tiny-cpu-baseline-*".
    pat = re.compile(re.escape(name) + r"-\d{8}-\d{6}(-\d+)?$")
    runs = sorted(p for p in Path(out_dir).glob(f"{name}-*") if pat.match(p.name))
    for i, r in enumerate(reversed(runs)):
        ck = latest_checkpoint(r / "checkpoints")
        if ck is not None:
            newer = f", {i} newer without one" if i else ""
            note = (
                f"--resume latest: {r.name} is the newest run named {name!r} under {out_dir} with a complete "
                f"checkpoint ({ck.name}); {len(runs) - 1} other run(s) of that name{newer}"
            )
            return ck, note
    raise FileNotFoundError(f"no checkpoint of a run named {name!r} under {out_dir}")


def shared_run_dir(cfg: TrainConfig, resume_from: Path | None, d: DistInfo) -> RunDir:
    """The run directory of every rank: rank 0 creates it (or reuses the resumed run's, the one holding
    checkpoint ``resume_from``), makes its folders and writes config.toml (a new run only); every rank
    learns the path."""
    root: list[str | None] = [str(resume_from.parent.parent)] if resume_from else [None]
    if d.is_main and root[0] is None:
        root[0] = str(create_run_dir(cfg.run.out_dir, cfg.run.name).root)
    if d.world_size > 1:
        dist.broadcast_object_list(root, src=0)
    assert root[0] is not None  # set on rank 0, then broadcast
    run = RunDir(Path(root[0]))
    if d.is_main:
        run.make()
        if resume_from is None:  # a resumed run keeps its first config (gem_train.loop.run_history)
            run.config.write_text(dumps_toml(config_to_dict(cfg)), encoding="utf-8")
    return run
