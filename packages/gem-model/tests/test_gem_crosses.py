"""Candidate x history-aggregate crosses (gem_model.crosses) against a per-example Python reference in
float64 on ragged histories (0, 1 and more events); no leakage (labels and other examples never move an
example's statistics); gradients; FLOPs; the model with the option on and off."""

import dataclasses
import math

import pytest
import torch

import gem_model as gm
from gem_model import FeatureSpec, SequenceFeature, SparseFeature
from gem_model.crosses import CROSS_SMOOTHING, history_cross_stats

LENGTHS = [0, 1, 5, 3, 9, 2, 7]
N_ITEMS, N_ACTIONS, F, LIKE = 6, 5, 4, 2  # a small vocabulary: items and attributes match often


def _reference(items, actions, offsets, cand, like_action, num_actions, ev=None, cand_attr=None, recency=0.0):
    """Per example, plain Python floats: [log1p(n)/4, rate - 0.5, level - 0.5] per group; with ``recency``
    the same again with each event weighted by exp(-rank from the newest / recency), then the match groups'
    shares n_g / n_all, plain then decayed."""
    m, out = CROSS_SMOOTHING, []
    for u in range(len(cand)):
        lo, hi = int(offsets[u]), int(offsets[u + 1])
        events = []
        for j in range(lo, hi):
            a = int(actions[j])
            w_item = 1.0 if int(items[j]) == int(cand[u]) else 0.0
            ws = [1.0, w_item]
            if ev is not None:
                ws.append(sum(float(ev[j, c]) for c in range(ev.shape[1]) if float(cand_attr[u, c]) > 0))
            decay = math.exp(-(hi - 1 - j) / recency) if recency else 1.0
            events.append((ws, 1.0 if a >= like_action else 0.0, a / (num_actions - 1), decay))
        n_groups = 2 + (ev is not None)
        row, shares = [], []
        for decayed in (False, True) if recency else (False,):
            p, q = 0.5, 0.5
            counts = []
            for g in range(n_groups):
                wt = [e[0][g] * (e[3] if decayed else 1.0) for e in events]
                n = sum(wt)
                likes = sum(w * e[1] for w, e in zip(wt, events))
                levels = sum(w * e[2] for w, e in zip(wt, events))
                rate, level = (likes + m * p) / (n + m), (levels + m * q) / (n + m)
                if g == 0:
                    p, q = rate, level  # the match groups shrink towards the user's own rates
                row += [math.log1p(n) / 4, rate - 0.5, level - 0.5]
                counts.append(n)
            shares += [c / counts[0] if counts[0] > 0 else 0.0 for c in counts[1:]]
        out.append(row + (shares if recency else []))
    return torch.tensor(out, dtype=torch.float64)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total, b = sum(LENGTHS), len(LENGTHS)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int64)
    items = torch.randint(0, N_ITEMS, (total,), generator=g)
    actions = torch.randint(0, N_ACTIONS, (total,), generator=g)
    cand = torch.randint(0, N_ITEMS, (b,), generator=g)
    ev = torch.bernoulli(torch.full((total, F), 0.4), generator=g)
    cand_attr = torch.bernoulli(torch.full((b, F), 0.5), generator=g)
    return items, actions, offsets, cand, ev, cand_attr


@pytest.mark.parametrize("with_attributes", [False, True])
def test_stats_match_per_example_reference(with_attributes):
    items, actions, offsets, cand, ev, cand_attr = _inputs()
    kw = {"event_features": ev, "candidate_attributes": cand_attr} if with_attributes else {}
    got = history_cross_stats(items, actions, offsets, cand, like_action=LIKE, num_actions=N_ACTIONS, **kw)
    want = _reference(items, actions, offsets, cand, LIKE, N_ACTIONS,
                      *((ev, cand_attr) if with_attributes else ()))  # fmt: skip
    assert got.dtype == torch.float32 and got.shape == (len(LENGTHS), 3 * (2 + with_attributes))
    # float32 sums of at most 9 small exact values, divisions and one log: ~1e-7 relative.
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    # Not vacuous: some item matches and some attribute matches exist, and the empty history gives the priors.
    assert want[:, 3].gt(0).any() and (not with_attributes or want[:, 6].gt(0).any())
    assert torch.equal(got[0], torch.tensor([0.0, 0.0, 0.0] * (2 + with_attributes)))


@pytest.mark.parametrize("with_attributes", [False, True])
@pytest.mark.parametrize("recency", [0.7, 3.0])
def test_recency_stats_match_per_example_reference(with_attributes, recency):
    items, actions, offsets, cand, ev, cand_attr = _inputs(seed=2)
    kw = {"event_features": ev, "candidate_attributes": cand_attr} if with_attributes else {}
    got = history_cross_stats(items, actions, offsets, cand, like_action=LIKE, num_actions=N_ACTIONS,
                              recency_events=recency, **kw)  # fmt: skip
    want = _reference(items, actions, offsets, cand, LIKE, N_ACTIONS,
                      *((ev, cand_attr) if with_attributes else (None, None)), recency=recency)  # fmt: skip
    g = 2 + with_attributes
    assert got.shape == (len(LENGTHS), 6 * g + 2 * (g - 1))
    # As above, plus exp of ranks <= 8 in float32: ~1e-7 relative.
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
    plain = history_cross_stats(items, actions, offsets, cand, like_action=LIKE, num_actions=N_ACTIONS, **kw)
    assert torch.equal(got[:, : 3 * g], plain)  # the plain statistics come first, unchanged
    # Not vacuous: the decay moves the counts of histories longer than one event; some shares are positive,
    # the item's at most 1 (an attribute match counts once per shared id, so its share may pass 1).
    longer = torch.tensor(LENGTHS) > 1
    assert (want[longer, 3 * g] < want[longer, 0]).all()
    shares = want[:, 6 * g :]
    assert shares.gt(0).any() and shares.ge(0).all() and shares[:, :: g - 1].le(1).all()


def test_stats_of_an_example_read_only_its_own_history():
    """Changing an event of user k moves user k's row only."""
    items, actions, offsets, cand, ev, cand_attr = _inputs(seed=1)
    kw = {"like_action": LIKE, "num_actions": N_ACTIONS}
    kw |= {"event_features": ev, "candidate_attributes": cand_attr}
    before = history_cross_stats(items, actions, offsets, cand, **kw)
    user = 4
    row = int(offsets[user]) + 3
    changed = actions.clone()
    changed[row] = (changed[row] + 3) % N_ACTIONS
    after = history_cross_stats(items, changed, offsets, cand, **kw)
    moved = (after - before).abs().amax(dim=1) > 0
    assert moved.nonzero().flatten().tolist() == [user]


def _spec() -> FeatureSpec:
    return FeatureSpec(
        n_dense=3,
        sparse=(SparseFeature("user", 20), SparseFeature("ad", 12), SparseFeature("ad_cat", 7, max_ids=3)),
        sequences=(SequenceFeature("hist", 12, 4, 16, num_event_features=7),),
    )


def _config(**changes) -> gm.GemConfig:
    base = dataclasses.replace(gm.get_config("tiny"), features=_spec(), embedding_dim=8)
    return dataclasses.replace(base, **changes)


ON = {"cross_item_feature": "ad", "cross_attribute_feature": "ad_cat", "cross_like_action": 2}


def _batch_reference(batch: gm.GemBatch, recency: float = 0.0) -> torch.Tensor:
    seq, b = batch.sequences["hist"], batch.batch_size
    cand = batch.sparse["ad"].values()
    jt = batch.sparse["ad_cat"]
    hot = torch.zeros(b, 7, dtype=torch.float64)
    rows = torch.repeat_interleave(torch.arange(b), jt.lengths())
    hot[rows, jt.values()] = 1.0
    return _reference(seq.item_ids, seq.action_ids, seq.offsets, cand, 2, 4, seq.event_features, hot, recency)


@pytest.mark.parametrize("recency", [0.0, 4.0])
def test_model_stats_forward_and_gradients(recency):
    cfg = _config(**ON, cross_recency_events=recency)
    torch.manual_seed(0)
    model = gm.GemModel(cfg)
    batch = gm.random_batch(cfg.features, 8, seed=3, length_median=6)
    assert batch.sparse["ad_cat"].lengths().gt(1).any()  # multi-id candidates (repeats count once)
    crosses = model.input.crosses
    assert crosses is not None
    stats = crosses.stats(batch)
    assert stats.shape == (8, crosses.proj.in_features) == (8, 22 if recency else 9)
    torch.testing.assert_close(stats.double(), _batch_reference(batch, recency), atol=2e-6, rtol=2e-6)
    assert not stats.requires_grad  # data only
    out = model(batch)
    gm.multitask_loss(out, batch)[0].backward()
    # The projection learns; the statistics feed the first layer's token mix and factorization machine.
    assert crosses.proj.weight.grad is not None and crosses.proj.weight.grad.abs().sum() > 0
    assert crosses.proj.bias.grad is not None
    # The crosses' token changes the predictions: a different projection (a different direction: the token
    # is layer-normed, so a mere rescale would not show) moves the logits far beyond rounding.
    with torch.no_grad():
        crosses.proj.weight.copy_(torch.randn_like(crosses.proj.weight))
    moved = model(batch)
    assert (moved["ctr"] - out["ctr"]).abs().max() > 1e-4


def test_no_leakage_from_labels_or_other_examples():
    """The labels never reach the statistics; an example's logits do not depend on another example's
    history through the crosses (the rest of the model is per-example too)."""
    cfg = _config(**ON)
    torch.manual_seed(0)
    model = gm.GemModel(cfg).eval()
    batch = gm.random_batch(cfg.features, 6, seed=5)
    base = model(batch)["ctr"]
    flipped = dataclasses.replace(batch, labels=1.0 - batch.labels, label_mask=~batch.label_mask)
    torch.testing.assert_close(model(flipped)["ctr"], base, atol=0, rtol=0)
    alone = model(batch.select([2]))["ctr"]
    torch.testing.assert_close(alone, base[2:3], atol=1e-5, rtol=1e-5)


def test_keys_unchanged_when_off():
    off = gm.GemModel(_config())
    on = gm.GemModel(_config(**ON))
    keys_off, keys_on = set(off.state_dict()), set(on.state_dict())
    assert not any("crosses" in k for k in keys_off)
    assert keys_on - keys_off == {"input.crosses.proj.weight", "input.crosses.proj.bias"}
    assert on.input.crosses.proj.in_features == 9 and on.config.n_tokens == off.config.n_tokens + 1
    item_only = gm.GemModel(_config(cross_item_feature="ad"))
    assert item_only.input.crosses.proj.in_features == 6


@pytest.mark.parametrize("changes", [ON, {"cross_item_feature": "ad"}, {**ON, "cross_recency_events": 8}])
def test_flops_match_flop_counter_with_crosses(changes, loss_backward_flops):
    cfg = _config(**changes)
    torch.manual_seed(0)
    model = gm.GemModel(cfg)
    batch = gm.random_batch(cfg.features, 6, seed=6)
    assert gm.flops(cfg, batch) == loss_backward_flops(model, batch)


def test_compiles_without_graph_breaks_and_matches_eager():
    cfg = dataclasses.replace(_config(**ON, cross_recency_events=8.0), n_layers=1, attention="full")
    torch.manual_seed(0)
    model = gm.GemModel(cfg)
    batch = gm.random_batch(cfg.features, 6, seed=1)
    explained = torch._dynamo.explain(model)(batch)
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]
    got = torch.compile(model, backend="aot_eager")(batch)
    want = model(batch)
    for task in want:
        torch.testing.assert_close(got[task], want[task], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"cross_item_feature": "nope"}, "not a sparse feature"),
        ({"cross_item_feature": "user"}, "item vocabulary"),
        ({"cross_attribute_feature": "ad_cat"}, "needs cross_item_feature"),
        ({"cross_item_feature": "ad", "cross_attribute_feature": "user"}, "event-feature column"),
        ({"cross_item_feature": "ad", "cross_attribute_feature": "nope"}, "not a sparse feature"),
        ({"cross_like_action": 0}, r"in \[1, 3\]"),
        ({"cross_like_action": 4}, r"in \[1, 3\]"),
        ({"cross_item_feature": "ad", "cross_recency_events": -1.0}, "finite number >= 0"),
        ({"cross_item_feature": "ad", "cross_recency_events": True}, "finite number >= 0"),
        ({"cross_item_feature": "ad", "cross_recency_events": float("inf")}, "finite number >= 0"),
        ({"cross_recency_events": 8.0}, "needs cross_item_feature"),
    ],
)
def test_config_checks(changes, match):
    with pytest.raises(ValueError, match=match):
        _config(**changes)
