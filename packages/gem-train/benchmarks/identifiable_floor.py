"""The identifiable floor of the synthetic dataset's CTR NE, next to its Bayes floor.

The Bayes floor (``true_probs``, :func:`gem_train.evaluation.metrics.ground_truth_ne`) is the NE of a
predictor that knows every hidden quantity of :mod:`gem_train.data.synthetic`, including each user's
idiosyncratic terms of the CTR logit: the ``0.5 * N(0, 1)`` noise part of the user's taste vector (``user_vec
= sum_i w_i cat_vec[interest_i] + 0.5 z``) and the user bias ``user_bias ~ N(0, 0.4^2)``, of which the model
sees only a noisy dense view ``v = user_bias + N(0, 0.4^2)``. When users are rarely repeated these terms
cannot be learned from the user id, so the Bayes floor is out of reach.

The *identifiable floor* is the NE of ``SyntheticBatch.identifiable_probs``: the Bayes prediction of an
oracle that knows the whole hidden world (category and item vectors, item and advertiser qualities, every
user's interests and interest weights, the dense-feature weights) and every feature of the example, but NOT
the user's idiosyncratic terms. Given what it knows, the CTR logit is ``known + r`` with
``r ~ N(0, 0.8^2 0.5^2 |item_vec|^2 / 8 + Var[user_bias | v])`` (``E[user_bias | v] = v / 2``,
``Var = 0.08``; without the view, the prior), and its prediction is ``E[sigmoid(known + r)]`` by
Gauss-Hermite quadrature (:func:`gem_train.data.synthetic.expected_sigmoid`). The script also checks that
the generator's residuals have the variance it states (their mean square over the mean stated variance).

What this floor is, precisely: the floor of a predictor that cannot identify individual users beyond their
declared interests (here: their true interests and weights) and the dense views. It is an approximation,
neither a strict lower nor a strict upper bound on what a trained model can reach:

* the oracle treats the user's taste noise ``z`` as prior noise, but the history reveals some of it (the
  depth of each history action is drawn with probability ``sigmoid(-0.8 + 1.5 user_vec . item_vec / 8)``),
  and so would the user's other impressions; a model exploiting that can go below this "floor";
* users are drawn Zipf(0.6) over ids, so the most frequent users do recur in training and a model with a
  user-id embedding can learn their idiosyncratic terms (also below this "floor");
* on the other hand the oracle knows the exact world (true interests and weights rather than the declared,
  partly dropped ones, the exact item vectors and qualities, the category vectors) which a model must learn
  from finitely many impressions; on that side the floor is optimistic.

The rows are those the trainer evaluates: batches ``0 .. N-1`` of the split, each of ``data.eval_batch_size``
rows (the last one shorter when the split is not a multiple), as
:func:`gem_train.evaluation.evaluate.evaluate_model` reads them with ``train.eval_batches`` (0: the whole
split). For ``base-h200`` that is 16 batches of 2,048 rows of the test split.

    uv run --no-sync python packages/gem-train/benchmarks/identifiable_floor.py --config base-h200 \\
        --model-ne 0.7742 0.7984 --json runs/identifiable_floor.json

Only the CTR task is evaluated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def compute(cfg: Any, batches: int, batch_size: int, split: str = "test", seed: int = 0) -> dict[str, Any]:
    """The floors on batches ``0 .. batches-1`` of ``split`` (``batch_size`` rows each, the last one
    shorter where the split ends)."""
    from gem_train.data.synthetic import SyntheticAds
    from gem_train.evaluation.metrics import ground_truth_ne, normalized_entropy

    ds = SyntheticAds(cfg, seed=seed)
    ident, truth, labels, masks, r2, var = [], [], [], [], [], []
    for i in range(batches):
        sb = ds.get_batch(split, i, batch_size)  # the rows the trainer's evaluation reads
        ident.append(sb.identifiable_probs)
        truth.append(sb.true_probs)
        labels.append(sb.batch.labels.numpy())
        masks.append(sb.batch.label_mask.numpy())
        r2.append(sb.ctr_residual**2)
        var.append(sb.ctr_residual_var)
    y = np.concatenate(labels)[:, 0].astype(np.float64)
    m = np.concatenate(masks)[:, 0].astype(bool)
    floor = ground_truth_ne(truth, labels, masks, ds.spec.tasks)["ctr"]
    return {
        "rows": int(m.sum()),
        "base_rate": float(y[m].mean()),
        "floor_ne": float(floor),
        "identifiable_ne": float(normalized_entropy(np.concatenate(ident)[m], y[m])),
        "residual_var_mean": float(np.concatenate(var).mean()),
        "residual_ms_over_var": float(np.concatenate(r2).mean() / np.concatenate(var).mean()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from gem_train.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="base-h200", help="a shipped config name or a TOML file")
    ap.add_argument(
        "--batches",
        type=int,
        default=None,
        help="evaluation batches (default: the config's train.eval_batches, 0 = the whole split; "
        "base-h200: 16)",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per batch (default: the config's data.eval_batch_size; base-h200: 2048)",
    )
    ap.add_argument("--split", default="test", choices=("test", "valid"))
    ap.add_argument(
        "--seed", type=int, default=None, help="the dataset seed (default: the config's run.seed)"
    )
    ap.add_argument(
        "--model-ne", type=float, nargs="*", default=[0.7742], help="model NEs to compare with the floors"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    ap.add_argument("--override", action="append", default=[], help="config key=value (repeatable)")
    args = ap.parse_args(argv)

    cfg = load_config(args.config, args.override)
    if cfg.data.source != "synthetic":
        raise SystemExit(f"identifiable_floor: {args.config!r} is not a synthetic-data config")
    seed = cfg.run.seed if args.seed is None else args.seed
    bs = cfg.data.eval_batch_size if args.batch_size is None else args.batch_size
    syn_cfg = cfg.data.synthetic
    held_out = syn_cfg.eval_examples if args.split == "test" else syn_cfg.valid_examples
    available = -(-held_out // bs)
    if args.batches is not None:
        batches = args.batches
    else:
        batches = cfg.train.eval_batches if args.split == "test" else cfg.train.valid_batches
    batches = available if batches == 0 else batches
    if not 0 < batches <= available:
        raise SystemExit(
            f"identifiable_floor: {batches} batches requested, the {args.split} split has {available}"
        )

    res = compute(syn_cfg, batches, bs, args.split, seed)
    res = {
        "config": args.config,
        "split": args.split,
        "seed": seed,
        "batches": batches,
        "batch_size": bs,
        **res,
    }
    res["models"] = [
        {
            "ne": ne,
            "gap_to_floor": ne / res["floor_ne"] - 1.0,
            "gap_to_identifiable": ne / res["identifiable_ne"] - 1.0,
        }
        for ne in args.model_ne
    ]

    print(
        f"{args.config}: {args.split} split, {batches} x {bs} rows ({res['rows']}), seed {seed}, "
        f"CTR base rate {res['base_rate']:.4f}; residuals' mean square / stated variance "
        f"{res['residual_ms_over_var']:.3f}"
    )
    print(f"{'':24s} {'NE':>8s}")
    print(f"{'Bayes floor':24s} {res['floor_ne']:8.4f}")
    print(f"{'identifiable floor':24s} {res['identifiable_ne']:8.4f}")
    for mdl in res["models"]:
        print(
            f"model NE {mdl['ne']:.4f}: {100 * mdl['gap_to_floor']:+.2f}% over the floor, "
            f"{100 * mdl['gap_to_identifiable']:+.2f}% over the identifiable floor"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
