"""The student's loss: the serving heads on the true labels, plus the teacher's soft labels where
``distill.mode`` puts them, plus the adapters' own loss on the true labels.

For a batch of ``B`` rows, tasks ``T`` (the distilled ones ``D``, ``distill.tasks`` or all), serving logits
``s_t``, auxiliary logits ``a_t``, teacher logits ``z_t``, adapter logits ``c_t``, labels ``y_t`` observed
where ``m_t``::

    serving = mean over tasks with a label of  sum_i m_ti BCE(s_ti, y_ti) / sum_i m_ti    (multitask_loss)
    p_t     = sigmoid(c_t) (adapter) or sigmoid(z_t), held constant (no gradient)
    soft    = mean over t in D of  mean_i BCE(h_ti, p_ti),   h = a ("aux") or s ("serving")
    adapter = mean over t in D with a label of  sum_i m_ti BCE(c_ti, y_ti) / sum_i m_ti
    loss    = serving + distill.weight * soft + adapter

The soft labels cover every row, labelled or not (the teacher predicts each task on every row, e.g. a
conversion probability of an impression that was not clicked). The logged per-task losses are the serving
heads' true-label BCE, comparable with a run without distillation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

from gem_model import GemBatch, multitask_loss
from gem_train.config import DistillConfig

__all__ = ["distill_loss", "loss_for"]

LossFn = Callable[[dict[str, Tensor], GemBatch], tuple[Tensor, dict[str, Tensor]]]


def _masked_bce(logit: Tensor, y: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of the masked BCE / count, whether any label): the per-task loss of ``multitask_loss``."""
    m = mask.to(torch.float32)
    bce = F.binary_cross_entropy_with_logits(logit.float(), y.float(), reduction="none")
    count = m.sum()
    return (bce * m).sum() / count.clamp(min=1.0), (count > 0).to(torch.float32)


def distill_loss(
    logits: dict[str, Tensor], batch: GemBatch, cfg: DistillConfig, tasks: tuple[str, ...]
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of the module docstring; ``logits`` as the student's training forward returns them."""
    serving, per_task = multitask_loss({t: logits[t] for t in tasks}, batch)
    teacher = getattr(batch, "teacher_logits", None)
    if teacher is None:
        raise ValueError("distillation needs the teacher's logits in every training batch (a DistillBatch)")
    distilled = tuple(cfg.tasks) or tasks
    soft_terms, adapter_terms, adapter_counts = [], [], []
    for t in distilled:
        j = tasks.index(t)
        if cfg.adapter != "none":
            c = logits[f"adapter:{t}"]
            loss, has = _masked_bce(c, batch.labels[:, j], batch.label_mask[:, j])
            adapter_terms.append(loss * has)
            adapter_counts.append(has)
            target = torch.sigmoid(c.detach().float())
        else:
            target = torch.sigmoid(teacher[:, j].float())
        if cfg.mode == "none":
            continue
        head = logits[f"aux:{t}"] if cfg.mode == "aux" else logits[t]
        soft_terms.append(F.binary_cross_entropy_with_logits(head.float(), target))
    total = serving
    if soft_terms:
        total = total + cfg.weight * torch.stack(soft_terms).mean()
    if adapter_terms:
        total = total + torch.stack(adapter_terms).sum() / torch.stack(adapter_counts).sum().clamp(min=1.0)
    return total, per_task


def loss_for(cfg: DistillConfig, tasks: tuple[str, ...]) -> LossFn:
    """The training loss of a run: ``multitask_loss``, or :func:`distill_loss` when soft labels are on."""
    if not cfg.needs_teacher_labels:
        return multitask_loss
    return lambda logits, batch: distill_loss(logits, batch, cfg, tasks)
