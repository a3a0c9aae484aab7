"""Where a trained model's CTR loss above the identifiable oracle sits, by slices of the synthetic data.

:mod:`identifiable_floor` says how far a model is from the floor; this script says where the distance is. For
each row of a held-out split it computes the model's expected log loss under the true probability ``t``
(``E_y~t[-log q(y)]``: no label noise, so a slice of a few hundred rows is already readable) and the same for
the identifiable oracle (``SyntheticBatch.identifiable_probs``), and reports their difference, the *excess*,
by slices of what the ground truth depends on:

- ``history_len``: the number of earlier events;
- ``category_share``: the ground truth's recency-weighted share of the history in the candidate's category
  (:func:`gem_train.data.synthetic.history_signals`; 0 when the user never saw that category);
- ``clicked_before``: whether the history holds a click on this very ad;
- ``ad_id`` and ``user_id``: ids are popularity ranks (Zipf over ids), so id ranges are frequency bands.

For each slice: its rows, its share of the whole excess, and the mean KL (nats) from the truth of the model
and of the oracle. It also prints the correlation of the model's logit error (against the oracle) with the
ground truth's history terms: a negative one with ``category_share`` means the model under-weights it.

    uv run --no-sync python packages/gem-train/benchmarks/excess_by_slice.py --run RUN_DIR \\
        [--checkpoint best] [--split valid] [--batches 8] [--json out.json]

``RUN_DIR`` is a ``gem-train train`` run on ``data.source = "synthetic"`` (its ``config.toml`` is read);
CPU, one thread: ~1 minute for 8,192 rows of ``tiny``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gem_train.checkpoint import load_checkpoint
from gem_train.config.toml_io import load_config
from gem_train.data.synthetic import SyntheticAds, history_signals
from gem_train.loop.build import build_run

SLICES: dict[str, list[float]] = {
    "history_len": [0, 1, 5, 10, 20, 40, 1e9],
    "category_share": [0, 1e-9, 0.1, 0.3, 0.6, 1.01],
    "clicked_before": [0, 0.5, 1.5],
    "ad_id": [0, 50, 200, 1000, 1e9],
    "user_id": [0, 100, 1000, 5000, 1e9],
}


def _expected_log_loss(q: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``[N]`` float64: ``E_{y ~ Bernoulli(t)}[-log q(y)]``."""
    q = np.clip(q, 1e-7, 1 - 1e-7)
    return -(t * np.log(q) + (1 - t) * np.log(1 - q))


def collect(run_dir: Path, checkpoint: str, split: str, batches: int) -> dict[str, np.ndarray]:
    """The model's CTR probabilities and the rows' truths and slice keys (``[N]`` arrays), on the CPU."""
    cfg = load_config(run_dir / "config.toml", ["run.device=cpu", "run.cpu_threads=1"])
    if cfg.data.source != "synthetic":
        raise SystemExit(f"{run_dir}: data.source is {cfg.data.source!r}; this script needs synthetic data")
    run = build_run(cfg, training=False)
    load_checkpoint(run_dir / "checkpoints" / checkpoint, run.model, None, restore_rng=False)
    model = run.model.eval()
    source = run.source
    assert isinstance(source, SyntheticAds)
    parts: list[dict[str, np.ndarray]] = []
    with torch.inference_mode():
        for i in range(batches):
            sb = source.make_batch(split, i, cfg.data.eval_batch_size)
            b = sb.batch
            history = b.sequences["history"]
            offsets = history.offsets.numpy()
            ad = b.sparse["ad_id"].values().numpy()
            share, clicked = history_signals(
                source.item_category, history.item_ids.numpy(), history.action_ids.numpy(), offsets, ad
            )
            parts.append({
                "model": torch.sigmoid(model(b)["ctr"].float()).numpy().astype(np.float64),
                "truth": sb.true_probs[:, 0],
                "oracle": sb.identifiable_probs,
                "label": b.labels[:, 0].numpy().astype(np.float64),
                "history_len": np.diff(offsets).astype(np.float64),
                "category_share": share,
                "clicked_before": clicked,
                "ad_id": ad.astype(np.float64),
                "user_id": b.sparse["user_id"].values().numpy().astype(np.float64),
            })  # fmt: skip
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def summarise(d: dict[str, np.ndarray]) -> dict[str, Any]:
    """Expected NEs of truth, oracle and model, and the excess by slice (see the module docstring)."""
    base = float(d["label"].mean())
    entropy = -(base * np.log(base) + (1 - base) * np.log(1 - base))
    own = _expected_log_loss(d["truth"], d["truth"])
    kl_model = _expected_log_loss(d["model"], d["truth"]) - own
    kl_oracle = _expected_log_loss(d["oracle"], d["truth"]) - own
    excess = kl_model - kl_oracle
    out: dict[str, Any] = {
        "rows": len(excess),
        "expected_ne": {
            "truth": float(own.mean() / entropy),
            "oracle": float((own + kl_oracle).mean() / entropy),
            "model": float((own + kl_model).mean() / entropy),
        },
        "slices": {},
        "logit_error_correlation": {},
    }
    for name, edges in SLICES.items():
        rows = []
        for lo, hi in itertools.pairwise(edges):
            m = (d[name] >= lo) & (d[name] < hi)
            if m.any():
                rows.append({
                    "range": [lo, hi], "rows": int(m.sum()),
                    "share_of_excess": float(excess[m].sum() / excess.sum()),
                    "kl_model": float(kl_model[m].mean()), "kl_oracle": float(kl_oracle[m].mean()),
                })  # fmt: skip
        out["slices"][name] = rows
    logit = np.log(np.clip(d["model"], 1e-7, 1)) - np.log(np.clip(1 - d["model"], 1e-7, 1))
    logit_oracle = np.log(d["oracle"]) - np.log(1 - d["oracle"])
    for name in ("category_share", "clicked_before", "history_len"):
        out["logit_error_correlation"][name] = float(np.corrcoef(logit - logit_oracle, d[name])[0, 1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a gem-train run directory (synthetic data)")
    ap.add_argument("--checkpoint", default="best", help="a checkpoint under RUN/checkpoints (default best)")
    ap.add_argument("--split", default="valid", choices=("valid", "test"))
    ap.add_argument("--batches", type=int, default=8, help="held-out batches of data.eval_batch_size rows")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args()
    s = summarise(collect(args.run, args.checkpoint, args.split, args.batches))
    ne = s["expected_ne"]
    print(f"{s['rows']} {args.split} rows; expected CTR NE: truth {ne['truth']:.4f}, identifiable oracle "
          f"{ne['oracle']:.4f}, model {ne['model']:.4f}")  # fmt: skip
    print(f"{'slice':<16} {'range':<16} {'rows':>6} {'excess share':>13} {'KL model':>9} {'KL oracle':>9}")
    for name, rows in s["slices"].items():
        for r in rows:
            lo, hi = r["range"]
            span = f"[{lo:g}, {'inf' if hi >= 1e9 else f'{hi:g}'})"
            print(f"{name:<16} {span:<16} {r['rows']:>6} {r['share_of_excess']:>13.2f} {r['kl_model']:>9.4f} "
                  f"{r['kl_oracle']:>9.4f}")  # fmt: skip
    for name, c in s["logit_error_correlation"].items():
        print(f"correlation of the model's logit error with {name}: {c:+.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(s, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
