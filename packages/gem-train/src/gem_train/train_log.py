"""The training statistics of a log window (the steps since the last ``train`` row of metrics.jsonl).

The window reuses the step's own masked BCE (:attr:`gem_train.run.StepResult.per_task`), so no loss is
computed twice, and keeps its sums on the device: no host sync per step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from gem_model import GemBatch
from gem_train.metrics import binary_entropy

__all__ = ["TrainWindow"]


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
