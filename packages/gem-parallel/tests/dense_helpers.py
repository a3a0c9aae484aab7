"""Shared pieces of the dense-parallel tests: a small GEM config, per-rank batch slices, the reference run."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor

import gem_model as gm


def small_config(n_experts: int = 2, **overrides) -> gm.GemConfig:
    """``tiny`` with small features (short histories, small vocabularies): a step costs tens of ms."""
    spec = gm.FeatureSpec(
        n_dense=4,
        sparse=(gm.SparseFeature("user", 50), gm.SparseFeature("ad", 40, max_ids=2)),
        sequences=(gm.SequenceFeature("history", 60, 4, 12),),
    )
    return dataclasses.replace(gm.get_config("tiny"), features=spec, n_experts=n_experts, **overrides)


def build_model(config: gm.GemConfig, seed: int = 0) -> gm.GemModel:
    torch.manual_seed(seed)
    return gm.GemModel(config)


def rank_slices(sizes: list[int]) -> list[list[int]]:
    """Sample indices of each rank's slice of a global batch of ``sum(sizes)``."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]


def reference_loss(model: gm.GemModel, batch: gm.GemBatch, sizes: list[int]) -> torch.Tensor:
    """The objective data parallelism optimises: the mean over ranks of each rank's own loss (one forward
    of the whole global batch, its logits split by rank)."""
    logits = model(batch)
    losses = []
    for idx in rank_slices(sizes):
        sel = torch.tensor(idx)
        losses.append(gm.multitask_loss({t: v[sel] for t, v in logits.items()}, batch.select(idx))[0])
    return torch.stack(losses).mean()


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one whole tensor (collective for a DTensor: call on every rank in order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-6): a relative error that ignores tiny entries' noise."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))
