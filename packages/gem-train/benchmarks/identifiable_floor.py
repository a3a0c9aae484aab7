"""The identifiable floor of the synthetic dataset's CTR NE, next to its Bayes floor.

The Bayes floor (``true_probs``, :func:`gem_train.metrics.ground_truth_ne`) is the NE of a predictor that
knows every hidden quantity of :mod:`gem_train.data.synthetic`, including each user's idiosyncratic terms of
the CTR logit: the ``0.5 * N(0, 1)`` noise part of the user's taste vector (``user_vec = sum_i w_i
cat_vec[interest_i] + 0.5 z``) and the user bias ``user_bias ~ N(0, 0.4^2)``, of which the model sees only
a noisy dense view ``v = user_bias + N(0, 0.4^2)``. When users are rarely repeated these terms cannot be
learned from the user id, so the Bayes floor is out of reach.

The *identifiable floor* is the NE of the Bayes prediction of an oracle that knows the whole hidden world
(category and item vectors, item and advertiser qualities, categories, every user's interests and interest
weights, the dense-feature weights) and every feature of the example, but NOT the user's idiosyncratic
terms. Given what it knows, the CTR logit is ``known + eps`` with

    known = base + 0.8 * (sum_i w_i cat_vec[interest_i]) . item_vec / sqrt(8) + item quality
            + advertiser quality + E[user_bias | v] + 2 cat_share + clicked_before + 0.4 sin(hour)
            + dense effect,
    eps ~ N(0, 0.8^2 * 0.5^2 * |item_vec|^2 / 8 + Var[user_bias | v]),

``E[user_bias | v] = v * 0.4^2 / (0.4^2 + 0.4^2) = v / 2`` and ``Var[user_bias | v] = 0.08`` (no view when
``n_dense < 5``: mean 0, variance 0.16). Its prediction is ``E[sigmoid(known + eps)]``, by Gauss-Hermite
quadrature. Putting the true ``eps`` back must reproduce ``true_probs``: the script checks it to 1e-9 (which
also checks the recomputation of every term from the batch and the world).

How: the generator draws nothing new for this. The history terms (``cat_share``, ``clicked_before``), the hour
and the ids are recomputed from the batch of ``SyntheticAds.get`` and the world arrays (the history terms by
the generator's own :func:`gem_train.data.synthetic.history_signals`). Two things the outputs do not hold
exactly are read back from the random streams by wrapping ``np.random.default_rng`` while the world and each
batch are built (recording every ``normal`` draw): the category vectors (``SyntheticAds`` keeps only
``item_vec`` and ``user_vec``; checked by rebuilding both exactly) and the float64 dense draws (the batch
stores them as float32; checked against it).

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
rows (the last one shorter when the split is not a multiple), exactly as
:func:`gem_train.evaluation.evaluate_model` reads them with ``train.eval_batches`` (0: the whole split).
For ``base-h200`` that is 16 batches of 2,048 rows of the test split.

    uv run --no-sync python packages/gem-train/benchmarks/identifiable_floor.py --config base-h200 \\
        --model-ne 0.7742 0.7984 --json runs/identifiable_floor.json

Only the CTR task is evaluated.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

# Constants of the hidden model (gem_train.data.synthetic), repeated here; the reproduction check below
# fails if the terms built from them drift from the data generator's.
TASTE_WEIGHT = 0.8  # ctr logit += 0.8 * taste
USER_NOISE_SD = 0.5  # user_vec = interest-weighted category vectors + 0.5 * N(0, 1)
BIAS_SD = 0.4  # user_bias ~ N(0, 0.4^2)
BIAS_VIEW_SD = 0.4  # dense[:, 4] = user_bias + N(0, 0.4^2)
BIAS_VIEW_COLUMN = 4
N_VIEWS = 5  # dense columns 0..4 are views; the rest are noise features with weights dense_w
REPRODUCE_TOL = 1e-9


class _RecordingRng:
    """A ``numpy.random.Generator`` that records the output of every ``normal`` call (everything else is
    passed through), so that the float64 Gaussian draws of the data generator (the dense features are
    stored as float32) and the hidden category vectors (not kept by ``SyntheticAds``) can be read back."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self.normals: list[np.ndarray] = []

    def normal(self, *args: Any, **kwargs: Any) -> Any:
        x = self._rng.normal(*args, **kwargs)
        self.normals.append(np.asarray(x))
        return x

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rng, name)


@contextlib.contextmanager
def _recording() -> Iterator[list[_RecordingRng]]:
    """Within the block, every ``np.random.default_rng(...)`` returns a :class:`_RecordingRng` (listed)."""
    made: list[_RecordingRng] = []
    real = np.random.default_rng

    def factory(*args: Any, **kwargs: Any) -> _RecordingRng:
        r = _RecordingRng(real(*args, **kwargs))
        made.append(r)
        return r

    with mock.patch.object(np.random, "default_rng", factory):
        yield made


class _World:
    """The dataset plus the hidden parts ``SyntheticAds`` does not keep: the category vectors, hence each
    user's interest-weighted mean taste vector and the noise part of ``user_vec``."""

    def __init__(self, cfg: Any, seed: int) -> None:
        from gem_train.data import synthetic as syn

        with _recording() as made:
            ds = syn.SyntheticAds(cfg, seed=seed)
        (rec,) = made
        c, lat = ds.cfg, syn._LATENT
        cat_vec, item_noise = rec.normals[0], rec.normals[1]
        if cat_vec.shape != (c.num_categories, lat) or item_noise.shape != (c.num_items, lat):
            raise RuntimeError("the world's random stream changed: cannot find the category vectors")
        if not np.array_equal(cat_vec[ds.item_category] + 0.6 * item_noise, ds.item_vec):
            raise RuntimeError("the recovered category vectors do not rebuild item_vec")
        user_mean = np.einsum("ui,uid->ud", ds.user_interest_w, cat_vec[ds.user_interests])
        user_noise = rec.normals[4]
        if user_noise.shape != (c.num_users, lat) or not np.array_equal(
            user_mean + USER_NOISE_SD * user_noise, ds.user_vec
        ):
            raise RuntimeError("user_vec is not the interest-weighted category vectors plus 0.5 N(0, 1)")
        self.ds, self.syn, self.cat_vec, self.user_mean = ds, syn, cat_vec, user_mean


def _ctr_terms(w: _World, split: str, index: int, batch_size: int) -> dict[str, np.ndarray]:
    """The CTR logit of one batch split into what the oracle knows (``known``), the idiosyncratic residual
    (``resid``: known + resid is the true logit) and the residual's variance given the oracle's knowledge
    (``var``); plus ``true_p`` (``true_probs[:, 0]``), ``label`` and ``mask``."""
    ds, syn, c = w.ds, w.syn, w.ds.cfg
    with _recording() as made:
        lb = ds.get(split, index, batch_size)  # what the trainer's evaluation reads
    (rec,) = made
    batch = lb.batch
    b = batch.batch_size
    user = batch.sparse["user_id"].values().numpy().astype(np.int64)
    ad = batch.sparse["ad_id"].values().numpy().astype(np.int64)
    hist = batch.sequences["history"]
    starts = hist.offsets.numpy().astype(np.int64)
    items = hist.item_ids.numpy().astype(np.int64)
    actions = hist.action_ids.numpy().astype(np.int64)
    request_time = batch.request_time.numpy().astype(np.int64)
    hour = (request_time % syn._DAY) / syn._DAY * 2 * np.pi
    adv = ds.item_advertiser[ad]

    cat_share, clicked_before = syn.history_signals(ds.item_category, items, actions, starts, ad)

    # The Gaussian draws of make_batch: the ad-quality view, the user-bias view, the dense noise features.
    n_noise = max(c.n_dense - N_VIEWS, 0)
    expected = [(b,), (b,)] + ([(b, n_noise)] if n_noise else [])
    if [x.shape for x in rec.normals] != expected:
        raise RuntimeError("make_batch's random stream changed: cannot find the dense-feature draws")
    dense32 = batch.dense.numpy().astype(np.float64)
    dense_effect = 0.0
    if n_noise:
        noise = rec.normals[2]
        if not np.allclose(noise, dense32[:, N_VIEWS:], rtol=1e-6, atol=1e-6):
            raise RuntimeError("the recorded dense noise does not match the batch's dense features")
        dense_effect = noise @ ds.dense_w

    ub = ds.user_bias[user]
    prior_var, view_var = BIAS_SD**2, BIAS_VIEW_SD**2
    if c.n_dense > BIAS_VIEW_COLUMN:
        view = ub + rec.normals[1]
        if not np.allclose(view, dense32[:, BIAS_VIEW_COLUMN], rtol=1e-6, atol=1e-6):
            raise RuntimeError("the recorded user-bias view does not match the batch's dense features")
        bias_mean = view * prior_var / (prior_var + view_var)
        bias_var = prior_var * view_var / (prior_var + view_var)
    else:  # the view is not a feature: the prior
        bias_mean, bias_var = np.zeros(b), prior_var

    lat = syn._LATENT
    item_vec = ds.item_vec[ad]
    taste_known = np.einsum("bd,bd->b", w.user_mean[user], item_vec) / np.sqrt(lat)
    taste_noise = np.einsum("bd,bd->b", ds.user_vec[user] - w.user_mean[user], item_vec) / np.sqrt(lat)
    shared = (
        c.base_ctr_logit
        + ds.item_quality[ad]
        + ds.adv_quality[adv]
        + 2.0 * cat_share
        + 1.0 * clicked_before
        + 0.4 * np.sin(hour)
        + dense_effect
    )
    known = shared + TASTE_WEIGHT * taste_known + bias_mean
    resid = TASTE_WEIGHT * taste_noise + (ub - bias_mean)
    # Var[0.8 * (0.5 z) . item_vec / sqrt(8)] = 0.8^2 0.5^2 |item_vec|^2 / 8, z ~ N(0, I_8); plus the bias.
    var = TASTE_WEIGHT**2 * USER_NOISE_SD**2 * np.einsum("bd,bd->b", item_vec, item_vec) / lat + bias_var
    return {
        "known": known,
        "resid": resid,
        "var": var,
        "true_p": lb.true_probs[:, 0],
        "true_probs": lb.true_probs,
        "labels": batch.labels.numpy(),
        "mask": batch.label_mask.numpy(),
    }


def expected_sigmoid(mean: np.ndarray, var: np.ndarray, points: int = 32) -> np.ndarray:
    """``E[sigmoid(mean + sqrt(var) Z)]``, Z ~ N(0, 1), by ``points``-point Gauss-Hermite quadrature."""
    x, wts = np.polynomial.hermite_e.hermegauss(points)
    wts = wts / math.sqrt(2.0 * math.pi)
    z = mean[:, None] + np.sqrt(var)[:, None] * x[None, :]
    return (1.0 / (1.0 + np.exp(-z))) @ wts


def compute(
    cfg: Any, batches: int, batch_size: int, split: str = "test", seed: int = 0, points: int = 32
) -> dict[str, Any]:
    """The floors on batches ``0 .. batches-1`` of ``split`` (``batch_size`` rows each)."""
    from gem_train.metrics import ground_truth_ne, normalized_entropy

    w = _World(cfg, seed)
    known, var, true_p, labels, masks, truth = [], [], [], [], [], []
    max_err = 0.0
    for i in range(batches):
        t = _ctr_terms(w, split, i, batch_size)
        rebuilt = w.syn._sigmoid(t["known"] + t["resid"])
        max_err = max(max_err, float(np.abs(rebuilt - t["true_p"]).max()))
        known.append(t["known"])
        var.append(t["var"])
        true_p.append(t["true_p"])
        labels.append(t["labels"])
        masks.append(t["mask"])
        truth.append(t["true_probs"])
    if not max_err <= REPRODUCE_TOL:
        raise AssertionError(
            f"the recomputed CTR logit does not reproduce true_probs: max |error| {max_err:.3g} > "
            f"{REPRODUCE_TOL:g}"
        )
    y = np.concatenate(labels)[:, 0].astype(np.float64)
    m = np.concatenate(masks)[:, 0].astype(bool)
    p_ident = expected_sigmoid(np.concatenate(known), np.concatenate(var), points)
    floor = ground_truth_ne(truth, labels, masks, ("ctr", "cvr"))["ctr"]
    ident = normalized_entropy(p_ident[m], y[m])
    v = np.concatenate(var)
    return {
        "rows": int(m.sum()),
        "base_rate": float(y[m].mean()),
        "floor_ne": float(floor),
        "identifiable_ne": float(ident),
        "reproduce_max_abs_err": max_err,
        "residual_var_mean": float(v.mean()),
        "quadrature_points": points,
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
    ap.add_argument("--points", type=int, default=32, help="Gauss-Hermite points")
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

    res = compute(syn_cfg, batches, bs, args.split, seed, args.points)
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
        f"CTR base rate {res['base_rate']:.4f}; true_probs reproduced to "
        f"{res['reproduce_max_abs_err']:.1e}"
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
