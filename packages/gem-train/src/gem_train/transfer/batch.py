"""``DistillBatch``: a ``GemBatch`` that also carries the teacher's logits (and age) of its rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gem_model import GemBatch

__all__ = ["DistillBatch", "with_teacher"]


@dataclass
class DistillBatch(GemBatch):
    """A training batch with the teacher's predictions of its rows.

    Attributes (beside :class:`gem_model.GemBatch`'s):
        teacher_logits: ``[B, T]`` float32, the teacher's logit of each of the student's tasks (columns in
            ``spec.tasks`` order).
        teacher_age: ``[B]`` float32 days from the end of the teacher's training data to the row's request
            time (``distill.adapter_age``), or None.
    """

    teacher_logits: Tensor | None = None
    teacher_age: Tensor | None = None

    def _extra(self, fn: object) -> dict[str, Tensor | None]:
        return {
            "teacher_logits": None if self.teacher_logits is None else fn(self.teacher_logits),  # type: ignore[operator]
            "teacher_age": None if self.teacher_age is None else fn(self.teacher_age),  # type: ignore[operator]
        }

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DistillBatch:
        return with_teacher(
            super().to(device, non_blocking=non_blocking),
            **self._extra(lambda t: t.to(device, non_blocking=non_blocking)),
        )

    def pin_memory(self) -> DistillBatch:
        return with_teacher(super().pin_memory(), **self._extra(lambda t: t.pin_memory()))

    def select(self, indices: Tensor | list[int]) -> DistillBatch:
        idx = torch.as_tensor(indices, dtype=torch.int64, device=self.dense.device)
        return with_teacher(super().select(indices), **self._extra(lambda t: t[idx.to(t.device)]))

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        super().record_stream(stream)
        for t in (self.teacher_logits, self.teacher_age):
            if t is not None:
                t.record_stream(stream)


def with_teacher(
    batch: GemBatch, teacher_logits: Tensor | None, teacher_age: Tensor | None = None
) -> DistillBatch:
    """``batch`` (its tensors shared) as a :class:`DistillBatch` with the teacher's outputs."""
    return DistillBatch(
        dense=batch.dense,
        sparse=batch.sparse,
        sequences=batch.sequences,
        request_time=batch.request_time,
        labels=batch.labels,
        label_mask=batch.label_mask,
        teacher_logits=teacher_logits,
        teacher_age=teacher_age,
    )
