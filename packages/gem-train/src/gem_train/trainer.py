"""The training loop: one process or many (``torchrun``), CPU or GPU, resumable to the exact loss.

One :class:`Trainer` owns a run: what :func:`gem_train.run.build_run` made (data, model, optimizers), the
run directory, logging, evaluation and checkpoints. ``fit()`` trains ``train.steps`` steps (from the
checkpoint's step when resuming), evaluates the test split every ``train.eval_every`` steps and at the end,
checkpoints every ``checkpoint.every`` steps, at the end and on SIGTERM/Ctrl-C, and writes plots and
``eval.json`` into the run directory. Model selection on the validation split: :mod:`gem_train.selection`.

Exact resume: a batch is a pure function of its index, the stream's position is the step, the learning rate
is a function of the step, and model, optimizer and RNG states are restored; DataLoaders get their own
``torch.Generator`` so building one never moves the global RNG. So a run stopped at step N and resumed
computes the same losses, bit for bit on the CPU, as one that never stopped.
"""

from __future__ import annotations

import datetime as _dt
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from gem_train.checkpoint import best_checkpoint, load_checkpoint, wait_for_checkpoints
from gem_train.checkpoint_keeper import (
    CheckpointKeeper,
    data_position,
    data_stream_state,
    reshard_note,
)
from gem_train.config import TrainConfig, config_to_dict, dumps_toml
from gem_train.data.balance import BalancedTrainStream
from gem_train.data.balance_state import BalancerPosition
from gem_train.data.global_balance import GlobalBalancedStream
from gem_train.data.loader import make_train_loader
from gem_train.data.split import HeldOutSplit
from gem_train.distributed import all_gather_object, peak_memory_gib
from gem_train.evaluation import EvalResult, EvaluationInterrupted, evaluate_model
from gem_train.logger import MetricsLogger, truncate_metrics
from gem_train.prefetch import DevicePrefetcher
from gem_train.report import write_final
from gem_train.run import Run, build_run
from gem_train.run_dir import RunDir, create_run_dir, resolve_resume
from gem_train.selection import BestSelection
from gem_train.signals import StopNow, StopSignals
from gem_train.train_log import TrainWindow

__all__ = ["NonFiniteLossError", "StopNow", "TrainResult", "Trainer"]

HOST_AHEAD = 2  # training batches a host thread holds ready on CUDA (received from the workers, pinned)


class NonFiniteLossError(RuntimeError):
    """The loss (or the dense gradient norm) became NaN/Inf; the message names the step."""


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
    """A training run of ``cfg``; ``resume``: a checkpoint, a run directory or "latest" to continue from."""

    def __init__(self, cfg: TrainConfig, resume: str | Path | None = None) -> None:
        self.cfg = cfg
        resume = resume or cfg.checkpoint.resume_from or None
        resume_from = resolve_resume(resume, cfg.run.name, cfg.run.out_dir) if resume else None
        self.setup: Run = build_run(cfg)  # everything that can reject the config, before the run dir
        self.dist, self.device, self.tasks = self.setup.dist, self.setup.device, self.setup.tasks

        # The run directory: rank 0 creates it (or reuses the resumed run's), everyone learns the path.
        root: list[str | None] = [str(resume_from.parent.parent)] if resume_from else [None]
        if self.dist.is_main and root[0] is None:
            root[0] = str(create_run_dir(cfg.run.out_dir, cfg.run.name).root)
        if self.dist.world_size > 1:
            dist.broadcast_object_list(root, src=0)
        assert root[0] is not None  # set on rank 0, then broadcast
        self.run = RunDir(Path(root[0]))
        if self.dist.is_main:
            self.run.make()
            self.run.config.write_text(dumps_toml(config_to_dict(cfg)), encoding="utf-8")
        self.logger = MetricsLogger(self.run.metrics, self.run.tensorboard, enabled=self.dist.is_main)

        self.start_step = 0
        self.skipped = 0
        # The data stream's position: global batches consumed before start_step (by any number of ranks).
        self.data_offset = 0
        self.balancer = BalancerPosition()  # parallel.balancer = "base_batch_shuffling"
        resharded = False
        if resume_from is not None:
            sparse = self.setup.layout.sparse
            state = load_checkpoint(resume_from, self.model, self.optimizers, reshard=True, sparse=sparse)
            if hasattr(self.setup.source, "check_resume"):  # a streamed position needs the same layout
                self.setup.source.check_resume(state, self.dist.world_size, cfg.data.num_workers)
            self.start_step = int(state["step"])
            self.skipped = int(state.get("skipped_batches", 0))
            self.data_offset = data_position(state)
            resharded = bool(state["resharded"])
            self._resume_balancer(state)
            if self.dist.is_main:
                truncate_metrics(self.run.metrics, self.start_step)
            if resharded and self.dist.is_main:
                # With the balancer the plain stream restarts at its base (its carry was said above).
                where = self.balancer.base if self.balancer.base is not None else self.data_offset
                print(f"gem-train: {reshard_note(state, self.dist.world_size, where)}", file=sys.stderr)
        resumed_step = self.start_step if resume_from is not None else None
        self.selection = BestSelection(self.setup, self.run.checkpoints, resumed_step)
        # Dropout etc. differ per rank (the same seed would correlate them across ranks).
        if resume_from is None or resharded:
            torch.manual_seed(cfg.run.seed + 1_000_003 * (self.dist.rank + 1) + 7_919 * self.start_step)
        self.losses: list[float] = []
        self.early_stopped = False
        self.signals = StopSignals()
        self.checkpoints = CheckpointKeeper(
            self.run.checkpoints, cfg.checkpoint.keep_last, self.dist, resume_from, self.start_step
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.setup.model

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.setup.optimizers

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

    def _resume_balancer(self, state: dict[str, Any]) -> None:
        saved = state.get("balancer")
        if self.cfg.parallel.balancer != "base_batch_shuffling" or not saved:
            return  # a checkpoint without a balancer state starts a fresh balanced stream at its position
        d = self.dist
        note = self.balancer.resume(saved, d.rank, d.world_size, self.cfg.data.batch_size)
        if note and d.is_main:
            print(f"gem-train: {note}", file=sys.stderr)

    def _balancer_extra(self) -> dict[str, Any]:
        if self.cfg.parallel.balancer != "base_batch_shuffling":
            return {}
        ranks = all_gather_object(self.balancer.state, self.dist.world_size)  # every rank calls _extra
        saved = self.balancer.saved(ranks, self.dist.world_size, self.cfg.data.batch_size, self.data_offset)
        return {"balancer": saved}

    def global_batches(self, step: int) -> int:
        """Global batches of the training stream consumed after ``step`` steps."""
        return self.data_offset + (step - self.start_step) * self.dist.world_size

    def _extra(self, step: int) -> dict[str, Any]:
        return {
            "config": config_to_dict(self.cfg),
            "data_position": self.global_batches(step),
            "data_position_unit": "global_batches",
            "skipped_batches": self.skipped,
            "saved_at": _dt.datetime.now(_dt.UTC).isoformat(),
            **data_stream_state(self.setup.source, self.dist.world_size, self.cfg.data.num_workers),
            **self._balancer_extra(),
        }

    def save(self, step: int) -> Path:
        """Checkpoint the current state as ``step`` (all ranks call); see :class:`CheckpointKeeper`."""
        return self.checkpoints.save(
            step, self.model, self.optimizers, self._extra(step), self.setup.layout.sparse
        )

    def evaluate(
        self,
        step: int,
        max_batches: int | None = None,
        split: HeldOutSplit = "test",
        should_stop: Callable[[], bool] | None = None,
    ) -> EvalResult:
        """Evaluate every task on ``split`` ("test" or "valid"; sharded over ranks, gathered on every
        rank); ``should_stop`` as in :func:`gem_train.evaluation.evaluate_model`."""
        default = self.cfg.train.eval_batches if split == "test" else self.cfg.train.valid_batches
        n = default if max_batches is None else max_batches
        r = self.setup
        return evaluate_model(
            r.model, r.source, self.cfg, r.dist, r.autocast_dtype, step, n, split, should_stop
        )

    def evaluate_best(self, should_stop: Callable[[], bool] | None = None) -> EvalResult | None:
        """The test split of the best-validation checkpoint, loaded from disk (None if there is none)."""
        return self.selection.evaluate_best(should_stop, self.run.checkpoints)

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
        finally:
            self.logger.close()  # keep what was logged readable (TensorBoard flushes on close)
        best = self.selection.best
        return TrainResult(
            self.run.root,
            step,
            status,
            list(self.losses),
            final_eval,
            self.last_checkpoint,
            best_step=best[0] if best else None,
            best_valid_ne=best[1] if best else None,
            best_checkpoint=best_checkpoint(self.run.checkpoints) if best else None,
            best_eval=best_eval,
            early_stopped=self.early_stopped,
        )

    def _final_evaluation(self, step: int) -> tuple[EvalResult, EvalResult | None]:
        """The test split of the final model and of the best-validation checkpoint; eval.json and plots."""
        final_eval = self.evaluate(step, should_stop=self._should_stop)
        self.logger.log(step, "test", final_eval.as_flat_dict())
        best_eval = None
        if self.selection.best is not None:
            # The selected checkpoint, loaded back from disk (also when it is the last step: this checks
            # that checkpoints/best loads), on the test split.
            best_eval = self.evaluate_best(should_stop=self._should_stop)
            if best_eval is not None:
                row = best_eval.as_flat_dict()
                row["best_step"] = best_eval.step
                self.logger.log(step, "best_test", row)
        if self.dist.is_main:
            best = self.selection.best
            write_final(
                self.run, self.tasks, final_eval, self.last_checkpoint, self.cfg.train.select_task,
                best_eval, best[1] if best else None,
                early_stop=self._early_stop_summary(step),
            )  # fmt: skip
        return final_eval, best_eval

    def _early_stop_summary(self, step: int) -> dict[str, Any] | None:
        t = self.cfg.train
        if not t.early_stop_patience:
            return None
        best = self.selection.best
        return {
            "patience": t.early_stop_patience,
            "stopped": self.early_stopped,
            "step": step,
            "max_steps": t.steps,
            "best_step": best[0] if best else None,
        }

    def _train_loop(self, stop_after: int | None) -> tuple[int, str]:
        """Steps from ``start_step`` to ``train.steps``; returns the last step and the status."""
        cfg, d, r = self.cfg, self.dist, self.setup
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
        loader = self._train_stream(step)
        window = TrainWindow(self.tasks, self.device)
        cuda = self.device.type == "cuda"
        count_flops = r.built.flops if cuda else None
        # Batches pinned by the loader, copied one step ahead on a side stream (gem_train.prefetch). On
        # CUDA a host thread also receives them from the loader's workers (tens of ms per base-h200 batch)
        # and counts their FLOPs while the GPU runs the current step: each step ends with a host sync, so
        # host work between two steps is GPU idle time.
        counted = ((lb, count_flops(lb.batch) if count_flops else 0) for lb in loader)
        it = DevicePrefetcher(
            counted, self.device, select=lambda item: item[0].batch, host_ahead=HOST_AHEAD if cuda else 0
        )
        try:
            if self._should_stop():
                status = "interrupted"
            while status == "completed" and step < total:
                (lb, flops), batch = next(it)  # lb.batch on the host, batch on the device
                if isinstance(loader, BalancedTrainStream):  # its state as of this batch, for checkpoints
                    self.balancer.state = loader.state_after(lb.index)
                window.flops += flops
                out = r.train_step(batch, step)
                step += 1
                bar.update(1)
                if not out.finite:
                    bad_loss = not math.isfinite(out.loss)
                    what = f"loss {out.loss}" if bad_loss else f"dense grad norm {out.grad_norm}"
                    self._handle_non_finite(step, what)  # raises, or skips this batch
                    continue
                self.checkpoints.confirm()  # this finite step was computed from the newest checkpoint
                self.losses.append(out.loss)
                window.add(out.per_task, batch, out.loss)

                if step % cfg.train.log_every == 0 or step == total:
                    self._log_train(step, window, bar)
                    window.reset()
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != total:
                    self.logger.log(step, "test", self.evaluate(step).as_flat_dict())
                if cfg.train.valid_every and (step % cfg.train.valid_every == 0 or step == total):
                    self.selection.validate(step, self.logger, self._extra(step))
                    if step != total and self.selection.should_stop_early():
                        self._note_early_stop(step)
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

    def _note_early_stop(self, step: int) -> None:
        self.early_stopped = True
        best = self.selection.best
        msg = (
            f"early stop at step {step} of {self.cfg.train.steps}: validation NE "
            f"[{self.cfg.train.select_task}] has not improved for {self.selection.since_best} evaluations "
            f"(train.early_stop_patience = {self.cfg.train.early_stop_patience}); best step "
            f"{best[0] if best else None}, NE {best[1] if best else float('nan'):.4f}"
        )
        row = {"best_step": float(best[0] if best else -1), "since_best": float(self.selection.since_best)}
        self.logger.log(step, "early_stop", row)
        if self.dist.is_main:
            print(f"gem-train: {msg}", file=sys.stderr)

    def _train_stream(self, step: int) -> Any:
        """This rank's training batches from ``step`` on: the loader, or its balanced batches."""
        cfg, d = self.cfg, self.dist
        pin = self.device.type == "cuda"
        if cfg.parallel.balancer != "base_batch_shuffling":
            global_ = cfg.parallel.balancer == "global" and d.world_size > 1
            loader = make_train_loader(
                self.setup.source, cfg.data.batch_size, position=self.global_batches(step), rank=d.rank,
                world_size=d.world_size, num_workers=cfg.data.num_workers, pin_memory=pin and not global_,
            )  # fmt: skip
            # "global": the same stream, each step's samples rebalanced across the ranks (no state).
            return GlobalBalancedStream(loader, pin=pin) if global_ else loader
        return self.balancer.stream(
            self.setup.source, rank=d.rank, world=d.world_size, batch_size=cfg.data.batch_size,
            seed=cfg.run.seed, base=self.global_batches(step), num_workers=cfg.data.num_workers, pin=pin,
        )  # fmt: skip

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
        aside = self.checkpoints.set_aside_unconfirmed()
        ck = self.checkpoints.last_good
        keep = (
            f"the last good checkpoint is {ck} (resume with: gem-train train --resume {ck})"
            if ck
            else "no good checkpoint was written yet"
        )
        raise NonFiniteLossError(f"non-finite {what} at step {step}: {why}; {keep}{aside}")

    def _log_train(self, step: int, w: TrainWindow, bar: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        opt = self.setup.dense_opt
        row = w.row(self.dist.world_size, opt.param_groups[0]["lr"] if opt else 0.0, self.setup.peak_flops)
        for r, gib in enumerate(all_gather_object(peak_memory_gib(self.device), self.dist.world_size)):
            row[f"memory_gib/rank{r}"] = gib  # peak allocated (GPU) or peak RSS (CPU) of each rank
        self.logger.log(step, "train", row)
        post = {"ex/s": f"{row['examples_per_s']:,.0f}", "loss": f"{row['loss']:.4f}",
                f"NE[{self.tasks[0]}]": f"{row[f'{self.tasks[0]}/ne']:.4f}"}  # fmt: skip
        if "mfu" in row:
            post["MFU"] = f"{100 * row['mfu']:.1f}%"
        bar.set_postfix(post, refresh=False)
