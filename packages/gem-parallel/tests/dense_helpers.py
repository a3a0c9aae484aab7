"""Shared pieces of the dense-parallel tests: the toy model's config, per-rank slices, the reference run."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from gem_parallel.testing.toy_model import ToyBatch, ToyConfig, ToyModel, toy_loss


def small_config(n_experts: int = 2, **overrides) -> ToyConfig:
    """The toy model's defaults (2 layers, d_model 32, histories of 0..12 events): a step costs a few ms."""
    return dataclasses.replace(ToyConfig(), n_experts=n_experts, **overrides)


def build_model(config: ToyConfig, seed: int = 0) -> ToyModel:
    return ToyModel(config, seed=seed)


def rank_slices(sizes: list[int]) -> list[list[int]]:
    """Sample indices of each rank's slice of a global batch of ``sum(sizes)``."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]


def reference_loss(model: ToyModel, batch: ToyBatch, sizes: list[int]) -> torch.Tensor:
    """The objective data parallelism optimises: the mean over ranks of each rank's own loss (one forward
    of the whole global batch, its logits split by rank)."""
    logits = model(batch)
    losses = []
    for idx in rank_slices(sizes):
        losses.append(toy_loss(logits[torch.tensor(idx)], batch.select(idx)))
    return torch.stack(losses).mean()


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one whole tensor (collective for a DTensor: call on every rank in order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-6): a relative error that ignores tiny entries' noise."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))
