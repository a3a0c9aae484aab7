"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gem_train.metrics import reliability_bins

__all__ = ["plot_curves", "plot_reliability"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_curves(rows: list[dict[str, Any]], out_dir: Path, tasks: tuple[str, ...]) -> list[Path]:
    """``loss.png`` (train loss by step) and ``ne.png`` (train, validation and test NE per task) from metrics
    rows."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    valids = [r for r in rows if r["split"] == "valid"]
    bests = [r for r in rows if r["split"] == "best_eval" and "best_step" in r]
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean BCE over tasks)")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "loss.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for t in tasks:
        pts = [(r["step"], r[f"{t}/ne"]) for r in train if f"{t}/ne" in r]
        if pts:
            ax.plot(*zip(*pts), label=f"train {t}")
        pts = [(r["step"], r[f"{t}/ne"]) for r in valids if f"{t}/ne" in r]
        if pts:
            ax.plot(*zip(*pts), marker=".", linestyle=":", label=f"valid {t}")
        pts = [(r["step"], r[f"{t}/ne"]) for r in evals if f"{t}/ne" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", linestyle="--", label=f"test {t}")
        # The test NE of the best-validation checkpoint, drawn at its step.
        pts = [(r["best_step"], r[f"{t}/ne"]) for r in bests[-1:] if f"{t}/ne" in r]
        if pts:
            ax.plot(*zip(*pts), marker="*", markersize=12, linestyle="none", label=f"test {t}, selected")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("normalized entropy")
    ax.set_title("NE (lower is better; 1 = predicting the base rate)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "ne.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "ne.png")
    return written


def plot_reliability(
    predictions: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, n_bins: int = 10
) -> Path:
    """Reliability diagram: observed rate against mean prediction per bin, one line per task.

    ``predictions`` maps task -> (probabilities [N], labels [N]).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8, label="perfect calibration")
    for task, (p, y) in predictions.items():
        if len(p) == 0:
            continue
        mean_p, rate, count = reliability_bins(p, y, n_bins)
        ok = count > 0
        ax.plot(mean_p[ok], rate[ok], marker="o", label=f"{task} (n={int(count.sum())})")
    ax.set_xlabel("mean predicted probability")
    ax.set_ylabel("observed positive rate")
    ax.set_title("reliability (evaluation split)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
