"""Evaluation of a model on a held-out split: NE, AUC, calibration, log loss and GAUC of every task.

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

from gem_model import GemBatch
from gem_train.config import TrainConfig
from gem_train.data.loader import BatchSource, LoadedBatch, make_eval_loader
from gem_train.data.split import HeldOutSplit
from gem_train.evaluation.metrics import BinaryMetrics, binary_metrics, ground_truth_ne
from gem_train.loop.distributed import DistInfo, all_gather_object

__all__ = ["USER_FEATURE", "EvalResult", "EvaluationInterrupted", "evaluate_model", "selection_value"]

USER_FEATURE = "user_id"  # the sparse feature whose id groups examples for GAUC


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
            g = f"  GAUC {m.gauc:.4f}" if m.gauc is not None else ""
            lines.append(
                f"  {t:>4}: NE {m.ne:.4f}  AUC {m.auc:.4f}{g}  calibration {m.calibration:.3f}  "
                f"log loss {m.log_loss:.4f}  n={m.count}{extra}"
            )
        return "\n".join(lines)


def _user_ids(batch: GemBatch) -> np.ndarray | None:
    """``[B]`` int64: the ``user_id`` feature of each example, or None when the batch has no such feature
    (or it is not one id per example)."""
    if USER_FEATURE not in batch.sparse.keys():  # noqa: SIM118 (a KeyedJaggedTensor, not a dict)
        return None
    jt = batch.sparse[USER_FEATURE]
    if not bool((jt.lengths() == 1).all()):
        return None
    return jt.values().cpu().numpy().astype(np.int64)


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
    """NE, AUC, calibration, log loss and GAUC of every task on the held-out ``split`` of ``source``.

    ``split``: "test" (default) or "valid" (the validation split). Ranks evaluate disjoint batches; the
    predictions are gathered so every rank returns the same result. ``max_batches = 0`` evaluates the whole
    split. On synthetic data the result also holds the NE of the hidden ground-truth model on the same
    labels (the floor). ``should_stop`` (collective with several ranks: every rank calls it before each of
    its ``ceil(batches / world_size)`` batches) ends the evaluation early with
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
    total = min(total, max_batches) if max_batches else total
    # Every rank runs the same number of forwards, ceil(total / world): a sharded model's forward is
    # collective (FSDP2 all-gathers, expert parallelism), so a rank with one batch fewer runs a filler batch
    # whose predictions are dropped.
    per_rank = -(-total // dist_info.world_size)
    probs: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    truth: list[np.ndarray] = []
    users: list[np.ndarray | None] = []

    def forward(lb: LoadedBatch) -> np.ndarray:
        batch, n = lb.batch, lb.batch.batch_size
        if n < cfg.data.eval_batch_size:
            # Pad the short last batch with copies of its first example (their predictions are dropped):
            # TorchRec-sharded tables need the same batch size on every rank, and with every forward of the
            # same shape the predictions do not depend on the world size (a GEMM of fewer rows may round
            # differently on some CPUs).
            batch = batch.select(list(range(n)) + [0] * (cfg.data.eval_batch_size - n))
        with ctx:
            logits = model(batch.to(device, non_blocking=True))
        return torch.stack([torch.sigmoid(logits[t].float()) for t in tasks], 1)[:n].cpu().numpy()

    try:
        it = iter(loader)
        for _ in range(per_rank):
            if should_stop is not None and should_stop():
                raise EvaluationInterrupted(
                    f"the evaluation of the {split} split at step {step} was interrupted"
                )
            lb = next(it, None)
            if lb is None:  # this rank's share is done: a filler forward, for the collectives
                forward(source.get(split, 0, cfg.data.eval_batch_size))
                continue
            probs.append(forward(lb))
            users.append(_user_ids(lb.batch))
            labels.append(lb.batch.labels.numpy())
            masks.append(lb.batch.label_mask.numpy())
            if lb.true_probs is not None:
                truth.append(lb.true_probs)
    finally:
        if was_training:
            model.train()
    n_tasks = len(tasks)
    known = [u for u in users if u is not None]
    local: dict[str, np.ndarray | None] = {
        "p": np.concatenate(probs) if probs else np.zeros((0, n_tasks)),
        "y": np.concatenate(labels) if labels else np.zeros((0, n_tasks)),
        "m": np.concatenate(masks) if masks else np.zeros((0, n_tasks), bool),
        "t": np.concatenate(truth) if truth else None,
        "u": np.concatenate(known) if known and len(known) == len(users) else None,
    }
    parts = all_gather_object(local, dist_info.world_size)
    p = np.concatenate([x["p"] for x in parts]).astype(np.float64)
    y = np.concatenate([x["y"] for x in parts]).astype(np.float64)
    m = np.concatenate([x["m"] for x in parts]).astype(bool)
    # GAUC needs the user of every example (a "user_id" feature of one id per example).
    with_users = [x for x in parts if len(x["p"])]
    u = np.concatenate([x["u"] for x in with_users]) if all(x["u"] is not None for x in with_users) else None
    # The floor needs the hidden probabilities of every example (synthetic data only).
    has_truth = all(x["t"] is not None for x in parts if len(x["p"])) and any(
        x["t"] is not None for x in parts
    )
    results, preds = {}, {}
    for j, task in enumerate(tasks):
        sel = m[:, j]
        if sel.any() and not np.isfinite(p[sel, j]).all():
            # A diverged model (non-finite weights): its metrics are NaN (they never select a checkpoint),
            # and the training loop's non-finite policy decides what happens next.
            nan = float("nan")
            results[task] = BinaryMetrics(nan, nan, nan, nan, float(y[sel, j].mean()), int(sel.sum()))
        elif sel.any():
            results[task] = binary_metrics(p[sel, j], y[sel, j], groups=None if u is None else u[sel])
            preds[task] = (p[sel, j], y[sel, j])
    floors = None
    if has_truth:
        t = [x["t"] for x in parts if x["t"] is not None]
        floors = ground_truth_ne(t, [y], [m], tasks) or None
    return EvalResult(step, results, floors, preds)
