"""The student's extra modules, beside its serving model: ExFM's auxiliary heads and student adapters.

:func:`attach_student` adds them to the model built for the run as one submodule, ``model.distill``
(:class:`StudentHeads`), and makes the model's ``forward`` also return their outputs while training:

- ``"aux:<task>"``: the auxiliary head's logit, an MLP on the student's representation (the tensor its
  serving heads read: :mod:`gem_train.transfer.representation`), trained on the teacher's soft labels;
- ``"adapter:<task>"``: the adapter's logit, a small map of the teacher's logit (and age) trained on the
  true labels, whose probability is then the soft label (:mod:`gem_train.transfer.losses`).

The serving path is unchanged: in ``eval()`` mode the model returns its serving logits only, and every
parameter of the serving model keeps its name, so a student checkpoint's serving weights are the plain
model's (``distill.*`` are extra keys). Evaluation with the run's config rebuilds ``model.distill`` and
ignores it; evaluation with ``[distill]`` switched off builds the plain model, and DCP loads only the keys
the model asks for, so the extra keys are ignored too. Neither needs the teacher.

The model keeps its class's behaviour through a subclass made on the fly (``StudentGemModel`` of
``GemModel``, ...), the way FSDP2 swaps classes: ``isinstance`` checks and parameter names still hold.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gem_model import GemBatch
from gem_train.config import ConfigError, DistillConfig
from gem_train.transfer.representation import RepresentationCapture

__all__ = ["Adapter", "AuxHead", "StudentHeads", "attach_student"]


class AuxHead(nn.Module):
    """``[B, D]`` representation -> ``[B]`` logit: LayerNorm, one SiLU hidden layer (``hidden = 0``: none),
    a small output layer (initial predictions near 0.5)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, hidden) if hidden else None
        self.out = nn.Linear(hidden or width, 1)
        nn.init.normal_(self.out.weight, std=0.01)
        nn.init.zeros_(self.out.bias)

    def forward(self, rep: Tensor) -> Tensor:
        z = self.norm(rep.float())
        if self.hidden is not None:
            z = F.silu(self.hidden(z))
        return self.out(z).squeeze(-1)


class Adapter(nn.Module):
    """ExFM's student adapter for one task: the teacher's logit ``t`` (``[B]``) and, with ``age``, its age
    in days ``a`` -> a corrected logit ``[B]``, starting as the identity.

    ``"linear"``: ``w t + b`` (+ ``c a + e t a``); ``"mlp"``: ``t + MLP([t, a])`` with one SiLU hidden layer
    and a zero-initialised output.
    """

    def __init__(self, kind: str, age: bool, hidden: int) -> None:
        super().__init__()
        self.kind, self.age = kind, age
        n_in = 2 if age else 1
        if kind == "linear":
            self.linear = nn.Linear(n_in * 2 - 1, 1)  # t (, a, t * a)
            with torch.no_grad():
                self.linear.weight.zero_()
                self.linear.weight[0, 0] = 1.0
                self.linear.bias.zero_()
        else:
            self.mlp = nn.Sequential(nn.Linear(n_in, hidden), nn.SiLU(), nn.Linear(hidden, 1))
            nn.init.zeros_(cast(nn.Linear, self.mlp[2]).weight)
            nn.init.zeros_(cast(nn.Linear, self.mlp[2]).bias)

    def forward(self, teacher_logit: Tensor, age: Tensor | None) -> Tensor:
        t = teacher_logit.float()[:, None]
        if self.age:
            if age is None:
                raise ValueError("the adapter reads the teacher's age, but the batch carries none")
            a = age.float()[:, None]
        if self.kind == "linear":
            x = torch.cat([t, a, t * a], 1) if self.age else t
            return self.linear(x).squeeze(-1)
        x = torch.cat([t, a], 1) if self.age else t
        return teacher_logit.float() + self.mlp(x).squeeze(-1)


class StudentHeads(nn.Module):
    """The auxiliary heads and adapters of the distilled tasks (``model.distill``)."""

    def __init__(self, width: int, tasks: tuple[str, ...], cfg: DistillConfig) -> None:
        super().__init__()
        self.tasks = tasks
        self.distilled = tuple(cfg.tasks) or tasks
        self.aux = nn.ModuleDict(
            {t: AuxHead(width, cfg.aux_hidden) for t in self.distilled} if cfg.mode == "aux" else {}
        )
        self.adapter = nn.ModuleDict(
            {t: Adapter(cfg.adapter, cfg.adapter_age, cfg.adapter_hidden) for t in self.distilled}
            if cfg.adapter != "none"
            else {}
        )

    def forward(self, rep: Tensor | None, batch: GemBatch) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if len(self.aux):
            assert rep is not None
            for t, head in self.aux.items():
                out[f"aux:{t}"] = head(rep)
        teacher = getattr(batch, "teacher_logits", None)
        if len(self.adapter) and teacher is not None:
            age = getattr(batch, "teacher_age", None)
            for t, adapter in self.adapter.items():
                out[f"adapter:{t}"] = adapter(teacher[:, self.tasks.index(t)], age)
        return out


class _StudentForward:
    """Mixed into the model's class by :func:`attach_student`."""

    distill: StudentHeads
    _student_capture: RepresentationCapture | None
    training: bool

    def forward(self, batch: GemBatch) -> dict[str, Tensor]:
        base = super().forward  # type: ignore[misc]
        if not self.training:
            return cast(dict[str, Tensor], base(batch))  # the serving path: exactly the plain model's
        capture = self._student_capture
        if capture is not None:
            capture.enabled = True
        try:
            out = dict(base(batch))
            rep = capture.take() if capture is not None else None
        finally:
            if capture is not None:
                capture.enabled = False
        out.update(self.distill(rep, batch))
        return out


_CLASSES: dict[type, type] = {}


def _student_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Student{cls.__name__}", (_StudentForward, cls), {})
    return _CLASSES[cls]


def attach_student(model: nn.Module, cfg: DistillConfig, tasks: tuple[str, ...]) -> nn.Module:
    """Add ``model.distill`` (auxiliary heads, adapters) as ``cfg`` asks and return ``model`` (changed in
    place; unchanged when ``cfg`` asks for neither). Before ``gem_parallel.parallelize``."""
    if cfg.mode != "aux" and cfg.adapter == "none":
        return model
    unknown = [t for t in cfg.tasks if t not in tasks]
    if unknown:
        raise ConfigError(f"distill.tasks: {unknown} are not tasks of this dataset ({', '.join(tasks)})")
    capture = RepresentationCapture(model) if cfg.mode == "aux" else None
    width = capture.width if capture is not None else 0
    device = next(model.parameters()).device
    model.add_module("distill", StudentHeads(width, tasks, cfg).to(device))
    object.__setattr__(model, "_student_capture", capture)  # not a submodule: no parameters, no state
    model.__class__ = _student_class(type(model))
    return model


def student_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model.distill`` (empty for a plain model)."""
    heads: Any = getattr(model, "distill", None)
    return list(heads.parameters()) if isinstance(heads, nn.Module) else []
