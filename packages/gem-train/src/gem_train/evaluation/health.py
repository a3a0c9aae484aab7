"""Training health, said in words: what a practitioner would check by looking at the curves.

:class:`TrainingHealth` watches a run and warns (rank 0, on stderr as ``gem-train: warning: ...``, as a
``"health"`` row of metrics.jsonl with the check's name and message, and in eval.json's ``"health"`` list):

- ``dense_scale`` (before training): a dense feature far from unit scale on the first training batches
  (:mod:`gem_train.loop.dense_norm`), with how to standardise it;
- ``small_table`` (before training): more dense parameters per training example than
  :data:`PARAMS_PER_EXAMPLE` (measured: BENCHMARKS.md, "How much data a model needs");
- ``no_signal``: validation NE has stayed >= 1 for the first :data:`NO_SIGNAL_VALIDATIONS` validations
  (during the run), or the run's best validation NE is >= 1 (at its end): the model does not beat predicting
  the base rate;
- ``overfitting``: validation NE rose more than :data:`RISE` above its best while training NE fell more than
  :data:`RISE` below its value at the best step; the message says where the best checkpoint is and whether
  early stopping ends the run or why it goes on (during the run: once; at the end: what happened).

Each check fires at most once during a run and once at its end. The thresholds are chosen so the shipped
configs run without a warning (tested) and the failure modes do not (tested on a tiny table that overfits,
labels with no signal and an unscaled dense column).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gem_train.loop.dense_norm import LARGE, SMALL, DenseStats

if TYPE_CHECKING:
    from gem_train.loop.metrics_log import MetricsLogger
    from gem_train.loop.schedule import Schedule
    from gem_train.loop.step import BuiltRun

__all__ = [
    "NO_SIGNAL_VALIDATIONS",
    "PARAMS_PER_EXAMPLE",
    "RISE",
    "HealthNote",
    "TrainingHealth",
    "dense_note",
    "model_sizes",
    "size_note",
    "start_checks",
]

NO_SIGNAL_VALIDATIONS = 3  # validations in a row at NE >= 1, from the first, before the warning
RISE = 0.05  # relative rise of validation NE (and fall of training NE) that counts as overfitting
# Dense (non-embedding) parameters per training example above which the table is small for the model. The
# tiny GEM model has 72k dense parameters on benchmarks/own_data_size.py's table: at 40 and 20 per training
# row (2,000 and 4,000 rows) it did not beat the base rate on validation, at 8 (10,000 rows) it was marginal
# (validation NE 1.008, test 0.970), at 4 and 1.6 it learned (test NE 0.928, 0.917); BENCHMARKS.md, "How much
# data a model needs". 10 sits between the failures and the runs that learned.
PARAMS_PER_EXAMPLE = 10.0


@dataclass(frozen=True)
class HealthNote:
    """One warning: which check, at which step (0: before training), and what it says."""

    check: str
    step: int
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "step": self.step, "message": self.message}


def dense_note(stats: DenseStats, normalized: bool) -> str | None:
    """The ``dense_scale`` message for ``stats`` (None when every column is near unit scale, or when
    ``data.normalize_dense`` already standardises them)."""
    far = stats.far_from_unit()
    if not far or normalized:
        return None
    cols = "; ".join(f"{name}: mean {m:.4g}, std {s:.4g}" for name, m, s in far[:8])
    more = f" (and {len(far) - 8} more)" if len(far) > 8 else ""
    return (
        f"{len(far)} dense feature(s) far from unit scale on the first {stats.rows:,} training rows ({cols}"
        f"{more}; |mean| or std above {LARGE:g}, or std below {SMALL:g}): models are initialised for inputs "
        "of scale ~1. Standardise them in the table ((x - mean) / std, with the training split's mean and "
        "std; log1p first for counts and prices), or set data.normalize_dense = true to do it in the model "
        "with these statistics (stored in the checkpoint)"
    )


def size_note(dense_params: int, embedding_params: int, rows: int | None, model: str) -> str | None:
    """The ``small_table`` message: None unless ``rows`` training examples are few for ``dense_params``
    dense parameters (endless streams are never small)."""
    if not rows or dense_params / rows <= PARAMS_PER_EXAMPLE:
        return None
    return (
        f"the training table is small for the model: {model} has {dense_params:,} dense parameters (plus "
        f"{embedding_params:,} in embedding tables) for {rows:,} training rows, {dense_params / rows:.1f} "
        f"per row (above {PARAMS_PER_EXAMPLE:g}: measured, such models memorise the table and do not beat "
        "the base rate on validation). Use more rows (at least "
        f"{math.ceil(dense_params / PARAMS_PER_EXAMPLE):,}), a "
        "smaller model (model.arch = 'mlp' with model.baseline.hidden = [], or smaller model.overrides: "
        "d_model, n_layers), and keep validation with early stopping on; `gem-train data inspect` suggests "
        "a size"
    )


class TrainingHealth:
    """The health checks of one run (see the module docstring); every rank calls, rank 0 speaks."""

    def __init__(self, schedule: Schedule, select_task: str, logger: MetricsLogger, is_main: bool) -> None:
        self.schedule, self.select_task, self.logger, self.is_main = schedule, select_task, logger, is_main
        self.notes: list[HealthNote] = []
        self._fired: set[str] = set()
        self._train_ne: float | None = None  # the latest logged training NE of the selection task
        # (step, validation NE, the training NE then) of every validation
        self.validations: list[tuple[int, float, float | None]] = []

    def warn(self, check: str, step: int, message: str, log: bool = True) -> None:
        """Say ``message`` (rank 0: stderr; the metrics row unless ``log`` is False; eval.json)."""
        note = HealthNote(check, step, message)
        self.notes.append(note)
        if self.is_main:
            print(f"gem-train: warning: {message}", file=sys.stderr)
        if log:
            self.logger.note(step, "health", {"check": check, "message": message})

    def before_training(self, notes: list[tuple[str, str]], resumed: bool) -> None:
        """The checks made before the first step (``(check, message)`` pairs); a resumed run says them again
        but its metrics.jsonl has their rows already."""
        for check, message in notes:
            self.warn(check, 0, message, log=not resumed)

    def replay(self, rows: list[dict[str, Any]]) -> None:
        """A resumed run: take the validations, training NE and warnings of its metrics rows (up to the
        resumed step) as if they had happened in this process, without saying them again."""
        for r in rows:
            if r["split"] == "train":
                self.on_train(r)
            elif r["split"] == "valid" and "select_ne" in r:
                self.validations.append((int(r["step"]), float(r["select_ne"]), self._train_ne))
            elif r["split"] == "health" and int(r["step"]) > 0:
                self._fired.add(str(r.get("check")))

    def on_train(self, row: dict[str, Any]) -> None:
        """A ``train`` row of metrics.jsonl was logged: remember its selection-task NE."""
        nes = [v for k, v in row.items() if k.endswith("/ne")]
        if self.select_task == "mean":
            value = sum(nes) / len(nes) if nes else float("nan")
        else:
            value = row.get(f"{self.select_task}/ne", float("nan"))
        self._train_ne = float(value) if math.isfinite(value) else None

    def _best(self) -> tuple[int, float, float | None] | None:
        finite = [v for v in self.validations if math.isfinite(v[1])]
        return min(finite, key=lambda v: v[1]) if finite else None  # ties: the earliest (min is stable)

    def _overfit(self) -> tuple[tuple[int, float, float | None], tuple[int, float, float | None]] | None:
        """(best, latest) validation when the latest shows overfitting, else None."""
        best, last = self._best(), self.validations[-1] if self.validations else None
        if best is None or last is None or last[0] == best[0] or not math.isfinite(last[1]):
            return None
        if best[2] is None or last[2] is None:
            return None
        rose = last[1] > best[1] * (1 + RISE)
        fell = last[2] < best[2] * (1 - RISE)
        return (best, last) if rose and fell else None

    def on_validation(self, step: int, value: float, since_best: int, will_stop: bool) -> None:
        """A validation at ``step`` gave selection NE ``value``; ``since_best`` validations brought no new
        best, and ``will_stop``: early stopping ends the run here."""
        self.validations.append((step, value, self._train_ne))
        vals = [v for _, v, _ in self.validations]
        t = f"[{self.select_task}]"
        n = NO_SIGNAL_VALIDATIONS
        if "no_signal" not in self._fired and len(vals) >= n and all(v >= 1.0 for v in vals):
            self._fired.add("no_signal")
            msg = (
                f"validation NE {t} has stayed >= 1 for the first {len(vals)} validations ({vals[-1]:.4f} "
                f"at step {step}): the model does not beat predicting the base rate. Check that the labels "
                "can be predicted from the features, that the table is large enough for the model (gem-train "
                "data inspect), the dense features' scale and the learning rate"
            )
            self.warn("no_signal", step, msg)
        found = self._overfit()
        if found is not None and "overfitting" not in self._fired:
            self._fired.add("overfitting")
            (bs, bv, bt), (_, lv, lt) = found
            assert bt is not None and lt is not None
            p = self.schedule.early_stop_patience
            if will_stop:
                then = "early stopping ends the run here"
            elif step >= self.schedule.steps:
                then = "this is the run's last step"
            elif p:
                left = p - since_best
                then = (
                    f"training continues until {p} validations in a row bring no new best "
                    f"(train.early_stop_patience; {left} more)"
                )
            else:
                then = (
                    f"training continues to step {self.schedule.steps:,}: early stopping is off "
                    "(train.early_stop_patience = 0)"
                )
            msg = (
                f"overfitting: validation NE {t} rose from {bv:.4f} (step {bs}) to {lv:.4f} (step {step}) "
                f"while training NE fell from {bt:.4f} to {lt:.4f}. The best checkpoint is step {bs} "
                f"(checkpoints/best); {then}"
            )
            self.warn("overfitting", step, msg)

    def at_end(self, step: int, early_stopped: bool) -> None:
        """The end-of-run checks of a run that ended at ``step``."""
        best = self._best()
        t = f"[{self.select_task}]"
        if best is not None and best[1] >= 1.0:
            msg = (
                f"the best validation NE {t} of the run is {best[1]:.4f} (step {best[0]}), not below 1: the "
                "model does not beat predicting the base rate, and neither will checkpoints/best on the test "
                "split"
            )
            self.warn("no_signal", step, msg)
        last = self.validations[-1] if self.validations else None
        if best is None or last is None or last[0] == best[0]:
            return
        if self._overfit() is None and "overfitting" not in self._fired:
            return
        if early_stopped:
            why = (
                f"early stopping ended it at step {step}, {self.schedule.early_stop_patience} validations "
                "without a new best"
            )
        elif self.schedule.early_stop_patience:
            why = (
                f"it ran to its last step ({step}) before {self.schedule.early_stop_patience} validations "
                "in a row went without a new best (train.early_stop_patience)"
            )
        else:
            why = f"it ran to the last step ({step}): early stopping is off (train.early_stop_patience = 0)"
        msg = (
            f"the run overfitted: validation NE {t} was lowest at step {best[0]} ({best[1]:.4f}) and is "
            f"{last[1]:.4f} at step {last[0]}; {why}. Use checkpoints/best (step {best[0]}), not the final "
            "model"
        )
        self.warn("overfitting", step, msg)


def _count(params: Any) -> int:
    # DTensors (FSDP2) and TorchRec's sharded tables report their global size.
    return sum(math.prod(p.size()) for p in params)


def model_sizes(model: Any) -> tuple[int, int]:
    """(dense parameters, embedding-table parameters) of a GEM model or the MLP baseline."""
    dense = _count(model.dense_parameters())
    return dense, _count(model.parameters()) - dense


def start_checks(run: BuiltRun, fresh: bool) -> list[tuple[str, str]]:
    """The checks before the first step, as ``(check, message)`` pairs: the dense features' scale on the
    first training batches and the parameters per training example. With ``data.normalize_dense`` on a
    ``fresh`` run (not resumed: the checkpoint holds its statistics) this also sets the model's
    :class:`~gem_train.loop.dense_norm.DenseNorm` from those batches."""
    from gem_train.loop.dense_norm import measure_dense

    cfg = run.cfg
    out: list[tuple[str, str]] = []
    # The declared data's dense columns ([distill] wraps the dataset: its teacher is not read for this).
    stats = measure_dense(cfg, getattr(run.source, "inner", run.source))
    if stats is not None:
        norm = getattr(run.model, "dense_norm", None)
        if norm is not None and len(stats.mean) != run.source.spec.n_dense:
            from gem_train.config import ConfigError

            raise ConfigError(
                "data.normalize_dense standardises the declared dense columns; with distill.embeddings the "
                "model's dense input also holds the teacher's representations: set data.normalize_dense = "
                "false (standardise the columns in the table instead)"
            )
        if norm is not None and fresh:
            norm.set_stats(stats)
        note = dense_note(stats, normalized=norm is not None)
        if note:
            out.append(("dense_scale", note))
    schedule = run.schedule
    dense, tables = model_sizes(run.model)
    name = "the MLP baseline" if cfg.model.arch == "mlp" else f"GEM '{cfg.model.name}'"
    note = size_note(dense, tables, schedule.train_rows if schedule else None, name)
    if note:
        out.append(("small_table", note))
    return out
