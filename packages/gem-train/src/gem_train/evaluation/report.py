"""What a finished run leaves for its reader: ``eval.json`` and the plots of its run directory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gem_train.checkpoint import best_checkpoint, read_trainer_state
from gem_train.evaluation.evaluate import EvalResult
from gem_train.evaluation.plots import plot_curves, plot_reliability
from gem_train.loop.metrics_log import MetricsLogger, read_metrics
from gem_train.loop.run_dir import RunDir

if TYPE_CHECKING:
    from gem_train.evaluation.selection import BestSelection

__all__ = ["final_evaluation", "write_final"]


def write_final(
    run: RunDir,
    tasks: tuple[str, ...],
    ev: EvalResult,
    last_checkpoint: Path | None,
    select_task: str,
    best: EvalResult | None = None,
    best_value: float | None = None,
    early_stop: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """``eval.json`` (the test split of the final model and, with selection, of the best-validation
    checkpoint ``best`` with validation value ``best_value``), then the loss/NE curves and the
    reliability plot; ``early_stop``: what early stopping did (``train.early_stop_patience > 0``); ``extra``:
    more top-level entries (the trainer's ``schedule`` and ``health`` warnings). Rank 0 only."""
    summary: dict[str, Any] = {
        "step": ev.step,
        "tasks": {t: m.as_dict() for t, m in ev.tasks.items()},
        "ground_truth_ne": ev.ground_truth_ne,
        "checkpoint": str(last_checkpoint) if last_checkpoint else None,
    }
    if best is not None and best_value is not None:
        found = best_checkpoint(run.checkpoints)
        sel = read_trainer_state(found).get("selection", {}) if found else {}
        summary["best"] = {
            "step": best.step,
            "select_task": select_task,
            "valid_ne": best_value,
            "valid": sel.get("valid"),
            "tasks": {t: m.as_dict() for t, m in best.tasks.items()},  # the test split
            "ground_truth_ne": best.ground_truth_ne,
            "checkpoint": str(found) if found else None,
        }
    if early_stop is not None:
        summary["early_stop"] = early_stop
    summary.update(extra or {})
    tmp = run.eval_summary.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    tmp.replace(run.eval_summary)  # never a half-written eval.json
    plot_curves(read_metrics(run.metrics), run.plots, tasks)
    plot_reliability(ev.predictions, run.plots / "reliability.png")


def final_evaluation(
    step: int,
    evaluate: Callable[[], EvalResult],
    evaluate_best: Callable[[], EvalResult | None],
    selection: BestSelection,
    logger: MetricsLogger,
    run: RunDir,
    tasks: tuple[str, ...],
    last_checkpoint: Path | None,
    select_task: str,
    early_stop: dict[str, Any] | None,
    is_main: bool,
    extra: dict[str, Any] | None = None,
) -> tuple[EvalResult, EvalResult | None]:
    """The test split of the final model (``evaluate``) and of the best-validation checkpoint
    (``evaluate_best``, when ``selection`` has one), logged at ``step``; eval.json and plots (rank 0)."""
    final_eval = evaluate()
    logger.log(step, "test", final_eval.as_flat_dict())
    best_eval = None
    if selection.best is not None:
        # The selected checkpoint, loaded back from disk (also when it is the last step: this checks
        # that checkpoints/best loads), on the test split.
        best_eval = evaluate_best()
        if best_eval is not None:
            row = best_eval.as_flat_dict()
            row["best_step"] = best_eval.step
            logger.log(step, "best_test", row)
    if is_main:
        best = selection.best
        write_final(
            run, tasks, final_eval, last_checkpoint, select_task,
            best_eval, best[1] if best else None,
            early_stop=early_stop, extra=extra,
        )  # fmt: skip
    return final_eval, best_eval
