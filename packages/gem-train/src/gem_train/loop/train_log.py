"""The training statistics of a log window (the steps since the last ``train`` row of metrics.jsonl).

The window reuses the step's own masked BCE (:attr:`gem_train.loop.step.StepResult.per_task`), so no loss is
computed twice, and keeps its sums on the device: no host sync per step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gem_model import GemBatch
from gem_train.evaluation.metrics import binary_entropy
from gem_train.loop.distributed import all_gather_object, peak_memory_gib
from gem_train.loop.metrics_log import MetricsLogger

if TYPE_CHECKING:
    from gem_train.loop.step import BuiltRun

__all__ = ["TrainWindow", "log_train"]


class TrainWindow:
    """Sums over the steps of one log window: per-task BCE, labelled and positive counts, loss, examples,
    model FLOPs."""

    def __init__(self, tasks: tuple[str, ...], device: torch.device) -> None:
        self.tasks, self.device = tasks, device
        self.reset()

    def reset(self) -> None:
        n = len(self.tasks)
        self.bce = torch.zeros(n, dtype=torch.float64, device=self.device)
        self.count = torch.zeros_like(self.bce)
        self.pos = torch.zeros_like(self.bce)
        self.loss_sum, self.steps, self.examples, self.flops = 0.0, 0, 0, 0
        self.t0 = time.perf_counter()

    @torch.no_grad()
    def add(self, per_task: dict[str, Tensor], batch: GemBatch, loss: float) -> None:
        """One step: ``per_task[t]`` is the masked mean BCE of task ``t`` over ``batch``'s labelled rows."""
        m = batch.label_mask.double()  # [B, T]
        count = m.sum(0)
        self.bce += torch.stack([per_task[t].double() for t in self.tasks]) * count
        self.count += count
        self.pos += (batch.labels.double() * m).sum(0)
        self.loss_sum += loss
        self.steps += 1
        self.examples += batch.batch_size

    def ne(self) -> list[float]:
        """NE of each task over the window (this rank's examples; NaN without labels of both classes)."""
        out = []
        for b, c, p in zip(self.bce.tolist(), self.count.tolist(), self.pos.tolist(), strict=True):
            h = binary_entropy(p / c) if c else 0.0
            out.append(b / c / h if h > 0 else float("nan"))
        return out

    def row(self, world_size: int, lr: float, peak_flops: float | None) -> dict[str, Any]:
        """The ``train`` row of metrics.jsonl (call after a device sync, so the time is the steps')."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        row: dict[str, Any] = {
            "loss": self.loss_sum / max(self.steps, 1),
            "examples_per_s": self.examples * world_size / dt,
            "step_time_s": dt / max(self.steps, 1),
            "lr": lr,
        }
        for t, v in zip(self.tasks, self.ne(), strict=True):
            row[f"{t}/ne"] = v
        if self.flops and peak_flops:
            row["mfu"] = self.flops / dt / peak_flops
            row["model_tflops_per_s"] = self.flops / dt / 1e12
        if self.device.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return row


def log_train(step: int, w: TrainWindow, bar: Any, logger: MetricsLogger, r: BuiltRun) -> dict[str, Any]:
    """Log window ``w`` as the ``train`` row of ``step`` (with every rank's peak memory; every rank calls)
    and show its throughput, loss, first task's NE and MFU on the progress bar ``bar`` (a tqdm); returns the
    row."""
    if r.device.type == "cuda":
        torch.cuda.synchronize(r.device)
    opt = r.dense_opt
    row = w.row(r.dist.world_size, opt.param_groups[0]["lr"] if opt else 0.0, r.peak_flops)
    for rank, gib in enumerate(all_gather_object(peak_memory_gib(r.device), r.dist.world_size)):
        row[f"memory_gib/rank{rank}"] = gib  # peak allocated (GPU) or peak RSS (CPU) of each rank
    logger.log(step, "train", row)
    post = {"ex/s": f"{row['examples_per_s']:,.0f}", "loss": f"{row['loss']:.4f}",
            f"NE[{w.tasks[0]}]": f"{row[f'{w.tasks[0]}/ne']:.4f}"}  # fmt: skip
    if "mfu" in row:
        post["MFU"] = f"{100 * row['mfu']:.1f}%"
    bar.set_postfix(post, refresh=False)
    return row
