"""The training loop: one process or many (``torchrun``), CPU or GPU, resumable to the exact loss.

One :class:`Trainer` owns a run: what :func:`gem_train.loop.build.build_run` made (data, model, optimizers),
the run directory, logging, evaluation and checkpoints. ``fit()`` trains ``train.steps`` steps (from the
checkpoint's step when resuming), evaluates the test split every ``train.eval_every`` steps and at the end,
checkpoints every ``checkpoint.every`` steps, at the end and on SIGTERM/Ctrl-C, and writes plots and
``eval.json`` into the run directory. Model selection on the validation split:
:mod:`gem_train.evaluation.selection`.

Exact resume: a batch is a pure function of its index, the stream's position is the step, the learning rate
is a function of the step, and model, optimizer and RNG states are restored; DataLoaders get their own
``torch.Generator`` so building one never moves the global RNG. So a run stopped at step N and resumed
computes the same losses, bit for bit on the CPU, as one that never stopped.
"""

from __future__ import annotations

import datetime as _dt
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gem_model import GemBatch
from gem_train.checkpoint import (
    best_checkpoint,
    load_checkpoint,
    read_trainer_state,
    wait_for_checkpoints,
)
from gem_train.checkpoint.keeper import (
    CheckpointKeeper,
    data_position,
    data_stream_state,
    reshard_note,
)
from gem_train.config import ConfigError, TrainConfig, config_to_dict
from gem_train.data.balance import BalancedTrainStream
from gem_train.data.balance_state import BalancerPosition, balancer_extra, resume_balancer
from gem_train.data.identity import data_identity
from gem_train.data.split import HeldOutSplit
from gem_train.data.train_stream import train_stream
from gem_train.evaluation.evaluate import EvalResult, EvaluationInterrupted, evaluate_model
from gem_train.evaluation.health import TrainingHealth, start_checks
from gem_train.evaluation.report import final_evaluation
from gem_train.evaluation.selection import BestSelection
from gem_train.loop.build import build_run
from gem_train.loop.metrics_log import MetricsLogger, read_metrics, truncate_metrics
from gem_train.loop.non_finite import NonFiniteLossError, handle_non_finite, step_is_boundary
from gem_train.loop.prefetch import DevicePrefetcher
from gem_train.loop.resume_check import (
    ResumePlan,
    check_resume,
    optimizer_settings,
    restore_optimizer_settings,
)
from gem_train.loop.run_dir import discard_if_unused, pick_latest, resolve_resume, shared_run_dir
from gem_train.loop.run_history import record_resume, record_start
from gem_train.loop.signals import StopNow, StopSignals
from gem_train.loop.step import BuiltRun, StepPipeline, StepResult
from gem_train.loop.train_log import TrainWindow, log_train

__all__ = ["NonFiniteLossError", "StopNow", "TrainResult", "Trainer"]

HOST_AHEAD = 2  # training batches a host thread holds ready on CUDA (received from the workers, pinned)


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
    early_stopped: bool = False  # train.early_stop_patience ended the run before train.steps


class Trainer:
    """A training run of ``cfg``; ``resume``: a checkpoint, a run directory or "latest" to continue from;
    ``allow_changes``: the settings (dotted keys or prefixes) a resume may change although they change the
    run's meaning (:mod:`gem_train.loop.resume_check`; anything else that differs is refused)."""

    def __init__(
        self, cfg: TrainConfig, resume: str | Path | None = None, allow_changes: Sequence[str] = ()
    ) -> None:
        self.cfg = cfg
        resume = resume or cfg.checkpoint.resume_from or None
        if allow_changes and not resume:
            raise ConfigError("--allow-change names what a resume may change: it needs --resume")
        resume_from, notes = None, []
        if resume and str(resume) == "latest":
            resume_from, note = pick_latest(cfg.run.name, cfg.run.out_dir)
            notes.append(note)
        elif resume:
            resume_from = resolve_resume(resume, cfg.run.name, cfg.run.out_dir)
        saved = read_trainer_state(resume_from) if resume_from is not None else None
        self.built_run: BuiltRun = build_run(cfg)  # everything that can reject the config, before the run dir
        self.dist, self.device, self.tasks = self.built_run.dist, self.built_run.device, self.built_run.tasks
        self.data_identity = data_identity(self.built_run.source)  # in every checkpoint
        plan: ResumePlan | None = None
        if saved is not None and resume_from is not None:  # refused here, before anything is written
            plan = check_resume(saved, cfg, self.data_identity, allow_changes, resume_from, notes)
            if hasattr(self.built_run.source, "check_resume"):  # a streamed position needs the same layout
                self.built_run.source.check_resume(
                    saved, self.dist.world_size, cfg.data.num_workers, plan.new_train_data
                )
        # The dense features' scale and the table's size, from the first training batches (and, with
        # data.normalize_dense, the model's standardisation); a bad row here fails before the run dir exists.
        start_notes = start_checks(self.built_run, fresh=resume_from is None)

        # The run directory: rank 0 creates it (or reuses the resumed run's), everyone learns the path.
        self.run_dir = shared_run_dir(cfg, resume_from, self.dist)
        self.created_run_dir = resume_from is None  # a failed start removes it again (never a resumed one's)
        self.logger = MetricsLogger(self.run_dir.metrics, self.run_dir.tensorboard, enabled=self.dist.is_main)
        schedule = self.built_run.schedule
        assert schedule is not None  # build_run resolves it
        self.schedule = schedule
        self.health = TrainingHealth(schedule, cfg.train.select_task, self.logger, self.dist.is_main)

        self.start_step = 0
        self.skipped = 0
        # The data stream's position: global batches consumed before start_step (by any number of ranks).
        self.data_offset = 0
        # parallel.balancer = "base_batch_shuffling"
        self.balancer = BalancerPosition(calibration_samples=cfg.parallel.balancer_calibration)
        resharded = False
        if resume_from is not None:
            sparse = self.built_run.sparse
            opts = self.optimizers + ([sparse.fused_optimizer] if sparse is not None else [])
            fresh = optimizer_settings(opts)  # the config's (the load restores the checkpoint's)
            state = load_checkpoint(resume_from, self.model, self.optimizers, reshard=True, sparse=sparse)
            if plan is not None and plan.changes_optimizer:  # --allow-change optim...: the new ones apply
                restore_optimizer_settings(opts, fresh)
            self.start_step = int(state["step"])
            self.skipped = int(state.get("skipped_batches", 0))
            self.data_offset = data_position(state)
            resharded = bool(state["resharded"])
            resume_balancer(self.balancer, state, cfg, self.dist)
            if self.dist.is_main:
                assert plan is not None  # made above for every resume
                print(plan.message(), file=sys.stderr)  # also without a progress bar
                record_resume(self.run_dir.root, plan, cfg, self.data_identity, state.get("data_identity"),
                              self.dist.world_size)  # fmt: skip
                truncate_metrics(self.run_dir.metrics, self.start_step)
                self.health.replay(read_metrics(self.run_dir.metrics))
            if resharded and self.dist.is_main:
                # With the balancer the plain stream restarts at its base (its carry was said above).
                where = self.balancer.base if self.balancer.base is not None else self.data_offset
                print(f"gem-train: {reshard_note(state, self.dist.world_size, where)}", file=sys.stderr)
        elif self.dist.is_main:
            record_start(self.run_dir.root, cfg, self.data_identity, self.dist.world_size)
        resumed_step = self.start_step if resume_from is not None else None
        if self.dist.is_main:  # how long, on what, validated how (gem_train.loop.schedule)
            print(f"gem-train: {schedule.describe()}", file=sys.stderr)
            print(f"gem-train: {schedule.valid_note}; {schedule.describe_validation()}", file=sys.stderr)
            if not schedule.validates:
                print(
                    "gem-train: warning: no validation split: no model selection happens, no "
                    "checkpoints/best is written and early stopping is off; the final model is evaluated",
                    file=sys.stderr,
                )
        self.health.before_training(start_notes, resumed=resume_from is not None)
        self.selection = BestSelection(self.built_run, self.run_dir.checkpoints, resumed_step)
        # Dropout etc. differ per rank (the same seed would correlate them across ranks).
        if resume_from is None or resharded:
            torch.manual_seed(cfg.run.seed + 1_000_003 * (self.dist.rank + 1) + 7_919 * self.start_step)
        self.losses: list[float] = []
        self.early_stopped = False
        self.signals = StopSignals()
        self.checkpoints = CheckpointKeeper(
            self.run_dir.checkpoints, cfg.checkpoint.keep_last, self.dist, resume_from, self.start_step
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.built_run.model

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.built_run.optimizers

    @property
    def best(self) -> tuple[int, float] | None:
        """``(step, validation value)`` of the best-validation checkpoint so far, or None."""
        return self.selection.best

    @property
    def last_checkpoint(self) -> Path | None:
        return self.checkpoints.last

    def _should_stop(self) -> bool:
        return self.signals.should_stop(self.dist)

    # -- checkpoints and evaluation -------------------------------------------------------------------------

    def global_batches(self, step: int) -> int:
        """Global batches of the training stream consumed after ``step`` steps."""
        return self.data_offset + (step - self.start_step) * self.dist.world_size

    def _extra(self, step: int) -> dict[str, Any]:
        return {
            "config": config_to_dict(self.cfg),
            "data_identity": self.data_identity,
            "data_position": self.global_batches(step),
            "data_position_unit": "global_batches",
            "skipped_batches": self.skipped,
            "saved_at": _dt.datetime.now(_dt.UTC).isoformat(),
            **data_stream_state(self.built_run.source, self.dist.world_size, self.cfg.data.num_workers),
            **balancer_extra(self.balancer, self.cfg, self.dist, self.data_offset),
        }

    def save(self, step: int) -> Path:
        """Checkpoint the current state as ``step`` (all ranks call); see :class:`CheckpointKeeper`."""
        return self.checkpoints.save(
            step, self.model, self.optimizers, self._extra(step), self.built_run.sparse
        )

    def evaluate(
        self,
        step: int,
        max_batches: int | None = None,
        split: HeldOutSplit = "test",
        should_stop: Callable[[], bool] | None = None,
    ) -> EvalResult:
        """Evaluate every task on ``split`` ("test" or "valid"; sharded over ranks, gathered on every
        rank); ``should_stop`` as in :func:`gem_train.evaluation.evaluate.evaluate_model`."""
        default = self.cfg.train.eval_batches if split == "test" else self.cfg.train.valid_batches
        n = default if max_batches is None else max_batches
        r = self.built_run
        return evaluate_model(
            r.model, r.source, self.cfg, r.dist, r.autocast_dtype, step, n, split, should_stop
        )

    def evaluate_best(self, should_stop: Callable[[], bool] | None = None) -> EvalResult | None:
        """The test split of the best-validation checkpoint, loaded from disk (None if there is none)."""
        return self.selection.evaluate_best(should_stop, self.run_dir.checkpoints)

    # -- the loop -------------------------------------------------------------------------------------------

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train to ``train.steps`` (or stop and checkpoint after step ``stop_after``, for tests), checkpoint,
        and evaluate the final (and the best-validation) model on the test split.

        SIGTERM/SIGINT at any point of it (the final evaluation included) finishes the step, makes sure a
        checkpoint of it exists, prints how to resume and returns with status "interrupted"; a second signal
        raises :class:`StopNow` at once.
        """
        final_eval: EvalResult | None = None
        best_eval: EvalResult | None = None
        where = ""
        failed = True
        try:
            with self.signals.installed():
                step, status = self._train_loop(stop_after)
                if self.checkpoints.saved_step != step:  # not already saved (periodic, or resumed here)
                    self.save(step)
                wait_for_checkpoints()  # the final (and best) checkpoints in place before anything reads
                if status == "completed" and self._should_stop():
                    status = "interrupted"  # a signal during the last save
                if status == "completed":
                    try:
                        final_eval, best_eval = self._final_evaluation(step)
                    except EvaluationInterrupted:
                        status, where = "interrupted", " during the final evaluation"
            if status == "interrupted" and self.dist.is_main:
                then = " (it runs the final evaluation)" if where else ""
                print(
                    f"gem-train: {self.signals.name()} received{where}: stopped after step {step}; "
                    f"checkpoint {self.last_checkpoint} is complete\n"
                    f"  resume with: gem-train train --resume {self.last_checkpoint}{then}",
                    file=sys.stderr,
                )
            failed = False
        finally:
            self.logger.close()  # keep what was logged readable (TensorBoard flushes on close)
            if failed:
                self._discard_if_unused()
        best = self.selection.best
        return TrainResult(
            self.run_dir.root,
            step,
            status,
            list(self.losses),
            final_eval,
            self.last_checkpoint,
            best_step=best[0] if best else None,
            best_valid_ne=best[1] if best else None,
            best_checkpoint=best_checkpoint(self.run_dir.checkpoints) if best else None,
            best_eval=best_eval,
            early_stopped=self.early_stopped,
        )

    def _discard_if_unused(self) -> None:
        """After a failure: rank 0 removes the run directory this run created if nothing was written to it
        yet (a bad row at step 0, say), so a failed start leaves no empty run behind."""
        if self.created_run_dir and self.dist.is_main and discard_if_unused(self.run_dir):
            print(
                f"gem-train: removed the run directory {self.run_dir.root}: the run failed before writing "
                "anything",
                file=sys.stderr,
            )

    def _final_evaluation(self, step: int) -> tuple[EvalResult, EvalResult | None]:
        """The test split of the final model and of the best-validation checkpoint; eval.json (with the
        schedule and the health warnings) and plots."""
        self.health.at_end(step, self.early_stopped)
        return final_evaluation(
            step,
            lambda: self.evaluate(step, should_stop=self._should_stop),
            lambda: self.evaluate_best(should_stop=self._should_stop),
            self.selection, self.logger, self.run_dir, self.tasks, self.last_checkpoint,
            self.cfg.train.select_task, self.selection.early_stop_summary(self.early_stopped, step),
            self.dist.is_main,
            extra={"schedule": self.schedule.as_dict(), "health": [n.as_dict() for n in self.health.notes]},
        )  # fmt: skip

    def _account(self, step: int, out: StepResult, batch: GemBatch, window: TrainWindow) -> bool:
        """Book (1-based) ``step``'s result: False if it was non-finite (skipped, or raises by the NaN
        policy), else confirm the newest checkpoint and add the step to the loss list and the log window."""
        if not out.finite:  # raises, or skips this batch (and counts it)
            self.skipped = handle_non_finite(
                step,
                out.loss,
                out.grad_norm,
                self.skipped,
                self.cfg.train,
                self.checkpoints,
                self.dist.is_main,
            )
            return False
        self.checkpoints.confirm()  # this finite step was computed from the newest checkpoint
        self.losses.append(out.loss)
        window.add(out.per_task, batch, out.loss)
        return True

    def _train_loop(self, stop_after: int | None) -> tuple[int, str]:
        """Steps from ``start_step`` to ``train.steps``; returns the last step and the status."""
        d, r = self.dist, self.built_run
        cfg = r.cfg  # the resolved schedule: train.steps from train.epochs, valid_every a number
        total = cfg.train.steps
        step = self.start_step
        status = "completed"
        bar = tqdm(
            total=total,
            initial=step,
            disable=not (d.is_main and cfg.train.progress_bar),
            dynamic_ncols=True,
            desc=cfg.run.name,
            file=sys.stderr,
        )
        cuda = self.device.type == "cuda"
        loader = train_stream(cfg, r.source, d, cuda, self.balancer, self.global_batches(step))
        window = TrainWindow(self.tasks, self.device)
        count_flops = r.built.flops if cuda else None
        # Batches pinned by the loader, copied one step ahead on a side stream (gem_train.loop.prefetch). On
        # CUDA a host thread also receives them from the loader's workers (tens of ms per base-h200 batch)
        # and counts their FLOPs while the GPU runs the current step (a step whose loss is read at once
        # ends with a host sync: host work after it is GPU idle time).
        counted = ((lb, count_flops(lb.batch) if count_flops else 0) for lb in loader)
        it = DevicePrefetcher(
            counted, self.device, select=lambda item: item[0].batch, host_ahead=HOST_AHEAD if cuda else 0
        )
        # With optimizers that skip non-finite steps on the device (fused AdamW: CUDA's default), a step
        # that no log, evaluation, checkpoint or stop follows is left unread (StepPipeline): its loss is read
        # after the next step is queued, so the GPU never idles on the host between two steps.
        pipeline = StepPipeline(r, cfg.train.overlap_steps)
        try:
            if self._should_stop():
                status = "interrupted"
            while status == "completed" and step < total:
                (lb, flops), batch = next(it)  # lb.batch on the host, batch on the device
                if isinstance(loader, BalancedTrainStream):  # its state as of this batch, for checkpoints
                    self.balancer.state = loader.state_after(lb.index)
                window.flops += flops
                read = (
                    not pipeline.overlap
                    or step_is_boundary(cfg.train, cfg.checkpoint.every, step + 1, stop_after)
                    or self._should_stop()
                )
                done = pipeline.push(batch, step, read=read, tag=batch)
                step += 1
                bar.update(1)
                finite = [self._account(s.number, s.result, s.tag, window) for s in done]
                if not read or not finite[-1]:  # left unread, or non-finite (skipped)
                    continue

                if step % cfg.train.log_every == 0 or step == total:
                    self.health.on_train(log_train(step, window, bar, self.logger, r))
                    window.reset()
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != total:
                    self.logger.log(step, "test", self.evaluate(step).as_flat_dict())
                every = self.schedule.valid_every  # 0: no validation split; total: only at the end
                if every and (step % every == 0 or step == total):
                    value = self.selection.validate(step, self.logger, self._extra(step))
                    stop = step != total and self.selection.should_stop_early()
                    self.health.on_validation(step, value, self.selection.since_best, stop)
                    if stop:
                        self.early_stopped = True
                        self.selection.note_early_stop(step, self.logger, d.is_main)
                        break  # status stays "completed": the final evaluation runs at this step
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != total:
                    self.save(step)
                if stop_after is not None and step >= stop_after:
                    status = "stopped"
                elif self._should_stop():
                    status = "interrupted"
        finally:
            it.close()
            bar.close()
        return step, status
