"""Model selection on the validation split: the best checkpoint so far, ``checkpoints/best``.

With ``train.valid_every > 0`` the trainer evaluates the validation split every ``valid_every`` steps (and
at the last step); :class:`BestSelection` keeps the checkpoint of the lowest validation NE of
``train.select_task`` (or of the mean over tasks, ``"mean"``) in ``checkpoints/best`` (ties keep the earlier
step), and at the end that checkpoint, loaded back from disk, is evaluated on the test split. The test split
never takes part in the choice.

Early stopping (``train.early_stop_patience = P > 0``): :attr:`BestSelection.since_best` counts the
validation evaluations since the best one; once it reaches ``P`` the trainer ends the run there (see
:meth:`BestSelection.should_stop_early`), so a run ends at most ``P * valid_every`` steps after its best
checkpoint.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gem_train.checkpoint import best_checkpoint, load_checkpoint, read_trainer_state, save_best_checkpoint
from gem_train.evaluation.evaluate import EvalResult, evaluate_model, selection_value
from gem_train.loop.build import build_model_for
from gem_train.loop.metrics_log import MetricsLogger
from gem_train.loop.schedule import resolved_valid_every

if TYPE_CHECKING:
    from gem_train.loop.step import BuiltRun

__all__ = ["BestSelection"]


class BestSelection:
    """The best-validation checkpoint of a run: ``best`` is ``(step, selection value)`` or None.

    On resume, a best checkpoint written after the resumed step belongs to a future this run recomputes
    (exactly, on the CPU), so it is dropped.
    """

    def __init__(self, run: BuiltRun, checkpoints: Path, resumed_step: int | None) -> None:
        self.run = run
        self.checkpoints = checkpoints
        self.best: tuple[int, float] | None = None
        self.since_best = 0  # validation evaluations since the best one (early stopping)
        if not run.cfg.train.valid_every:
            return
        found = best_checkpoint(checkpoints)
        if found is None:
            return
        st = read_trainer_state(found)
        sel = st.get("selection", {})
        if resumed_step is not None and int(st["step"]) <= resumed_step and "value" in sel:
            self.best = (int(st["step"]), float(sel["value"]))
            # Validations ran at multiples of valid_every: those after the best one, up to the resumed step.
            self.since_best = (resumed_step - self.best[0]) // resolved_valid_every(run.cfg.train)
        elif run.dist.is_main:
            (checkpoints / "best").unlink()

    def validate(self, step: int, logger: MetricsLogger, extra: dict[str, Any]) -> float:
        """Evaluate the validation split at ``step``; save ``checkpoints/best`` if the selection NE is a new
        minimum (``extra``: the JSON trainer state to store with it). Returns the selection NE."""
        r, cfg = self.run, self.run.cfg
        ev = evaluate_model(
            r.model, r.source, cfg, r.dist, r.autocast_dtype, step, cfg.train.valid_batches, "valid"
        )
        value = selection_value(ev, cfg.train.select_task)
        row = ev.as_flat_dict()
        row["select_ne"] = value
        logger.log(step, "valid", row)
        if not (math.isfinite(value) and (self.best is None or value < self.best[1])):
            self.since_best += 1
        else:
            self.best = (step, value)
            self.since_best = 0
            extra = dict(extra)
            extra["selection"] = {
                "task": cfg.train.select_task,
                "value": value,
                "valid": {t: m.as_dict() for t, m in ev.tasks.items()},
            }
            save_best_checkpoint(
                self.checkpoints, step, r.model, r.optimizers, extra, background=True, sparse=r.sparse
            )
        return value

    def should_stop_early(self) -> bool:
        """Whether ``train.early_stop_patience`` validations in a row brought no new best (False when off)."""
        patience = self.run.cfg.train.early_stop_patience
        return bool(patience) and self.since_best >= patience

    def early_stop_summary(self, stopped: bool, step: int) -> dict[str, Any] | None:
        """eval.json's ``early_stop`` entry of a run that ended at ``step`` (``stopped``: by early stopping);
        None when ``train.early_stop_patience`` is off."""
        t = self.run.cfg.train
        if not t.early_stop_patience:
            return None
        best = self.best
        return {
            "patience": t.early_stop_patience,
            "stopped": stopped,
            "step": step,
            "max_steps": t.steps,
            "best_step": best[0] if best else None,
        }

    def note_early_stop(self, step: int, logger: MetricsLogger, is_main: bool) -> None:
        """Log (``early_stop`` row) and, on rank 0, print that early stopping ends the run at ``step``."""
        t = self.run.cfg.train
        best = self.best
        msg = (
            f"early stop at step {step} of {t.steps}: validation NE "
            f"[{t.select_task}] has not improved for {self.since_best} evaluations "
            f"(train.early_stop_patience = {t.early_stop_patience}); best step "
            f"{best[0] if best else None}, NE {best[1] if best else float('nan'):.4f}"
        )
        row = {"best_step": float(best[0] if best else -1), "since_best": float(self.since_best)}
        logger.log(step, "early_stop", row)
        if is_main:
            print(f"gem-train: {msg}", file=sys.stderr)

    def evaluate_best(
        self, should_stop: Callable[[], bool] | None = None, checkpoints: Path | None = None
    ) -> EvalResult | None:
        """The test split of the best-validation checkpoint (of ``checkpoints``, default this run's), loaded
        from disk into a fresh model (None if there is none)."""
        found = best_checkpoint(checkpoints or self.checkpoints)
        if found is None:
            return None
        r, cfg = self.run, self.run.cfg
        model = build_model_for(cfg, r.spec, r.dist, training=False).module
        state = load_checkpoint(found, model, None, restore_rng=False)
        return evaluate_model(
            model,
            r.source,
            cfg,
            r.dist,
            r.autocast_dtype,
            step=int(state["step"]),
            max_batches=cfg.train.eval_batches,
            should_stop=should_stop,
        )
