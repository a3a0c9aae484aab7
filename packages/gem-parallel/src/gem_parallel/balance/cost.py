"""Cost models: the work a sample brings to a training step, from its sequence length(s).

A sample's length is the total length of its behaviour sequences: gem-model merges a user's sequences by
concatenation, so ``L`` is the sum over sequences and attention costs ``L**2`` of that merged length.
Lengths come as ``[n]`` (one length per sample) or ``[n, S]`` (S sequences per sample, summed).

Three models, one interface (:class:`CostModel`):

- :class:`LinearCost`: ``L`` (linear layers, embeddings: work per token);
- :class:`AttentionCost`: ``L**2`` (full self-attention);
- :class:`MixCost`: ``a*L + b*L**2`` per sample and ``c`` per step, fitted to measured step times
  (gem-train's ``benchmarks/calibrate_cost.py``) and stored as JSON. :func:`default_cost_file` is the
  shipped fit.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "AttentionCost",
    "CostModel",
    "LinearCost",
    "MixCost",
    "calibration_level",
    "default_cost_file",
    "fit_mix_cost",
    "get_cost_model",
    "total_lengths",
]


def total_lengths(lengths: Any) -> torch.Tensor:
    """``[n]`` float64 merged length per sample from ``[n]`` or ``[n, S]`` lengths (ints, >= 0)."""
    t = torch.as_tensor(lengths)
    if t.dim() == 2:
        t = t.sum(dim=1)
    if t.dim() != 1:
        raise ValueError(f"lengths must be [n] or [n, S], got shape {list(t.shape)}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError("lengths hold NaN or inf")
    t = t.to(torch.float64)
    if t.numel() and bool((t < 0).any()):
        raise ValueError(f"lengths must be >= 0, got min {float(t.min())}")
    return t


def calibration_level(cost: CostModel | str, lengths: Any) -> float:
    """The mean cost of a sample over a calibration sample's ``[n]`` / ``[n, S]`` lengths (n >= 1): the
    level (``BaseBatchShuffler(mean_cost=...)``) every rank computes identically when every rank reads the
    same calibration sample (e.g. the first rows of the global training stream), with no communication.
    Summed exactly (``math.fsum``), so the result does not depend on thread count or summation order."""
    costs = get_cost_model(cost).sample_costs(total_lengths(lengths))
    if costs.numel() == 0:
        raise ValueError("calibration_level: the calibration sample is empty")
    return math.fsum(costs.tolist()) / costs.numel()


class CostModel(Protocol):
    """What a balancer needs: per-sample costs (additive within a step) and a per-step constant."""

    @property
    def name(self) -> str:
        """Short name for reports."""
        ...

    def sample_costs(self, lengths: Any) -> torch.Tensor:
        """``[n]`` float64 cost of each sample from ``[n]`` / ``[n, S]`` lengths."""
        ...

    @property
    def step_constant(self) -> float:
        """Cost of a step that holds no sample (launches, the optimizer): added once per batch."""
        ...


@dataclass(frozen=True)
class LinearCost:
    """Cost ``L`` per sample (work per token: linear layers, embedding lookups)."""

    name: str = "linear"

    def sample_costs(self, lengths: Any) -> torch.Tensor:
        return total_lengths(lengths)

    @property
    def step_constant(self) -> float:
        return 0.0


@dataclass(frozen=True)
class AttentionCost:
    """Cost ``L**2`` per sample (full self-attention over the merged sequence)."""

    name: str = "attention"

    def sample_costs(self, lengths: Any) -> torch.Tensor:
        return total_lengths(lengths).square()

    @property
    def step_constant(self) -> float:
        return 0.0


@dataclass(frozen=True)
class MixCost:
    """Calibrated step time: ``a * sum(L) + b * sum(L**2) + c`` for a batch (in ``units``).

    ``c`` was fitted at one batch size (``meta["batch_size"]``), so it folds in the per-sample work that does
    not depend on L (dense features, heads). Balancers compare batches of equal sample counts, where that
    part is the same on every rank; the simulator adds ``c`` once per step, which is conservative (it makes
    ratios larger than scaling ``c`` with the batch would).
    """

    a: float
    b: float
    c: float
    units: str = "ms"
    meta: dict[str, Any] = field(default_factory=dict)
    name: str = "mix"

    def __post_init__(self) -> None:
        for k in ("a", "b", "c"):
            v = getattr(self, k)
            if not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"MixCost.{k} must be a finite number, got {v!r}")
        if self.a < 0 or self.b < 0:
            raise ValueError(
                f"MixCost needs a >= 0 and b >= 0 (costs grow with length), got {self.a}, {self.b}"
            )

    def sample_costs(self, lengths: Any) -> torch.Tensor:
        t = total_lengths(lengths)
        return self.a * t + self.b * t.square()

    @property
    def step_constant(self) -> float:
        return float(self.c)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> MixCost:
        """Reads a fitted file (``{"a", "b", "c", "units", ...}``; other keys are kept in ``meta``)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read cost file {p}: {e}") from e
        if not isinstance(data, dict) or not all(k in data for k in ("a", "b", "c")):
            raise ValueError(f"cost file {p} must be a JSON object with keys a, b, c")
        meta = {k: v for k, v in data.items() if k not in ("a", "b", "c", "units")}
        return cls(float(data["a"]), float(data["b"]), float(data["c"]), str(data.get("units", "ms")), meta)

    def to_json(self, path: str | os.PathLike) -> None:
        """Writes the fit atomically (temp file + rename): a reader never sees half a file."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        body = {"a": self.a, "b": self.b, "c": self.c, "units": self.units, **self.meta}
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_mix_cost(
    sum_len: Any,
    sum_len2: Any,
    times: Any,
    *,
    units: str = "ms",
    meta: dict[str, Any] | None = None,
    constant: bool = True,
) -> tuple[MixCost, float]:
    """Least-squares fit of ``times ~ a * sum_len + b * sum_len2 + c`` over N measured batches.

    Args:
        sum_len: ``[N]`` sum of merged lengths of each batch.
        sum_len2: ``[N]`` sum of squared merged lengths of each batch.
        times: ``[N]`` measured step times.
        constant: fit ``c``; ``False`` fits ``a * sum_len + b * sum_len2`` through the origin (``c = 0``):
            how much of the step time the lengths explain on their own.

    Returns:
        The fitted :class:`MixCost` (negative a or b, which noise can give when a term is negligible, are
        refitted with that term removed) and the fit's R**2 on the N points (against the mean time, also
        without a constant, so that both fits are scored alike).
    """
    x1, x2, y = (torch.as_tensor(v, dtype=torch.float64).flatten() for v in (sum_len, sum_len2, times))
    n = y.numel()
    if not (x1.numel() == x2.numel() == n):
        raise ValueError(f"fit_mix_cost: sum_len, sum_len2 and times must have one entry per batch, got "
                         f"{x1.numel()}, {x2.numel()}, {n}")  # fmt: skip
    if n < 3:
        raise ValueError(f"fit_mix_cost needs >= 3 batches, got {n}")
    if not bool(torch.isfinite(torch.stack([x1, x2, y])).all()):
        raise ValueError("fit_mix_cost: inputs hold NaN or inf")
    # Scale columns to unit size before solving: sum(L^2) is ~1e4 x sum(L), which would hurt the conditioning.
    cols = {"a": x1, "b": x2}
    coef = _lstsq(cols, y, constant)
    for k in ("a", "b"):
        if coef[k] < 0:  # a term the data cannot see: drop it rather than report a negative cost
            coef = _lstsq({j: v for j, v in cols.items() if j != k}, y, constant)
            coef[k] = 0.0
    pred = coef["a"] * x1 + coef["b"] * x2 + coef["c"]
    ss_res = float((y - pred).square().sum())
    ss_tot = float((y - y.mean()).square().sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    model = MixCost(coef["a"], coef["b"], coef["c"], units, {**(meta or {}), "r2": r2, "n_batches": n})
    return model, r2


def _lstsq(cols: dict[str, torch.Tensor], y: torch.Tensor, constant: bool = True) -> dict[str, float]:
    names = list(cols)
    scales = [float(cols[k].abs().max()) or 1.0 for k in names]
    ones = [torch.ones_like(y)] if constant else []
    x = torch.stack([cols[k] / s for k, s in zip(names, scales, strict=True)] + ones, dim=1)
    sol = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    out = {k: float(sol[i]) / scales[i] for i, k in enumerate(names)}
    out["c"] = float(sol[-1]) if constant else 0.0
    return out


def default_cost_file() -> Path:
    """The shipped fitted mix cost (``gem_parallel/balance/data/cost_default.json``; its ``device`` and
    ``date`` keys say where and when it was measured)."""
    return Path(__file__).parent / "data" / "cost_default.json"


def get_cost_model(spec: str | os.PathLike | CostModel) -> CostModel:
    """``"linear"``, ``"attention"``, ``"mix"`` (the shipped fit), a path to a fitted JSON, or a model."""
    if not isinstance(spec, str | os.PathLike):
        return spec
    s = str(spec)
    if s == "linear":
        return LinearCost()
    if s == "attention":
        return AttentionCost()
    if s == "mix":
        return MixCost.from_json(default_cost_file())
    if Path(s).suffix == ".json" or Path(s).exists():
        return MixCost.from_json(s)
    raise ValueError(f"unknown cost model {s!r}: use 'linear', 'attention', 'mix' or a path to a fitted JSON")
