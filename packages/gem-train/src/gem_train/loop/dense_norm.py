"""The scale of the dense features: measured on the first training batches, and optionally standardised.

:func:`measure_dense` reads the first :data:`MEASURE_BATCHES` training batches (as one process sees the
stream: the same on every rank) and returns each dense column's mean and standard deviation
(:class:`DenseStats`); :meth:`DenseStats.far_from_unit` names the columns a model initialised for unit-scale
inputs would struggle with (see :data:`LARGE` and :data:`SMALL`).

``data.normalize_dense = true`` puts a :class:`DenseNorm` in front of the model's dense input
(:func:`attach_dense_norm`): a submodule ``dense_norm`` of the model with two buffers, ``mean`` and ``std``,
set from the training split's statistics before training and saved in every checkpoint with the weights, so
evaluation and resume standardise with the same numbers. A forward pre-hook replaces ``batch.dense`` by
``(dense - mean) / std``; the model itself is unchanged, and so are its checkpoint keys when the option is
off.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "LARGE",
    "MEASURE_BATCHES",
    "SMALL",
    "DenseNorm",
    "DenseStats",
    "attach_dense_norm",
    "dense_names",
    "measure_dense",
]

MEASURE_BATCHES = 8  # training batches measured before training (2,048 rows at the default batch of 256)
# A column is far from unit scale when its mean or standard deviation exceeds LARGE in magnitude (e.g. a
# price in dollars, an age in years, a raw count), or when it varies by less than SMALL (a rate of 1e-4):
# dense layers are initialised for inputs of scale ~1, and AdamW's steps (lr ~1e-3 per weight) move such a
# column's contribution 100x too much or too little.
LARGE = 10.0
SMALL = 0.01


@dataclass(frozen=True)
class DenseStats:
    """Per dense column (``[n_dense]`` float64): mean and standard deviation over ``rows`` rows."""

    names: list[str]
    mean: np.ndarray
    std: np.ndarray
    rows: int

    def far_from_unit(self) -> list[tuple[str, float, float]]:
        """``(name, mean, std)`` of every column far from unit scale (:data:`LARGE`, :data:`SMALL`);
        constant columns are not listed (there is nothing to scale)."""
        out = []
        for name, m, s in zip(self.names, self.mean.tolist(), self.std.tolist(), strict=True):
            if max(abs(m), s) > LARGE or 0.0 < s < SMALL:
                out.append((name, m, s))
        return out


def dense_names(cfg: Any, n_dense: int) -> list[str]:
    """The dense columns' names: the Parquet columns where declared one by one, else ``dense[i]``."""
    if cfg.data.source == "parquet":
        d = cfg.data.parquet.dense
        if d.columns:
            return list(d.columns)
        return [f"{d.column}[{i}]" for i in range(n_dense)]
    return [f"dense[{i}]" for i in range(n_dense)]


def measure_dense(cfg: Any, source: Any, batches: int = MEASURE_BATCHES) -> DenseStats | None:
    """Mean and standard deviation of each dense column over the first ``batches`` training batches of
    ``source`` (global batches ``0 .. batches - 1``, read in this process; at most one pass over a finite
    training split); None without dense features."""
    from gem_train.data.loader import make_train_loader

    n = source.spec.n_dense
    if not n:
        return None
    per_pass = source.num_batches("train", cfg.data.batch_size)
    batches = min(batches, per_pass) if per_pass else batches
    loader = make_train_loader(source, cfg.data.batch_size, num_workers=0)
    total = np.zeros(n)
    squares = np.zeros(n)
    rows = 0
    it = iter(loader)
    try:
        for _ in range(batches):
            lb = next(it, None)
            if lb is None:
                break
            x = lb.batch.dense.double().numpy()
            total += x.sum(0)
            squares += (x * x).sum(0)
            rows += len(x)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
        del it
    if not rows:
        return None
    mean = total / rows
    std = np.sqrt(np.maximum(squares / rows - mean * mean, 0.0))
    return DenseStats(dense_names(cfg, n), mean, std, rows)


class DenseNorm(nn.Module):
    """``(dense - mean) / std`` per column, with ``mean`` and ``std`` as buffers (``[n_dense]`` float32)."""

    mean: Tensor
    std: Tensor

    def __init__(self, n_dense: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_dense, device=device))
        self.register_buffer("std", torch.ones(n_dense, device=device))

    @torch.no_grad()
    def set_stats(self, stats: DenseStats) -> None:
        """Standardise with ``stats`` (a constant column keeps std 1: nothing to scale)."""
        std = np.where(stats.std > 1e-12, stats.std, 1.0)
        self.mean.copy_(torch.as_tensor(stats.mean, dtype=torch.float32))
        self.std.copy_(torch.as_tensor(std, dtype=torch.float32))

    def forward(self, dense: Tensor) -> Tensor:
        """``dense`` ``[B, n_dense]`` -> the standardised features, ``[B, n_dense]`` float32."""
        return (dense.float() - self.mean) / self.std


def _standardise_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: the batch (first argument) with its dense features standardised. A shallow copy:
    the caller's batch is left as it is (and no host lengths are recomputed)."""
    norm = module.get_submodule("dense_norm")
    batch = copy.copy(args[0])
    batch.dense = norm(batch.dense)
    return (batch, *args[1:])


def attach_dense_norm(model: nn.Module, n_dense: int, device: torch.device | str | None) -> DenseNorm:
    """Give ``model`` a ``dense_norm`` submodule (identity until :meth:`DenseNorm.set_stats`) that
    standardises the dense features of every batch it is called with."""
    norm = DenseNorm(n_dense, device=device)
    model.add_module("dense_norm", norm)
    model.register_forward_pre_hook(_standardise_input)
    return norm
