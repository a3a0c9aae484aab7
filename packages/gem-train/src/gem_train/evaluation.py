"""Evaluation of a model on a held-out split: NE, AUC, calibration and log loss of every task.

Ranks evaluate disjoint batches of the split; the predictions are gathered, so every rank computes the
metrics on the union of every rank's examples and returns the same result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from gem_train.config import TrainConfig
from gem_train.data.loader import BatchSource, make_eval_loader
from gem_train.data.split import HeldOutSplit
from gem_train.distributed import DistInfo, all_gather_object
from gem_train.metrics import BinaryMetrics, binary_metrics, ground_truth_ne

__all__ = ["EvalResult", "EvaluationInterrupted", "evaluate_model", "selection_value"]


class EvaluationInterrupted(Exception):
    """An evaluation stopped early because ``should_stop`` said so (a SIGTERM/SIGINT during it)."""


@dataclass
class EvalResult:
    """Evaluation of every task, the hidden model's NE floor (synthetic data), and the predictions."""

    step: int
    tasks: dict[str, BinaryMetrics]
    ground_truth_ne: dict[str, float] | None = None
    predictions: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    def as_flat_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, m in self.tasks.items():
            out.update(m.as_dict(prefix=f"{t}/"))
        for t, v in (self.ground_truth_ne or {}).items():
            out[f"{t}/ground_truth_ne"] = v
        return out

    def summary(self) -> str:
        lines = []
        for t, m in self.tasks.items():
            floor = (self.ground_truth_ne or {}).get(t)
            extra = f"  (ground-truth NE floor {floor:.4f})" if floor is not None else ""
            lines.append(
                f"  {t:>4}: NE {m.ne:.4f}  AUC {m.auc:.4f}  calibration {m.calibration:.3f}  "
                f"log loss {m.log_loss:.4f}  n={m.count}{extra}"
            )
        return "\n".join(lines)


def selection_value(ev: EvalResult, task: str) -> float:
    """The validation NE that selects: of ``task``, or the mean over the evaluated tasks (``"mean"``).

    NaN when the task was not evaluated (no labelled example): such a value never selects.
    """
    if task == "mean":
        nes = [m.ne for m in ev.tasks.values()]
        return float(np.mean(nes)) if nes else float("nan")
    m = ev.tasks.get(task)
    return float(m.ne) if m is not None else float("nan")


@torch.no_grad()
def evaluate_model(
    model: nn.Module,
    source: BatchSource,
    cfg: TrainConfig,
    dist_info: DistInfo,
    autocast_dtype: torch.dtype | None,
    step: int = 0,
    max_batches: int = 0,
    split: HeldOutSplit = "test",
    should_stop: Callable[[], bool] | None = None,
) -> EvalResult:
    """NE, AUC, calibration and log loss of every task on the held-out ``split`` of ``source``.

    ``split``: "test" (default) or "valid" (the validation split). Ranks evaluate disjoint batches; the
    predictions are gathered so every rank returns the same result. ``max_batches = 0`` evaluates the whole
    split. On synthetic data the result also holds the NE of the hidden ground-truth model on the same
    labels (the floor). ``should_stop`` (collective with several ranks: every rank calls it equally often,
    before each of the first ``batches // world_size`` batches) ends the evaluation early with
    :class:`EvaluationInterrupted` when it returns True.
    """
    tasks = tuple(source.spec.tasks)
    device = dist_info.device
    was_training = model.training
    model.eval()
    loader = make_eval_loader(
        source,
        cfg.data.eval_batch_size,
        max_batches=max_batches,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda",
        split=split,
    )
    ctx = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    total = source.num_batches(split, cfg.data.eval_batch_size) or 0
    # Every rank has at least this many batches: the collective should_stop is called that often.
    checked = (min(total, max_batches) if max_batches else total) // dist_info.world_size
    probs, labels, masks, truth = [], [], [], []
    try:
        for i, lb in enumerate(loader):
            if should_stop is not None and i < checked and should_stop():
                raise EvaluationInterrupted(
                    f"the evaluation of the {split} split at step {step} was interrupted"
                )
            batch = lb.batch.to(device, non_blocking=True)
            with ctx:
                logits = model(batch)
            probs.append(torch.stack([torch.sigmoid(logits[t].float()) for t in tasks], 1).cpu().numpy())
            labels.append(lb.batch.labels.numpy())
            masks.append(lb.batch.label_mask.numpy())
            if lb.true_probs is not None:
                truth.append(lb.true_probs)
    finally:
        if was_training:
            model.train()
    n_tasks = len(tasks)
    local = {
        "p": np.concatenate(probs) if probs else np.zeros((0, n_tasks)),
        "y": np.concatenate(labels) if labels else np.zeros((0, n_tasks)),
        "m": np.concatenate(masks) if masks else np.zeros((0, n_tasks), bool),
        "t": np.concatenate(truth) if truth else None,
    }
    parts = all_gather_object(local, dist_info.world_size)
    p = np.concatenate([x["p"] for x in parts]).astype(np.float64)
    y = np.concatenate([x["y"] for x in parts]).astype(np.float64)
    m = np.concatenate([x["m"] for x in parts]).astype(bool)
    # The floor needs the hidden probabilities of every example (synthetic data only).
    has_truth = all(x["t"] is not None for x in parts if len(x["p"])) and any(
        x["t"] is not None for x in parts
    )
    results, preds = {}, {}
    for j, task in enumerate(tasks):
        sel = m[:, j]
        if sel.any():
            results[task] = binary_metrics(p[sel, j], y[sel, j])
            preds[task] = (p[sel, j], y[sel, j])
    floors = None
    if has_truth:
        t = [x["t"] for x in parts if x["t"] is not None]
        floors = ground_truth_ne(t, [y], [m], tasks) or None
    return EvalResult(step, results, floors, preds)
