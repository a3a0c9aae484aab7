"""Metric logging: ``metrics.jsonl`` (the record) and TensorBoard (the view)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "read_metrics", "truncate_metrics"]


def _clean(v: Any) -> Any:
    # JSON has no NaN/Inf: write them as strings so the file stays valid JSON lines.
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


class MetricsLogger:
    """Appends one JSON line per (step, split) and mirrors scalars to TensorBoard as ``<split>/<key>``.

    Only rank 0 should create an enabled logger; ``enabled=False`` makes every call a no-op.
    """

    def __init__(self, metrics_path: Path, tensorboard_dir: Path | None, enabled: bool = True) -> None:
        self.enabled = enabled
        self._path = Path(metrics_path)
        self._tb = None
        if enabled and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "split": split, "time": time.time()}
        row.update({k: _clean(float(v)) for k, v in values.items()})
        with self._path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(f"{split}/{k}", float(v), global_step=int(step))

    def note(self, step: int, split: str, values: dict[str, str | float]) -> None:
        """A row of words (e.g. a ``health`` warning: its check and message) at ``step``; TensorBoard gets
        the strings as text."""
        if not self.enabled:
            return
        row: dict[str, Any] = {"step": int(step), "split": split, "time": time.time()}
        row.update({k: v if isinstance(v, str) else _clean(float(v)) for k, v in values.items()})
        with self._path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            text = " ".join(str(v) for v in values.values())
            self._tb.add_text(split, text, global_step=int(step))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl (NaN/Inf strings back to floats)."""
    rows: list[dict[str, Any]] = []
    if not Path(path).exists():
        return rows
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for k, v in row.items():
            if v in ("nan", "inf", "-inf"):
                row[k] = float(v)
        rows.append(row)
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows after ``last_step`` (a run resumed from step N re-logs the steps after N)."""
    path = Path(path)
    if not path.exists():
        return
    keep = []
    for ln in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill mid-write
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            keep.append(ln)
    path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
