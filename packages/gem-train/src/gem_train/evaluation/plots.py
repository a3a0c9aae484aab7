"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from gem_train.evaluation.metrics import reliability_bins

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_curves", "plot_ne_comparison", "plot_reliability"]


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(plt: ModuleType, fig: Figure, ax: Axes, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Label, grid and legend ``ax``, write ``fig`` to ``path`` (PNG) and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(rows: list[dict[str, Any]], out_dir: Path, tasks: tuple[str, ...]) -> list[Path]:
    """``loss.png`` (train loss by step) and ``ne.png`` (train, validation and test NE per task, with the
    floor where the data knows it: the ground-truth model's test NE of synthetic data) from metrics rows."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "test"]
    valids = [r for r in rows if r["split"] == "valid"]
    bests = [r for r in rows if r["split"] == "best_test" and "best_step" in r]
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    written.append(_save(plt, fig, ax, out_dir / "loss.png", "step", "loss (mean BCE over tasks)",
                         "training loss"))  # fmt: skip

    fig, ax = plt.subplots(figsize=(6, 4))
    series: tuple[tuple[list[dict[str, Any]], str, dict[str, Any]], ...] = (
        (train, "train", {}),
        (valids, "valid", {"marker": ".", "linestyle": ":"}),
        (evals, "test", {"marker": "o", "linestyle": "--"}),
    )
    for t in tasks:
        color = None  # the task's first line's colour, for its floor
        for split_rows, split, style in series:
            pts = [(r["step"], r[f"{t}/ne"]) for r in split_rows if f"{t}/ne" in r]
            if pts:
                (line,) = ax.plot(*zip(*pts), label=f"{split} {t}", **style)
                color = color or line.get_color()
        # The test NE of the best-validation checkpoint, drawn at its step.
        pts = [(r["best_step"], r[f"{t}/ne"]) for r in bests[-1:] if f"{t}/ne" in r]
        if pts:
            ax.plot(*zip(*pts), marker="*", markersize=12, linestyle="none", label=f"test {t}, selected")
        # The known floor (synthetic data: the hidden model's own NE on the test labels).
        key = f"{t}/ground_truth_ne"
        on_test = [r[key] for r in evals if key in r]
        floors = on_test or [r[key] for r in valids if key in r]
        if floors:
            ax.axhline(
                floors[-1], linestyle="--", linewidth=1.2, color=color or "black",
                label=f"floor {t} (ground truth, {'test' if on_test else 'valid'}) {floors[-1]:.4f}",
            )  # fmt: skip
    ax.axhline(1.0, color="gray", linewidth=0.8)
    written.append(_save(plt, fig, ax, out_dir / "ne.png", "step", "normalized entropy",
                         "NE (lower is better; 1 = predicting the base rate)"))  # fmt: skip
    return written


def plot_reliability(
    predictions: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, n_bins: int = 10
) -> Path:
    """Reliability diagram: observed rate against mean prediction per bin, one line per task, each point
    labelled with its bin's count; below it the examples per bin (log scale), so a point resting on a
    handful of examples is seen as such.

    ``predictions`` maps task -> (probabilities [N], labels [N]).
    """
    plt = _pyplot()
    fig, (ax, counts) = plt.subplots(
        2, 1, figsize=(5.5, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8, label="perfect calibration")
    width = 1.0 / n_bins
    shown = [t for t, (p, _) in predictions.items() if len(p)]
    for k, task in enumerate(shown):
        p, y = predictions[task]
        mean_p, rate, count = reliability_bins(p, y, n_bins)
        ok = count > 0
        (line,) = ax.plot(mean_p[ok], rate[ok], marker="o", label=f"{task} (n={int(count.sum()):,})")
        for x_, y_, c in zip(mean_p[ok], rate[ok], count[ok], strict=True):
            ax.annotate(
                f"{int(c):,}", (x_, y_), textcoords="offset points", xytext=(4, -10), fontsize=7,
                color=line.get_color(),
            )  # fmt: skip
        # Bars side by side within each bin: one per task.
        left = np.arange(n_bins) * width + k * width / max(len(shown), 1)
        counts.bar(
            left, count, width=width / max(len(shown), 1), align="edge", color=line.get_color(),
            alpha=0.7, label=task,
        )  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("observed positive rate")
    ax.set_title("reliability (evaluation split); labels: examples per bin")
    ax.grid(alpha=0.3)
    ax.legend()
    counts.set_yscale("log")
    counts.set_xlabel("mean predicted probability (bins of width " + f"{width:g})")
    counts.set_ylabel("examples")
    counts.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_ne_comparison(
    curves: dict[str, list[tuple[int, float]]], floor: float | None, path: Path, task: str = "ctr"
) -> Path:
    """One PNG of the test NE of ``task`` by step for several runs (e.g. precision recipes), with the
    synthetic data's ground-truth NE floor drawn (``floor``: None draws none).

    ``curves`` maps a run's label to its ``(step, NE)`` points.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in curves.items():
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=f"{label}: test {task} NE (last {pts[-1][1]:.4f})")
    if floor is not None:
        ax.axhline(
            floor, color="black", linestyle="--", linewidth=1.0, label=f"ground-truth floor {floor:.4f}"
        )
        ax.axhline(floor * 1.03, color="gray", linestyle=":", linewidth=0.8, label="floor + 3%")
    return _save(plt, fig, ax, path, "step", f"test {task} NE", f"test {task} NE by recipe")
