"""The built-in synthetic ads dataset: users, ads, behaviour histories, clicks and conversions.

A hidden world (built once from the seed) holds latent taste vectors of users and ads, ad categories and
advertisers, ad quality, user interests and activity. Every example is an impression: a user with a history
(heavy-tailed length: log-normal or Zipf; items mostly from the user's interest categories, popular items more
often: Zipf popularity), a candidate ad, dense features, and labels drawn from a ground-truth model:

    ctr logit = base + taste(user . ad) + ad quality + advertiser quality + user bias
                + recency-weighted share of the history in the ad's category (clicks count double)
                + "clicked this very ad before" + hour-of-day effect
    cvr logit = base + ad quality + advertiser quality + taste + the user's purchase history and propensity
                (P(conversion | click))

The model sees ids (user, ad, category, advertiser, segment, declared interests), noisy dense views of some
latents, and the history (with ``history_categories``, each event's item category as a one-hot
``event_features`` row); the latents themselves stay hidden. ``true_probs`` of each batch are the Bayes
predictions, so the NE of the ground truth on the evaluation split is the floor a model can reach
(:func:`ground_truth_ne`).

Determinism: example batches are pure functions of ``(seed, split, batch index, batch size)``; nothing
depends on the worker or process generating them, which makes the stream resumable from a batch index.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import FeatureSpec, GemBatch, JaggedSequence, SequenceFeature, SparseFeature
from gem_train.config import SyntheticConfig
from gem_train.data.loader import LoadedBatch
from gem_train.data.split import HELD_OUT, Split, check_split
from gem_train.evaluation.metrics import ground_truth_ne  # re-exported: the floor of this dataset's NE

__all__ = [
    "DRIFT_DIRECTIONS",
    "T0",
    "WINDOW_SECONDS",
    "SyntheticAds",
    "SyntheticBatch",
    "expected_sigmoid",
    "ground_truth_ne",
    "history_signals",
]

# The random stream of each split (the codes are part of the data: they never change).
_SPLIT_CODE = {"train": 0, "test": 1, "valid": 2}
_T0 = 1_767_225_600  # 2026-01-01, seconds
_DAY = 86_400
_LATENT = 8  # width of the hidden taste vectors
_N_INTERESTS = 3  # interest categories per user
_N_SEGMENTS = 16
_TASTE_WEIGHT = 0.8  # ctr logit += 0.8 * taste
_USER_TASTE_NOISE = 0.5  # user_vec = interest-weighted category vectors + 0.5 * N(0, 1)
_USER_BIAS_SD = 0.4  # user_bias ~ N(0, 0.4^2)
_BIAS_VIEW_SD = 0.4  # dense[:, 4] = user_bias + N(0, 0.4^2) (a "user click-propensity score")
_BIAS_VIEW_COLUMN = 4
_QUADRATURE_POINTS = 32
WINDOW_SECONDS = 60 * _DAY  # a time window of request times (data.synthetic.window)
T0 = _T0
# Drift (data.synthetic.drift): at u = (request_time - T0) / WINDOW_SECONDS both tasks' base logits shift by
# -drift * u and each CTR term's weight is scaled by (1 + drift * u * d), d per term (fixed: part of the
# data's definition). A teacher trained at small u sees other weights than a student at larger u.
DRIFT_DIRECTIONS = {
    "taste": -0.6,
    "item_quality": 0.5,
    "advertiser_quality": -0.5,
    "user_bias": 0.0,
    "category_share": 0.5,
    "clicked_before": -0.8,
    "hour": 1.0,
}


@dataclass
class SyntheticBatch:
    """A generated batch plus the ground-truth probabilities behind its labels.

    Attributes:
        batch: the model input.
        true_probs: ``[B, T]`` float64, P(label = 1) under the hidden model (cvr: given a click).
        identifiable_probs: ``[B]`` float64, P(click) as predicted by an oracle that knows the whole hidden
            world and every feature but not the user's idiosyncratic terms (the noise part of the taste
            vector, the user bias beyond its dense view): ``E[sigmoid(known + r)]``, ``r ~ N(0,
            ctr_residual_var)``. Its NE is the *identifiable floor* (approximate: a user's history and
            repeated impressions do reveal some of those terms; the oracle's exact world is optimistic).
        ctr_residual: ``[B]`` the idiosyncratic part ``r`` of the true CTR logit (diagnostics and tests).
        ctr_residual_var: ``[B]`` its variance given what the oracle knows.
    """

    batch: GemBatch
    true_probs: np.ndarray
    identifiable_probs: np.ndarray
    ctr_residual: np.ndarray
    ctr_residual_var: np.ndarray


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def expected_sigmoid(
    mean: np.ndarray, var: np.ndarray | float, points: int = _QUADRATURE_POINTS
) -> np.ndarray:
    """``E[sigmoid(mean + sqrt(var) z)]``, ``z ~ N(0, 1)``, elementwise, by Gauss-Hermite quadrature."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(points)
    sd = np.sqrt(np.maximum(np.asarray(var, dtype=np.float64), 0.0))
    x = np.asarray(mean, dtype=np.float64)[..., None] + sd[..., None] * nodes
    return (_sigmoid(x) @ weights) / weights.sum()


def _zipf_index(rng: np.random.Generator, n: int, size: int | tuple[int, ...], s: float) -> np.ndarray:
    """Indices in [0, n) with P(i) ~ 1 / (i + 1)^s, by inverting the continuous power-law CDF."""
    u = rng.uniform(size=size)
    if abs(s - 1.0) < 1e-9:
        x = np.exp(u * math.log(n + 1.0))
    else:
        a = 1.0 - s
        x = (1.0 + u * ((n + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, n - 1).clip(0)


def history_signals(
    item_category: np.ndarray,
    hist_items: np.ndarray,
    hist_actions: np.ndarray,
    starts: np.ndarray,
    ad: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The ground truth's history terms of each example: ``(cat_share [B], clicked_before [B])`` float64.

    ``cat_share``: the recency-weighted share (the last events matter most, clicks count double) of the
    history in the candidate ad's category; ``clicked_before``: 1 where the history holds a click (or deeper)
    on this very ad. ``hist_items``/``hist_actions`` ``[total]`` int64, ``starts`` ``[B + 1]`` offsets,
    ``ad`` ``[B]`` the candidates, ``item_category`` the world's category of each item.
    """
    b = len(ad)
    total = int(starts[-1])
    owner = np.repeat(np.arange(b), np.diff(starts))
    recency = np.ones(total)
    if total:
        rank_from_end = (starts[owner + 1] - 1) - np.arange(total)
        recency = np.exp(-rank_from_end / 8.0)
    same_cat = (item_category[hist_items] == item_category[ad][owner]).astype(np.float64)
    weight = recency * (1.0 + (hist_actions >= 1))
    num = np.bincount(owner, weights=weight * same_cat, minlength=b)
    den = np.bincount(owner, weights=weight, minlength=b)
    cat_share = np.where(den > 0, num / np.maximum(den, 1e-12), 0.0)
    clicked_before = np.zeros(b)
    hit = (hist_items == ad[owner]) & (hist_actions >= 1)
    np.maximum.at(clicked_before, owner[hit], 1.0)
    return cat_share, clicked_before


class SyntheticAds:
    """The synthetic dataset of a :class:`~gem_train.config.SyntheticConfig` and a seed.

    ``spec`` is its :class:`gem_model.FeatureSpec` (give it to the model config);
    ``make_batch(split, index, batch_size)`` builds one deterministic batch.
    """

    def __init__(self, cfg: SyntheticConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.seed = int(seed) if cfg.seed < 0 else cfg.seed  # data.synthetic.seed, else the run's seed
        self.spec = FeatureSpec(
            n_dense=cfg.n_dense,
            sparse=(
                SparseFeature("user_id", cfg.num_users),
                SparseFeature("user_segment", _N_SEGMENTS),
                SparseFeature("user_interests", cfg.num_categories, max_ids=_N_INTERESTS),
                SparseFeature("ad_id", cfg.num_items),
                SparseFeature("ad_category", cfg.num_categories),
                SparseFeature("ad_advertiser", cfg.num_advertisers),
            ),
            sequences=(
                SequenceFeature(
                    "history",
                    cfg.num_items,
                    cfg.num_actions,
                    cfg.max_len,
                    num_event_features=cfg.num_categories if cfg.history_categories else 0,
                ),
            ),
            tasks=("ctr", "cvr"),
        )
        self._build_world()

    def data_identity(self) -> dict[str, Any]:
        """The data is a pure function of the generator's settings and the seed: they are its identity
        (:mod:`gem_train.data.identity`); there is no content beyond them to compare."""
        return {"source": "synthetic", "settings": {"seed": self.seed, **asdict(self.cfg)}, "content": {}}

    # ------------------------------------------------------------------------------------------------------
    # The hidden world
    # ------------------------------------------------------------------------------------------------------

    def _build_world(self) -> None:
        c = self.cfg
        rng = np.random.default_rng([self.seed, 7919])
        n_cat = c.num_categories
        # Category sizes are skewed too: a few big categories, many small ones.
        self.item_category = _zipf_index(rng, n_cat, c.num_items, 0.7)
        self.item_advertiser = rng.integers(0, c.num_advertisers, c.num_items)
        cat_vec = rng.normal(0.0, 1.0, (n_cat, _LATENT))
        self.item_vec = cat_vec[self.item_category] + 0.6 * rng.normal(0.0, 1.0, (c.num_items, _LATENT))
        self.item_quality = rng.normal(0.0, 0.5, c.num_items)
        self.adv_quality = rng.normal(0.0, 0.4, c.num_advertisers)
        # Items of each category, most popular (smallest id: popularity is Zipf over ids) first.
        order = np.argsort(self.item_category, kind="stable")
        self.cat_items = order
        self.cat_start = np.searchsorted(self.item_category[order], np.arange(n_cat + 1))

        self.user_interests = np.stack(
            [_zipf_index(rng, n_cat, c.num_users, 0.5) for _ in range(_N_INTERESTS)], axis=1
        )
        w = rng.dirichlet(np.ones(_N_INTERESTS) * 1.5, c.num_users)
        self.user_interest_w = w
        # What a user's interests predict of their taste; the rest of user_vec is their own.
        self.user_taste_prior = np.einsum("ui,uid->ud", w, cat_vec[self.user_interests])
        self.user_vec = self.user_taste_prior + _USER_TASTE_NOISE * rng.normal(
            0.0, 1.0, (c.num_users, _LATENT)
        )
        self.user_bias = rng.normal(0.0, _USER_BIAS_SD, c.num_users)
        self.user_activity = rng.lognormal(0.0, 0.8, c.num_users)
        self.user_buyer = rng.beta(1.0, 6.0, c.num_users)  # propensity to buy after clicking
        self.dense_w = rng.normal(0.0, 0.3, max(c.n_dense - 5, 0))

    def _items_in(self, rng: np.random.Generator, cats: np.ndarray) -> np.ndarray:
        """One item per entry of ``cats``: Zipf by popularity within the category (empty -> any item)."""
        start, end = self.cat_start[cats], self.cat_start[cats + 1]
        size = end - start
        u = rng.uniform(size=cats.shape)
        pos = (u**3 * np.maximum(size, 1)).astype(np.int64)
        fallback = _zipf_index(rng, self.cfg.num_items, cats.shape, self.cfg.item_zipf_s)
        return np.where(size > 0, self.cat_items[np.minimum(start + pos, len(self.cat_items) - 1)], fallback)

    def _history_lengths(self, rng: np.random.Generator, b: int, activity: np.ndarray) -> np.ndarray:
        c = self.cfg
        if c.history_dist == "lognormal":
            raw = rng.lognormal(c.history_lognormal_mu, c.history_lognormal_sigma, b) * np.sqrt(activity)
        else:
            raw = rng.zipf(c.history_zipf_a, b).astype(np.float64) * np.sqrt(activity)
        lengths = np.floor(raw).astype(np.int64)
        lengths[rng.uniform(size=b) < 0.03] = 0  # new users with no history
        return np.clip(lengths, 0, c.max_len)

    # ------------------------------------------------------------------------------------------------------
    # Batches
    # ------------------------------------------------------------------------------------------------------

    def num_batches(self, split: Split, batch_size: int) -> int | None:
        """Batches per pass: valid/test ``ceil(eval_examples / B)``; train None (endless) or one epoch."""
        if split in HELD_OUT:
            return self.held_out_batches(split, batch_size)
        epoch = self.cfg.train_examples_per_epoch
        return max(1, epoch // batch_size) if epoch else None

    def held_out_batches(self, split: Split, batch_size: int) -> int:
        """Batches of the "test" or "valid" split (the last may be smaller)."""
        return -(-self._held_out_examples(split) // batch_size)

    def _held_out_examples(self, split: Split) -> int:
        return self.cfg.eval_examples if split == "test" else self.cfg.valid_examples

    def get(self, split: Split, index: int, batch_size: int) -> LoadedBatch:
        """Batch ``index`` for the loader (train indices wrap around a finite epoch; the last held-out batch
        is smaller when ``eval_examples`` is not a multiple of the batch size)."""
        sb, index = self._indexed_batch(split, index, batch_size)
        return LoadedBatch(sb.batch, index, sb.true_probs)

    def get_batch(self, split: Split, index: int, batch_size: int) -> SyntheticBatch:
        """The :class:`SyntheticBatch` behind :meth:`get` (same rows: the floors' diagnostics as well)."""
        return self._indexed_batch(split, index, batch_size)[0]

    def _indexed_batch(self, split: Split, index: int, batch_size: int) -> tuple[SyntheticBatch, int]:
        size = batch_size
        if split in HELD_OUT:
            n = self.held_out_batches(split, batch_size)
            if not 0 <= index < n:
                raise IndexError(f"{split} batch {index} out of range ({n} batches)")
            size = min(batch_size, self._held_out_examples(split) - index * batch_size)
        elif (per_epoch := self.num_batches(split, batch_size)) is not None:
            index %= per_epoch
        return self.make_batch(split, index, size), index

    def make_batch(self, split: Split, index: int, batch_size: int) -> SyntheticBatch:
        """Batch ``index`` of ``split`` ("train", "valid" or "test"): a pure function of (seed, split, index,
        size)."""
        check_split(split)
        c = self.cfg
        key = [self.seed, _SPLIT_CODE[split], int(index), int(batch_size)]
        if c.window or c.stream:  # its own random stream (window 0 and stream 0: the data as before)
            key += [7_777, c.window, c.stream]
        rng = np.random.default_rng(key)
        b = batch_size

        user = _zipf_index(rng, c.num_users, b, 0.6)
        request_time = _T0 + c.window * WINDOW_SECONDS + rng.integers(0, WINDOW_SECONDS, b)
        f = self._drift_factors(request_time)
        hour = (request_time % _DAY) / _DAY * 2 * np.pi

        # History: 75% from the user's interests (by interest weight), 25% from global popularity.
        lengths = self._history_lengths(rng, b, self.user_activity[user])
        total = int(lengths.sum())
        owner = np.repeat(np.arange(b), lengths)
        hu = user[owner]
        pick = (rng.uniform(size=total)[:, None] > np.cumsum(self.user_interest_w[hu], axis=1)).sum(axis=1)
        pick = np.minimum(pick, _N_INTERESTS - 1)
        from_interest = self._items_in(rng, self.user_interests[hu, pick])
        from_global = _zipf_index(rng, c.num_items, total, c.item_zipf_s)
        hist_items = np.where(rng.uniform(size=total) < 0.75, from_interest, from_global)
        # Deeper actions (click, cart, buy) on items closer to the user's taste.
        aff = np.einsum("nd,nd->n", self.user_vec[hu], self.item_vec[hist_items]) / _LATENT
        p_deeper = _sigmoid(-0.8 + 1.5 * aff)
        depth = np.zeros(total, dtype=np.int64)
        alive = np.ones(total, dtype=bool)
        for _ in range(c.num_actions - 1):
            alive &= rng.uniform(size=total) < p_deeper
            depth += alive
            p_deeper = p_deeper * 0.5
        hist_actions = np.minimum(depth, c.num_actions - 1)
        # Timestamps: exponential gaps backwards from the request (mean 8 h), oldest first.
        gaps = rng.exponential(8 * 3600.0, total).astype(np.int64) + 1
        starts = np.concatenate(([0], np.cumsum(lengths)))
        # Age of event j = sum of the gaps from j to the end of its user's history (a segmented reverse
        # cumulative sum): C[end of owner] - C[j] with C the running sum of all gaps.
        csum = np.concatenate(([0], np.cumsum(gaps)))
        rev_cum = csum[starts[owner + 1]] - csum[np.arange(total)]
        hist_ts = request_time[owner] - rev_cum

        # Candidate ad: half targeted to an interest, half by global popularity.
        cand_interest = self._items_in(rng, self.user_interests[user, rng.integers(0, _N_INTERESTS, b)])
        cand_global = _zipf_index(rng, c.num_items, b, c.item_zipf_s)
        ad = np.where(rng.uniform(size=b) < 0.5, cand_interest, cand_global)
        ad_cat = self.item_category[ad]
        adv = self.item_advertiser[ad]

        cat_share, clicked_before = history_signals(self.item_category, hist_items, hist_actions, starts, ad)
        buys = np.bincount(owner, weights=(hist_actions >= c.num_actions - 1).astype(np.float64), minlength=b)
        buy_rate = buys / np.maximum(lengths, 1)

        taste = np.einsum("bd,bd->b", self.user_vec[user], self.item_vec[ad]) / np.sqrt(_LATENT)

        # Dense features: noisy views of hidden quantities, time of day, and weakly useful noise.
        dense = np.zeros((b, c.n_dense), dtype=np.float64)
        views = [
            np.log(self.user_activity[user]),
            self.item_quality[ad] + rng.normal(0.0, 0.4, b),  # an "ad quality score"
            np.sin(hour),
            np.cos(hour),
            self.user_bias[user] + rng.normal(0.0, _BIAS_VIEW_SD, b),  # a "user click-propensity score"
        ]
        for j, v in enumerate(views[: c.n_dense]):
            dense[:, j] = v
        if c.n_dense > 5:
            dense[:, 5:] = rng.normal(0.0, 1.0, (b, c.n_dense - 5))
        dense_effect = dense[:, 5:] @ self.dense_w if c.n_dense > 5 else 0.0

        ctr_logit = (
            c.base_ctr_logit
            + f["base"]
            + _TASTE_WEIGHT * f["taste"] * taste
            + f["item_quality"] * self.item_quality[ad]
            + f["advertiser_quality"] * self.adv_quality[adv]
            + f["user_bias"] * self.user_bias[user]
            + 2.0 * f["category_share"] * cat_share
            + 1.0 * f["clicked_before"] * clicked_before
            + 0.4 * f["hour"] * np.sin(hour)
            + dense_effect
        )
        cvr_logit = (
            c.base_cvr_logit
            + f["base"]
            + 0.8 * self.item_quality[ad]
            + 1.0 * self.adv_quality[adv]
            + 0.4 * taste
            + 3.0 * (buy_rate - 0.1)
            + 4.0 * (self.user_buyer[user] - 1.0 / 7.0)
        )
        residual, residual_var = self._ctr_residual(user, ad, taste, views, f)
        identifiable = expected_sigmoid(ctr_logit - residual, residual_var)
        p_ctr, p_cvr = _sigmoid(ctr_logit), _sigmoid(cvr_logit)
        click = rng.uniform(size=b) < p_ctr
        conv = click & (rng.uniform(size=b) < p_cvr)

        segment = self.user_interests[user, 0] % _N_SEGMENTS
        # Declared interests: the true ones, each dropped with prob 0.3 (at least one kept).
        keep = rng.uniform(size=(b, _N_INTERESTS)) > 0.3
        keep[:, 0] |= ~keep.any(axis=1)
        interests = self.user_interests[user]
        n_int = keep.sum(axis=1)

        t = torch.from_numpy
        kjt_lengths = np.concatenate(
            [np.ones(b, np.int64), np.ones(b, np.int64), n_int, np.ones(b, np.int64), np.ones(b, np.int64),
             np.ones(b, np.int64)]
        )  # fmt: skip
        kjt_values = np.concatenate([user, segment, interests[keep], ad, ad_cat, adv]).astype(np.int64)
        sparse = KeyedJaggedTensor(
            keys=self.spec.sparse_names,
            values=t(kjt_values),
            lengths=t(kjt_lengths.astype(np.int64)),
            stride=b,
        )
        history = JaggedSequence(
            offsets=t(starts.astype(np.int64)),
            max_len=max(int(lengths.max()) if b else 0, 1),
            item_ids=t(hist_items.astype(np.int64)),
            action_ids=t(hist_actions.astype(np.int64)),
            timestamps=t(hist_ts.astype(np.int64)),
            # data.synthetic.history_categories: each event's item category, one-hot (no random draw).
            event_features=t(np.eye(c.num_categories, dtype=np.float32)[self.item_category[hist_items]])
            if c.history_categories
            else None,
        )
        labels = np.stack([click, conv], axis=1).astype(np.float32)
        mask = np.stack([np.ones(b, bool), click], axis=1)  # conversions are observed after clicks only
        batch = GemBatch(
            dense=t(dense.astype(np.float32)),
            sparse=sparse,
            sequences={"history": history},
            request_time=t(request_time.astype(np.int64)),
            labels=t(labels),
            label_mask=t(mask),
        )
        return SyntheticBatch(batch, np.stack([p_ctr, p_cvr], axis=1), identifiable, residual, residual_var)

    def _drift_factors(self, request_time: np.ndarray) -> dict[str, np.ndarray | float]:
        """The ground truth's weight factors at each request time (``data.synthetic.drift``): ``"base"`` the
        base-logit shift, every other key a CTR term's multiplier (``[B]`` float64, or scalars without drift,
        so the arithmetic of undrifted data is unchanged)."""
        drift = self.cfg.drift
        if not drift:
            return {"base": 0.0, **dict.fromkeys(DRIFT_DIRECTIONS, 1.0)}
        u = (request_time - _T0) / WINDOW_SECONDS
        out: dict[str, np.ndarray | float] = {"base": -drift * u}
        for term, d in DRIFT_DIRECTIONS.items():
            out[term] = 1.0 + drift * u * d
        return out

    def _ctr_residual(
        self,
        user: np.ndarray,
        ad: np.ndarray,
        taste: np.ndarray,
        views: list[np.ndarray],
        f: dict[str, np.ndarray | float],
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(r, Var[r | known])`` ``[B]``: the users' idiosyncratic part of the CTR logit, given what an
        oracle that cannot identify users knows (their interests and weights, the world, every feature).

        Taste: ``0.8 (user_vec - prior) . item_vec / sqrt(8)`` with ``user_vec - prior = 0.5 z``, so variance
        ``0.8^2 0.5^2 |item_vec|^2 / 8``. Bias: with its noisy view ``v`` a feature (dense column 4), the
        posterior ``N(v s^2 / (s^2 + t^2), s^2 t^2 / (s^2 + t^2))``; without it, the prior ``N(0, s^2)``.
        With drift each part is scaled by its term's factor ``f`` at the example's time."""
        vec = self.item_vec[ad]
        prior_taste = np.einsum("bd,bd->b", self.user_taste_prior[user], vec) / np.sqrt(_LATENT)
        taste_var = (_TASTE_WEIGHT * _USER_TASTE_NOISE) ** 2 * np.einsum("bd,bd->b", vec, vec) / _LATENT
        s2, t2 = _USER_BIAS_SD**2, _BIAS_VIEW_SD**2
        if self.cfg.n_dense > _BIAS_VIEW_COLUMN:
            bias_mean, bias_var = views[_BIAS_VIEW_COLUMN] * s2 / (s2 + t2), s2 * t2 / (s2 + t2)
        else:
            bias_mean, bias_var = np.zeros(len(user)), s2
        ft, fb = f["taste"], f["user_bias"]
        residual = _TASTE_WEIGHT * ft * (taste - prior_taste) + fb * (self.user_bias[user] - bias_mean)
        return residual, np.square(ft) * taste_var + np.square(fb) * bias_var
