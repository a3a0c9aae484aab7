"""The ``[distill]`` config section: knowledge transfer from a teacher (a GEM foundation model) into the model
this run trains (the student: a small GEM or the MLP).

ExFM (WWW 2025, arXiv 2502.17494) and LoopFM (arXiv 2605.29280) in three switches:

- ``mode``: where the teacher's soft labels go. ``"serving"``: plain distillation into the serving heads
  (``loss = BCE(serving, y) + weight * BCE(serving, p_teacher)``); ``"aux"``: an *auxiliary head* per task
  beside the serving head takes them (``BCE(serving, y) + weight * BCE(aux, p_teacher)``), so the teacher's
  bias never reaches the serving head (ExFM's AH); ``"none"``: no soft labels.
- ``adapter``: a *student adapter* (ExFM's SA) per task: a small learned map of the teacher's logit (and,
  with ``adapter_age``, of the teacher's age in days) trained on the true labels; its output, not the raw
  teacher prediction, is the soft label. It corrects a stale teacher.
- ``embeddings``: the teacher's representation (``gem-train predict --embeddings``) as extra dense input
  features (LoopFM); ``embedding_history`` adds the mean representation of the user's past events (where the
  data has them: MovieLens, whose history events are examples too).

The teacher comes from ``teacher`` (a ``gem-train predict`` output directory, joined by key: the production
path) or ``teacher_checkpoint`` (a checkpoint run live on every training batch: experiments). The student's
serving model keeps its checkpoint names; the auxiliary heads and adapters live under ``distill.`` and are
ignored where the serving model is loaded alone (see :mod:`gem_train.transfer.student`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gem_train.config.checks import ConfigError
from gem_train.config.checks import int_in as _int_in
from gem_train.config.checks import real as _real

__all__ = ["DistillConfig"]


@dataclass
class DistillConfig:
    """Knowledge transfer from a teacher (see the module docstring). Off unless ``mode``, ``adapter`` or
    ``embeddings`` asks for something."""

    mode: Literal["none", "serving", "aux"] = "none"
    teacher: str = ""  # a `gem-train predict` output directory (labels joined by key; embeddings)
    teacher_checkpoint: str = ""  # or a teacher checkpoint computed live on each training batch (labels only)
    weight: float = 1.0  # weight of the soft-label term beside the true-label BCE of the serving head
    tasks: list[str] = field(default_factory=list)  # tasks that get soft labels; [] = every task
    aux_hidden: int = 64  # hidden width of each auxiliary head (0: a linear map of the representation)
    adapter: Literal["none", "linear", "mlp"] = "none"
    adapter_hidden: int = 16  # hidden width of an "mlp" adapter
    adapter_age: bool = False  # the adapter also reads the teacher's age (days since teacher_trained_until)
    teacher_trained_until: int = 0  # unix seconds: the end of the teacher's training data (for adapter_age)
    embeddings: bool = False  # the teacher's stored representation as dense input features (LoopFM)
    embedding_history: bool = False  # + the mean representation of the user's past events (MovieLens)

    @property
    def active(self) -> bool:
        """Whether the section asks for anything (else the run is a plain one)."""
        return self.mode != "none" or self.adapter != "none" or self.embeddings or self.embedding_history

    @property
    def needs_teacher_labels(self) -> bool:
        return self.mode != "none" or self.adapter != "none"

    def validate(self, key: str = "distill") -> None:
        _real(f"{key}.weight", self.weight, 0.0)
        _int_in(f"{key}.aux_hidden", self.aux_hidden, 0)
        _int_in(f"{key}.adapter_hidden", self.adapter_hidden, 1)
        _int_in(f"{key}.teacher_trained_until", self.teacher_trained_until, 0)
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"{key}.tasks has duplicates: {self.tasks}")
        if not self.active:
            return
        if self.teacher and self.teacher_checkpoint:
            raise ConfigError(
                f"{key}: set either teacher (predict output, joined by key) or teacher_checkpoint (computed "
                "live), not both"
            )
        if self.needs_teacher_labels and not (self.teacher or self.teacher_checkpoint):
            raise ConfigError(
                f"{key}.mode = {self.mode!r}, adapter = {self.adapter!r}: soft labels need a teacher: set "
                f"{key}.teacher (a `gem-train predict` output directory) or {key}.teacher_checkpoint"
            )
        if (self.embeddings or self.embedding_history) and not self.teacher:
            raise ConfigError(
                f"{key}.embeddings / embedding_history read stored representations: set {key}.teacher to a "
                "`gem-train predict --embeddings` output directory (a live teacher would be needed at "
                "evaluation too)"
            )
        if self.adapter != "none" and self.mode == "none":
            raise ConfigError(
                f"{key}.adapter = {self.adapter!r} corrects the soft labels: it needs {key}.mode = 'aux' "
                "(ExFM's auxiliary head) or 'serving'"
            )
        if self.adapter_age and self.adapter == "none":
            raise ConfigError(f"{key}.adapter_age needs an adapter ({key}.adapter = 'linear' or 'mlp')")
        if self.adapter_age and not self.teacher_trained_until:
            raise ConfigError(
                f"{key}.adapter_age measures the teacher's age from {key}.teacher_trained_until (unix "
                "seconds, the end of the teacher's training data): set it"
            )
