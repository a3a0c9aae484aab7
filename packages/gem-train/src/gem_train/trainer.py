"""The training loop: one process or many (``torchrun``), CPU or GPU, resumable to the exact loss.

One :class:`Trainer` owns a run: data stream, model, optimizers, logging, evaluation and checkpoints.
``fit()`` trains ``train.steps`` steps (from the checkpoint's step when resuming), evaluates the test split
("eval") every ``train.eval_every`` steps and at the end, checkpoints every ``checkpoint.every`` steps, at the
end and on SIGTERM/Ctrl-C, and writes plots and ``eval.json`` into the run directory.

Model selection: with ``train.valid_every > 0`` it also evaluates the validation split ("valid") every
``valid_every`` steps and at the last step, keeps the checkpoint with the lowest validation NE of
``train.select_task`` (or of the mean over tasks, ``"mean"``) in ``checkpoints/best`` (ties keep the earlier
step), and at the end evaluates that checkpoint, loaded back from disk, on the test split. The test split
never takes part in the choice.

Exact resume: a batch is a pure function of its index, the stream's position is the step, the learning rate
is a function of the step, and model, optimizer and RNG states are restored; DataLoaders get their own
``torch.Generator`` so building one never moves the global RNG. So a run stopped at step N and resumed
computes the same losses, bit for bit on the CPU, as one that never stopped.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import gem_model
from gem_model import GemBatch
from gem_train.checkpoint import (
    best_checkpoint,
    checkpoint_pending,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_trainer_state,
    save_best_checkpoint,
    save_checkpoint,
    set_aside_checkpoint,
    wait_for_checkpoints,
)
from gem_train.compile import apply_compile
from gem_train.config import ConfigError, TrainConfig, config_to_dict, dumps_toml
from gem_train.data.loader import BatchSource, make_eval_loader, make_train_loader
from gem_train.logger import MetricsLogger, read_metrics, truncate_metrics
from gem_train.metrics import BinaryMetrics, binary_entropy, binary_metrics
from gem_train.mfu import device_peak_flops
from gem_train.model_factory import BuiltModel, build_gem_config, build_model
from gem_train.optim import build_optimizers, lr_factor, set_lr
from gem_train.plots import plot_curves, plot_reliability
from gem_train.run_dir import RunDir, create_run_dir

__all__ = [
    "DistInfo",
    "EvalResult",
    "EvaluationInterrupted",
    "NonFiniteLossError",
    "StopNow",
    "TrainResult",
    "Trainer",
    "build_source",
    "evaluate_model",
    "init_distributed",
    "multitask_loss",
    "selection_value",
]


class NonFiniteLossError(RuntimeError):
    """The loss (or the dense gradient norm) became NaN/Inf; the message names the step."""


class EvaluationInterrupted(Exception):
    """An evaluation stopped early because ``should_stop`` said so (a SIGTERM/SIGINT during it)."""


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT while the first is being handled: the run stops at once, without a
    checkpoint (the newest complete one stays). ``signum`` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"second {signal.Signals(signum).name}: stopped at once")
        self.signum = signum


# ----------------------------------------------------------------------------------------------------------
# Process group and device
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _resolve_device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device = {spec!r} but CUDA is not available; use 'cpu' or 'auto'")
        if dev.index is None:
            dev = torch.device(f"cuda:{local_rank}")
    return dev


def init_distributed(device_spec: str, cpu_threads: int = 0) -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1), else run alone.

    Backend: NCCL on CUDA, gloo on the CPU. On the CPU, ``cpu_threads > 0`` sets torch's intra-op threads.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _resolve_device(device_spec, local_rank)
    if device.type == "cpu" and cpu_threads > 0:
        torch.set_num_threads(cpu_threads)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return DistInfo(rank, world, local_rank, device)


def _all_gather(obj: Any, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------------------------------------
# Data and loss
# ----------------------------------------------------------------------------------------------------------


def build_source(cfg: TrainConfig) -> BatchSource:
    """The dataset of ``cfg.data.source``."""
    if cfg.data.source == "synthetic":
        from gem_train.data.synthetic import SyntheticAds

        return SyntheticAds(cfg.data.synthetic, seed=cfg.run.seed)
    if cfg.data.source == "parquet":  # your own files (issue 17)
        from gem_train.data.parquet.reader import ParquetSource

        return ParquetSource(cfg.data.parquet, seed=cfg.run.seed)
    from gem_train.data.movielens import MovieLens100K

    return MovieLens100K(cfg.data.movielens, seed=cfg.run.seed)


def _data_stream_state(source: BatchSource, world_size: int, num_workers: int) -> dict[str, Any]:
    """``{"data_stream": ...}`` for a source whose position needs its layout (gem_train.data.parquet)."""
    state = getattr(source, "stream_state", None)
    return {"data_stream": state(world_size, num_workers)} if state is not None else {}


def multitask_loss(logits: dict[str, Tensor], batch: GemBatch, tasks: tuple[str, ...]) -> Tensor:
    """Mean over tasks of the masked mean BCE-with-logits (fp32); ``gem_model.multitask_loss`` if present."""
    fn = getattr(gem_model, "multitask_loss", None)
    if fn is not None:
        return fn(logits, batch)[0]
    losses = []
    for j, t in enumerate(tasks):
        m = batch.label_mask[:, j]
        bce = F.binary_cross_entropy_with_logits(logits[t].float(), batch.labels[:, j], reduction="none")
        losses.append((bce * m).sum() / m.sum().clamp_min(1))
    return torch.stack(losses).mean()


def _is_step_checkpoint(path: Path) -> bool:
    """A periodic/final ``step_<N>`` checkpoint (or its ``.replaced-`` copy), not a ``best_step_<N>``."""
    return re.match(r"^(\.replaced-)?step_\d+$", path.name) is not None


class _Window:
    """Training statistics since the last log line (kept on the device: no sync per step)."""

    def __init__(self, n_tasks: int, device: torch.device) -> None:
        self.n_tasks, self.device = n_tasks, device
        self.reset()

    def reset(self) -> None:
        z = lambda: torch.zeros(self.n_tasks, dtype=torch.float64, device=self.device)
        self.bce, self.count, self.pos = z(), z(), z()
        self.loss_sum, self.steps, self.examples, self.flops = 0.0, 0, 0, 0
        self.t0 = time.perf_counter()

    @torch.no_grad()
    def add(self, logits: dict[str, Tensor], batch: GemBatch, tasks: tuple[str, ...], loss: float) -> None:
        for j, t in enumerate(tasks):
            m = batch.label_mask[:, j].double()
            bce = F.binary_cross_entropy_with_logits(logits[t].float(), batch.labels[:, j], reduction="none")
            self.bce[j] += (bce.double() * m).sum()
            self.count[j] += m.sum()
            self.pos[j] += (batch.labels[:, j].double() * m).sum()
        self.loss_sum += loss
        self.steps += 1
        self.examples += batch.batch_size

    def ne(self) -> list[float]:
        out = []
        for b, c, p in zip(self.bce.tolist(), self.count.tolist(), self.pos.tolist()):
            h = binary_entropy(p / c) if c else 0.0
            out.append(b / c / h if h > 0 else float("nan"))
        return out


# ----------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------


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


@dataclass
class TrainResult:
    """What ``Trainer.fit`` returns. ``final_eval`` is the test split at the last step; with validation
    (``train.valid_every > 0``) ``best_eval`` is the test split of the best-validation checkpoint,
    ``best_step`` its step, ``best_valid_ne`` its validation selection value, ``best_checkpoint`` its path."""

    run_dir: Path
    step: int
    status: str  # "completed" | "interrupted" | "stopped"
    losses: list[float]
    final_eval: EvalResult | None
    last_checkpoint: Path | None
    best_step: int | None = None
    best_valid_ne: float | None = None
    best_checkpoint: Path | None = None
    best_eval: EvalResult | None = None


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
    split: str = "eval",
    should_stop: Callable[[], bool] | None = None,
) -> EvalResult:
    """NE, AUC, calibration and log loss of every task on a held-out split of ``source``.

    ``split``: "eval" (the test split, default) or "valid" (the validation split). Ranks evaluate disjoint
    batches; the predictions are gathered so every rank returns the same result. ``max_batches = 0``
    evaluates the whole split. On synthetic data the result also holds the NE of the hidden ground-truth
    model on the same labels (the floor). ``should_stop`` (collective with several ranks: every rank calls
    it equally often, before each of the first ``batches // world_size`` batches) ends the evaluation early
    with :class:`EvaluationInterrupted` when it returns True.
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
    checked = (
        min(total, max_batches) if max_batches else total
    ) // dist_info.world_size  # every rank has these
    probs, labels, masks, truth = [], [], [], []
    for i, lb in enumerate(loader):
        if should_stop is not None and i < checked and should_stop():
            if was_training:
                model.train()
            raise EvaluationInterrupted(f"the evaluation of the {split} split at step {step} was interrupted")
        batch = lb.batch.to(device, non_blocking=True)
        with ctx:
            logits = model(batch)
        probs.append(torch.stack([torch.sigmoid(logits[t].float()) for t in tasks], 1).cpu().numpy())
        labels.append(lb.batch.labels.numpy())
        masks.append(lb.batch.label_mask.numpy())
        if lb.true_probs is not None:
            truth.append(lb.true_probs)
    if was_training:
        model.train()
    local = {
        "p": np.concatenate(probs) if probs else np.zeros((0, len(tasks))),
        "y": np.concatenate(labels) if labels else np.zeros((0, len(tasks))),
        "m": np.concatenate(masks) if masks else np.zeros((0, len(tasks)), bool),
        "t": np.concatenate(truth) if truth else None,
    }
    parts = _all_gather(local, dist_info.world_size)
    p = np.concatenate([x["p"] for x in parts]).astype(np.float64)
    y = np.concatenate([x["y"] for x in parts]).astype(np.float64)
    m = np.concatenate([x["m"] for x in parts]).astype(bool)
    has_truth = all(x["t"] is not None for x in parts if len(x["p"])) and any(
        x["t"] is not None for x in parts
    )
    t = np.concatenate([x["t"] for x in parts if x["t"] is not None]) if has_truth else None
    results, floors, preds = {}, {}, {}
    for j, task in enumerate(tasks):
        sel = m[:, j]
        if not sel.any():
            continue
        results[task] = binary_metrics(p[sel, j], y[sel, j])
        preds[task] = (p[sel, j], y[sel, j])
        if t is not None:
            floors[task] = binary_metrics(np.clip(t[sel, j], 0, 1), y[sel, j]).ne
    return EvalResult(step, results, floors or None, preds)


# ----------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------


class Trainer:
    """A training run of ``cfg``; ``resume`` is a checkpoint directory to continue from."""

    def __init__(self, cfg: TrainConfig, resume: str | Path | None = None) -> None:
        self.cfg = cfg
        self.dist = init_distributed(cfg.run.device, cfg.run.cpu_threads)
        self.device = self.dist.device
        resume = resume or cfg.checkpoint.resume_from or None
        self.resume_from = self._resolve_resume(resume) if resume else None

        # Everything that can reject the config comes before the run directory exists: the dataset (a corrupt
        # MovieLens record), the selection task, the model's overrides.
        self.source = build_source(cfg)
        self.spec = self.source.spec
        self.tasks = tuple(self.spec.tasks)
        self._check_selection()
        if cfg.model.arch == "gem":
            build_gem_config(cfg.model, self.spec)

        # The run directory: rank 0 creates it (or reuses the resumed run's), everyone learns the path.
        root: list[str | None] = [str(self.resume_from.parent.parent)] if self.resume_from else [None]
        if self.dist.is_main and root[0] is None:
            root[0] = str(create_run_dir(cfg.run.out_dir, cfg.run.name).root)
        if self.dist.world_size > 1:
            dist.broadcast_object_list(root, src=0)
        assert root[0] is not None  # set on rank 0, then broadcast
        self.run = RunDir(Path(root[0]))
        if self.dist.is_main:
            self.run.make()
            self.run.config.write_text(dumps_toml(config_to_dict(cfg)), encoding="utf-8")

        self.built: BuiltModel = build_model(cfg.model, self.spec, self.device, cfg.run.seed, cfg.precision)
        self.model = self.built.model
        dense_params = list(self.model.dense_parameters())
        sparse_params = list(self.model.sparse_parameters())
        seen = {id(p) for p in dense_params + sparse_params}
        # Anything the model lists in neither group trains with the dense optimizer.
        dense_params += [p for p in self.model.parameters() if id(p) not in seen]
        self.dense_params = dense_params
        self.optimizers = build_optimizers(dense_params, sparse_params, cfg.optim)
        self.dense_opt = self.optimizers[0] if dense_params else None

        self.train_model: nn.Module = self.model
        if cfg.train.compile:
            self.train_model = apply_compile(self.train_model)
        if self.dist.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # Every parameter is replicated (DDP), embedding tables included; gem-parallel shards them.
            self.train_model = DDP(
                self.train_model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=True,  # some tables/experts may see no ids in a batch
            )
        self.autocast_dtype = self._autocast_dtype()
        self.peak_flops = device_peak_flops(self.device, cfg.train.peak_flops)
        self.logger = MetricsLogger(self.run.metrics, self.run.tensorboard, enabled=self.dist.is_main)

        self.start_step = 0
        self.skipped = 0
        if self.resume_from is not None:
            state = load_checkpoint(self.resume_from, self.model, self.optimizers)
            if hasattr(self.source, "check_resume"):  # a streamed position needs the same layout
                self.source.check_resume(state, self.dist.world_size, cfg.data.num_workers)
            self.start_step = int(state["step"])
            self.skipped = int(state.get("skipped_batches", 0))
            if self.dist.is_main:
                truncate_metrics(self.run.metrics, self.start_step)
        # The best-validation checkpoint so far: (step, value). On resume, one written after the resumed
        # step belongs to a future this run recomputes (exactly, on the CPU), so it is dropped.
        self.best: tuple[int, float] | None = None
        if cfg.train.valid_every:
            found = best_checkpoint(self.run.checkpoints)
            if found is not None:
                st = read_trainer_state(found)
                sel = st.get("selection", {})
                if self.resume_from is not None and int(st["step"]) <= self.start_step and "value" in sel:
                    self.best = (int(st["step"]), float(sel["value"]))
                elif self.dist.is_main:
                    (self.run.checkpoints / "best").unlink()
        # Dropout etc. differ per rank (the same seed would correlate them across ranks).
        if self.resume_from is None:
            torch.manual_seed(cfg.run.seed + 1_000_003 * (self.dist.rank + 1))
        self.losses: list[float] = []
        self._stop_signal: int | None = None
        self.last_checkpoint: Path | None = self.resume_from
        # A checkpoint is *good* once a finite step has been computed from its state. Until then it is
        # unconfirmed, and the good one before it is kept (never pruned) and named as "the last good
        # checkpoint" if training diverges; the unconfirmed one is then set aside.
        self._unconfirmed: Path | None = None
        self._last_good: Path | None = None
        self._saved_step: int | None = None  # the step of the newest step_<N> checkpoint of this state
        if self.resume_from is not None and _is_step_checkpoint(self.resume_from):
            self._saved_step = self.start_step
            self._unconfirmed = self.resume_from
            ckpts = list_checkpoints(self.run.checkpoints)
            older = [c for c in ckpts if (checkpoint_step(c) or 0) < self.start_step]
            self._last_good = older[-1] if older else None

    # -- setup helpers ---------------------------------------------------------------------------------------

    def _check_selection(self) -> None:
        t = self.cfg.train
        # The task is checked even when no selection runs: every config value is range-checked.
        if t.select_task != "mean" and t.select_task not in self.tasks:
            raise ConfigError(
                f"train.select_task = {t.select_task!r} is not a task of this dataset "
                f"({', '.join(self.tasks)}) nor 'mean'"
            )
        if t.valid_every and not self.source.num_batches("valid", self.cfg.data.eval_batch_size):
            key = {
                "movielens-100k": "data.movielens.valid_fraction",
                "parquet": "data.parquet.valid (files)",
            }.get(self.cfg.data.source, "data.synthetic.valid_examples")
            raise ConfigError(
                f"train.valid_every = {t.valid_every} needs a validation split, but the dataset has none "
                f"(set {key} > 0, or train.valid_every = 0)"
            )

    def _resolve_resume(self, resume: str | Path) -> Path:
        if str(resume) == "latest":
            # <name>-<yyyymmdd>-<HHMMSS>[-k] only: "tiny-cpu-*" must not match "tiny-cpu-baseline-*".
            pat = re.compile(re.escape(self.cfg.run.name) + r"-\d{8}-\d{6}(-\d+)?$")
            runs = sorted(
                p for p in Path(self.cfg.run.out_dir).glob(f"{self.cfg.run.name}-*") if pat.match(p.name)
            )
            for r in reversed(runs):
                ck = latest_checkpoint(r / "checkpoints")
                if ck is not None:
                    return ck
            raise FileNotFoundError(
                f"no checkpoint of a run named {self.cfg.run.name!r} under {self.cfg.run.out_dir}"
            )
        path = Path(resume)
        if (path / "checkpoints").is_dir():  # a run directory: take its newest checkpoint
            ck = latest_checkpoint(path / "checkpoints")
            if ck is None:
                raise FileNotFoundError(f"run directory {path} has no complete checkpoint")
            return ck
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        return path

    def _autocast_dtype(self) -> torch.dtype | None:
        mode = self.cfg.train.autocast
        if mode == "none":
            return None
        if mode == "auto":
            return torch.bfloat16 if self.device.type == "cuda" and torch.cuda.is_bf16_supported() else None
        return torch.bfloat16

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # -- signals --------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None:
            raise StopNow(signum)  # a second signal: stop now, without a checkpoint
        self._stop_signal = signum

    def _install_signals(self) -> dict[int, Any]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, Any] = {}
        for s in (signal.SIGTERM, signal.SIGINT):
            old[s] = signal.signal(s, self._on_signal)
        return old

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self._stop_signal is not None else 0.0])
        if self.dist.world_size > 1:
            flag = flag.to(self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks stop at the same step
        return bool(flag.item() > 0)

    # -- checkpoints ----------------------------------------------------------------------------------------

    def _extra(self, step: int) -> dict[str, Any]:
        return {
            "config": config_to_dict(self.cfg),
            "data_position": step,  # batches consumed by each rank
            "skipped_batches": self.skipped,
            "saved_at": _dt.datetime.now(_dt.UTC).isoformat(),
            **_data_stream_state(self.source, self.dist.world_size, self.cfg.data.num_workers),
        }

    def save(self, step: int) -> Path:
        """Checkpoint the current state as ``step`` (all ranks call). The last good checkpoint is kept
        whatever ``checkpoint.keep_last`` says until a finite step confirms this one.

        Returns once the files are written: the seal (hashing, manifest, rename, pruning) runs in the
        background while training goes on (:func:`gem_train.checkpoint.wait_for_checkpoints`)."""
        protect = [self._last_good] if self._last_good is not None else []
        path = save_checkpoint(
            self.run.checkpoints,
            step,
            self.model,
            self.optimizers,
            self._extra(step),
            self.cfg.checkpoint.keep_last,
            protect=protect,
            background=True,
        )
        self.last_checkpoint = path
        self._unconfirmed = path
        self._saved_step = step
        return path

    def _save_unless_saved(self, step: int) -> None:
        """Save ``step`` unless its state is already the newest checkpoint (a periodic save, or the
        checkpoint this run resumed from, at this very step): saving the same state twice gains nothing."""
        if self._saved_step != step:
            self.save(step)

    def _confirm_checkpoint(self) -> None:
        """A finite step was computed from the unconfirmed checkpoint's state: it is good; the good one it
        superseded may now be pruned by ``keep_last``."""
        if self._unconfirmed is None:
            return
        self._last_good, self._unconfirmed = self._unconfirmed, None
        # While a seal is in flight its own pruning (and the next save's) does this: it never waits here.
        if self.dist.is_main and not checkpoint_pending():
            prune_checkpoints(self.run.checkpoints, self.cfg.checkpoint.keep_last, protect=[self._last_good])

    def _set_aside_unconfirmed(self) -> str:
        """Training diverged: the unconfirmed checkpoint (whose state gave the non-finite step) is renamed
        out of the way, so resuming the run takes the last good one. Returns a sentence for the error."""
        wait_for_checkpoints()  # every rank is here (the loss is averaged): the unconfirmed one is sealed
        ck, self._unconfirmed = self._unconfirmed, None
        if ck is None or not _is_step_checkpoint(ck):
            return ""
        if self.dist.is_main and ck.exists():
            moved = set_aside_checkpoint(ck)
            return f"; {ck.name}, saved since the last finite step, was set aside as {moved.name}"
        return ""

    # -- evaluation -----------------------------------------------------------------------------------------

    def evaluate(
        self,
        step: int,
        max_batches: int | None = None,
        split: str = "eval",
        should_stop: Callable[[], bool] | None = None,
    ) -> EvalResult:
        """Evaluate every task on ``split``: "eval" (test) or "valid" (sharded over ranks, gathered on every
        rank); ``should_stop`` as in :func:`evaluate_model`."""
        default = self.cfg.train.eval_batches if split == "eval" else self.cfg.train.valid_batches
        n = default if max_batches is None else max_batches
        return evaluate_model(
            self.model,
            self.source,
            self.cfg,
            self.dist,
            self.autocast_dtype,
            step=step,
            max_batches=n,
            split=split,
            should_stop=should_stop,
        )

    def _validate(self, step: int) -> None:
        """Evaluate the validation split; save ``checkpoints/best`` if the selection NE is a new minimum."""
        ev = self.evaluate(step, split="valid")
        value = selection_value(ev, self.cfg.train.select_task)
        row = ev.as_flat_dict()
        row["select_ne"] = value
        self.logger.log(step, "valid", row)
        if math.isfinite(value) and (self.best is None or value < self.best[1]):
            self.best = (step, value)
            extra = self._extra(step)
            extra["selection"] = {
                "task": self.cfg.train.select_task,
                "value": value,
                "valid": {t: m.as_dict() for t, m in ev.tasks.items()},
            }
            save_best_checkpoint(
                self.run.checkpoints, step, self.model, self.optimizers, extra, background=True
            )

    def evaluate_best(self, should_stop: Callable[[], bool] | None = None) -> EvalResult | None:
        """The test split of the best-validation checkpoint, loaded from disk into a fresh model (None if
        there is none)."""
        found = best_checkpoint(self.run.checkpoints)
        if found is None:
            return None
        model = build_model(
            self.cfg.model, self.spec, self.device, self.cfg.run.seed, self.cfg.precision
        ).model
        state = load_checkpoint(found, model, None, restore_rng=False)
        n = self.cfg.train.eval_batches
        return evaluate_model(
            model,
            self.source,
            self.cfg,
            self.dist,
            self.autocast_dtype,
            step=int(state["step"]),
            max_batches=n,
            should_stop=should_stop,
        )

    # -- the loop -------------------------------------------------------------------------------------------

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train to ``train.steps`` (or stop and checkpoint after step ``stop_after``, for tests), checkpoint,
        and evaluate the final (and the best-validation) model on the test split.

        SIGTERM/SIGINT at any point of it (the final evaluation included) finishes the step, makes sure a
        checkpoint of it exists, prints how to resume and returns with status "interrupted"; a second signal
        raises :class:`StopNow` at once.
        """
        d = self.dist
        old_handlers = self._install_signals()
        final_eval: EvalResult | None = None
        best_eval: EvalResult | None = None
        where = ""
        try:
            step, status = self._train_loop(stop_after)
            self._save_unless_saved(step)
            wait_for_checkpoints()  # the final (and best) checkpoints in place before anything reads them
            if status == "completed" and self._should_stop():
                status = "interrupted"  # a signal during the last save
            if status == "completed":
                try:
                    final_eval, best_eval = self._final_evaluation(step)
                except EvaluationInterrupted:
                    status, where = "interrupted", " during the final evaluation"
            if status == "interrupted" and d.is_main:
                name = signal.Signals(self._stop_signal).name if self._stop_signal else "signal"
                then = " (it runs the final evaluation)" if where else ""
                print(
                    f"gem-train: {name} received{where}: stopped after step {step}; checkpoint "
                    f"{self.last_checkpoint} is complete\n"
                    f"  resume with: gem-train train --resume {self.last_checkpoint}{then}",
                    file=sys.stderr,
                )
        except BaseException:
            self.logger.close()  # keep what was logged readable (TensorBoard flushes on close)
            raise
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
        self.logger.close()
        best_ck = best_checkpoint(self.run.checkpoints) if self.best is not None else None
        return TrainResult(
            self.run.root,
            step,
            status,
            list(self.losses),
            final_eval,
            self.last_checkpoint,
            best_step=self.best[0] if self.best else None,
            best_valid_ne=self.best[1] if self.best else None,
            best_checkpoint=best_ck,
            best_eval=best_eval,
        )

    def _final_evaluation(self, step: int) -> tuple[EvalResult, EvalResult | None]:
        """The test split of the final model and of the best-validation checkpoint; eval.json and plots."""
        final_eval = self.evaluate(step, should_stop=self._should_stop)
        self.logger.log(step, "eval", final_eval.as_flat_dict())
        best_eval = None
        if self.best is not None:
            # The selected checkpoint, loaded back from disk (also when it is the last step: this checks that
            # checkpoints/best loads), on the test split.
            best_eval = self.evaluate_best(should_stop=self._should_stop)
            if best_eval is not None:
                row = best_eval.as_flat_dict()
                row["best_step"] = best_eval.step
                self.logger.log(step, "best_eval", row)
        if self.dist.is_main:
            self._write_final(final_eval, best_eval)
        return final_eval, best_eval

    def _train_loop(self, stop_after: int | None) -> tuple[int, str]:
        """Steps from ``start_step`` to ``train.steps``; returns the last step and the status."""
        cfg, d = self.cfg, self.dist
        total = cfg.train.steps
        step = self.start_step
        status = "completed"
        from tqdm.auto import tqdm

        bar = tqdm(
            total=total,
            initial=step,
            disable=not (d.is_main and cfg.train.progress_bar),
            dynamic_ncols=True,
            desc=cfg.run.name,
            file=sys.stderr,
        )
        loader = make_train_loader(
            self.source,
            cfg.data.batch_size,
            start=step,
            rank=d.rank,
            world_size=d.world_size,
            num_workers=cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        window = _Window(len(self.tasks), self.device)
        want_flops = self.built.flops is not None and self.device.type == "cuda"
        try:
            it = iter(loader)
            if self._should_stop():
                status = "interrupted"
            while status == "completed" and step < total:
                lb = next(it)
                if want_flops and self.built.flops is not None:  # (want_flops implies it)
                    window.flops += self.built.flops(lb.batch)  # host-side count, before the copy
                batch = lb.batch.to(self.device, non_blocking=True)
                if self.dense_opt is not None:
                    set_lr(self.dense_opt, cfg.optim.lr * lr_factor(step, total, cfg.optim.warmup_steps,
                                                                    cfg.optim.min_lr_ratio))  # fmt: skip
                with self._autocast():
                    logits = self.train_model(batch)
                loss = multitask_loss(logits, batch, self.tasks)
                # The backward is queued right behind the forward; the loss and the dense gradient norm are
                # then read together: one host sync per step, before the optimizer step that the NaN policy
                # may have to skip (a non-finite loss gives non-finite gradients, dropped below).
                loss.backward()
                loss_value, gnorm = self._step_values(loss.detach(), self._clip())
                step += 1
                if not (math.isfinite(loss_value) and math.isfinite(gnorm)):
                    what = (
                        f"loss {loss_value}" if not math.isfinite(loss_value) else f"dense grad norm {gnorm}"
                    )
                    self._handle_non_finite(step, what)  # raises, or skips this batch
                    for o in self.optimizers:
                        o.zero_grad(set_to_none=True)
                    bar.update(1)
                    continue
                self._confirm_checkpoint()  # this finite step was computed from the newest checkpoint's state
                for o in self.optimizers:
                    o.step()
                for o in self.optimizers:
                    o.zero_grad(set_to_none=True)
                self.losses.append(loss_value)
                window.add(logits, batch, self.tasks, loss_value)
                bar.update(1)

                if step % cfg.train.log_every == 0 or step == total:
                    self._log_train(step, window, bar)
                    window.reset()
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != total:
                    ev = self.evaluate(step)
                    self.logger.log(step, "eval", ev.as_flat_dict())
                if cfg.train.valid_every and (step % cfg.train.valid_every == 0 or step == total):
                    self._validate(step)
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != total:
                    self.save(step)
                if stop_after is not None and step >= stop_after:
                    status = "stopped"
                elif self._should_stop():
                    status = "interrupted"
        finally:
            bar.close()
        return step, status

    def _step_values(self, loss: Tensor, grad_norm: Tensor) -> tuple[float, float]:
        """``(loss, grad_norm)`` as floats in one device-to-host copy; the loss averaged over ranks.

        Every rank must agree on skipping/stopping: a NaN anywhere is a NaN everywhere. The gradient norm
        is the same on every rank after DDP's all-reduce, so averaging it changes nothing."""
        x = torch.stack([loss.float(), grad_norm.to(loss.device, torch.float32)])
        if self.dist.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            x = x / self.dist.world_size
        loss_value, norm = x.tolist()
        return loss_value, norm

    def _clip(self) -> Tensor:
        """Clip the dense gradients (``optim.grad_clip``; 0 = no clipping) and return their total norm."""
        params = [p for p in self.dense_params if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _handle_non_finite(self, step: int, what: str) -> None:
        if self.cfg.train.nan_policy == "skip":
            self.skipped += 1
            if self.dist.is_main:
                print(f"gem-train: non-finite {what} at step {step}: batch skipped", file=sys.stderr)
            if self.skipped <= self.cfg.train.max_skipped_batches:
                return
            why = (
                f"more than train.max_skipped_batches = {self.cfg.train.max_skipped_batches} batches skipped"
            )
        else:
            why = "training stopped (train.nan_policy = 'stop')"
        aside = self._set_aside_unconfirmed()
        ck = self._last_good
        keep = (
            f"the last good checkpoint is {ck} (resume with: gem-train train --resume {ck})"
            if ck
            else "no good checkpoint was written yet"
        )
        raise NonFiniteLossError(f"non-finite {what} at step {step}: {why}; {keep}{aside}")

    def _log_train(self, step: int, w: _Window, bar: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = max(time.perf_counter() - w.t0, 1e-9)
        ne = w.ne()
        ex_s = w.examples * self.dist.world_size / dt
        row = {
            "loss": w.loss_sum / max(w.steps, 1),
            "examples_per_s": ex_s,
            "step_time_s": dt / max(w.steps, 1),
            "lr": self.dense_opt.param_groups[0]["lr"] if self.dense_opt else 0.0,
        }
        for t, v in zip(self.tasks, ne):
            row[f"{t}/ne"] = v
        if w.flops and self.peak_flops:
            row["mfu"] = w.flops / dt / self.peak_flops
            row["model_tflops_per_s"] = w.flops / dt / 1e12
        if self.device.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.logger.log(step, "train", row)
        post = {"ex/s": f"{ex_s:,.0f}", "loss": f"{row['loss']:.4f}", f"NE[{self.tasks[0]}]": f"{ne[0]:.4f}"}
        if "mfu" in row:
            post["MFU"] = f"{100 * row['mfu']:.1f}%"
        bar.set_postfix(post, refresh=False)

    def _write_final(self, ev: EvalResult, best: EvalResult | None = None) -> None:
        summary: dict[str, Any] = {
            "step": ev.step,
            "tasks": {t: m.as_dict() for t, m in ev.tasks.items()},
            "ground_truth_ne": ev.ground_truth_ne,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }
        if best is not None and self.best is not None:
            found = best_checkpoint(self.run.checkpoints)
            sel = read_trainer_state(found).get("selection", {}) if found else {}
            summary["best"] = {
                "step": best.step,
                "select_task": self.cfg.train.select_task,
                "valid_ne": self.best[1],
                "valid": sel.get("valid"),
                "tasks": {t: m.as_dict() for t, m in best.tasks.items()},  # the test split
                "ground_truth_ne": best.ground_truth_ne,
                "checkpoint": str(found) if found else None,
            }
        if getattr(self.source, "bad_rows", None):  # data.on_bad_row = "skip": what this rank left out
            summary["skipped_bad_rows"] = dict(self.source.bad_rows)  # type: ignore[attr-defined]
        self.run.eval_summary.write_text(json.dumps(summary, indent=2), encoding="utf-8")
        rows = read_metrics(self.run.metrics)
        plot_curves(rows, self.run.plots, self.tasks)
        plot_reliability(ev.predictions, self.run.plots / "reliability.png")
