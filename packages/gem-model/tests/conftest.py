"""Shared test tools of gem-model's tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gem_model as gm


def _loss_backward_flops(model: torch.nn.Module, batch: gm.GemBatch) -> int:
    """FLOPs PyTorch's ``FlopCounterMode`` counts for one forward, multi-task loss and backward of ``model``
    on ``batch``: what :func:`gem_model.flops` must predict exactly."""
    counter = FlopCounterMode(display=False)
    with counter:
        gm.multitask_loss(model(batch), batch)[0].backward()
    return int(counter.get_total_flops())


@pytest.fixture
def loss_backward_flops() -> Callable[[torch.nn.Module, gm.GemBatch], int]:
    """:func:`_loss_backward_flops`: the measured side of every FLOP-count test."""
    return _loss_backward_flops
