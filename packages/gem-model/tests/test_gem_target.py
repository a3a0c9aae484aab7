"""Target-aware attention and the autoregressive history objective (gem_model.target) against a per-user
reference in float64; causality (an event's prediction never reads it or anything later); the model with
the option on and off."""

import dataclasses

import pytest
import torch
from torch.nn import functional as F

import gem_model as gm
from gem_kernels.rotary.reference import rotary_reference
from gem_model import FeatureSpec, SequenceFeature, SparseFeature
from gem_model.target import TargetAttention, first_of_timestamp, history_action_loss

LENGTHS = [0, 1, 5, 3, 9, 2]  # ragged: empty, one event, not multiples of anything
D, E, H, DH, A = 16, 8, 2, 4, 5


def _module(num_actions: int = A, seed: int = 0) -> TargetAttention:
    torch.manual_seed(seed)
    m = TargetAttention(D, E, H, DH, num_actions=num_actions, qk_norm=True, rotary_base=100.0)
    m.reset_parameters()
    return m.double()


def _inputs(seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    total, b = sum(LENGTHS), len(LENGTHS)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int64)
    tokens = torch.randn(total, D, generator=g, dtype=torch.float64)
    positions = torch.rand(total, generator=g, dtype=torch.float64) * 20
    items = torch.randn(total, E, generator=g, dtype=torch.float64)
    candidate = torch.randn(b, E, generator=g, dtype=torch.float64)
    return tokens, offsets, positions, items, candidate


def _reference(m: TargetAttention, tokens, offsets, positions, items, candidate):
    """Per user, dense: queries [items; candidate], keys [NONE; events], row i sees keys 0..i."""
    cand_out, hist_logits = [], []
    for u in range(len(LENGTHS)):
        lo, hi = int(offsets[u]), int(offsets[u + 1])
        n = hi - lo
        q_in = torch.cat([items[lo:hi], candidate[u : u + 1]])
        k_in = torch.cat([m.none_token[None], tokens[lo:hi]])
        q_pos = torch.cat([positions[lo:hi], positions.new_zeros(1)])
        k_pos = torch.cat([positions.new_zeros(1), positions[lo:hi]])
        qt = m.item(m.query_norm(q_in))
        q = m.q(qt).view(n + 1, H, DH)
        k, v = m.kv(m.key_norm(k_in)).view(n + 1, 2, H, DH).unbind(1)
        q, k = m.qk_norm.q(q), m.qk_norm.k(k)
        one = torch.tensor([0, n + 1])
        q = rotary_reference(q, one, q_pos, base=100.0)
        k = rotary_reference(k, one, k_pos, base=100.0)
        scores = torch.einsum("ihd,jhd->hij", q, k) / DH**0.5
        visible = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        r = m.out(torch.einsum("hij,jhd->ihd", p, v).reshape(n + 1, H * DH))
        g = F.silu(m.mix(torch.cat([r, qt, r * qt], dim=-1)))
        cand_out.append(g[n])
        hist_logits.append(m.action_head(g[:n]))
    return torch.stack(cand_out), torch.cat(hist_logits)


def test_target_attention_matches_reference_forward_and_backward():
    m = _module()
    inputs = [t.requires_grad_(t.is_floating_point()) for t in _inputs()]
    tokens, offsets, positions, items, candidate = inputs
    cand, logits = m(tokens, offsets, max(LENGTHS), positions, items, candidate, history_logits=True)
    want_cand, want_logits = _reference(m, tokens, offsets, positions, items, candidate)
    # float64 throughout: the kernels' CPU path and the dense reference differ by rounding only.
    torch.testing.assert_close(cand, want_cand, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(logits, want_logits, atol=1e-10, rtol=1e-10)
    g = torch.Generator().manual_seed(3)
    w_c, w_l = torch.randn(cand.shape, generator=g, dtype=cand.dtype), torch.randn(logits.shape, generator=g)
    leaves = [tokens, items, candidate, m.none_token, m.q.weight, m.kv.weight, m.mix.weight]
    got = torch.autograd.grad((cand * w_c).sum() + (logits * w_l.double()).sum(), leaves)
    want = torch.autograd.grad((want_cand * w_c).sum() + (want_logits * w_l.double()).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_candidate_only_path_equals_causal_path():
    """Evaluation (and training without the objective) queries the candidate alone: same output."""
    m = _module()
    tokens, offsets, positions, items, candidate = _inputs(seed=4)
    full, _ = m(tokens, offsets, max(LENGTHS), positions, items, candidate, history_logits=True)
    alone, none = m(tokens, offsets, max(LENGTHS), positions, items, candidate, history_logits=False)
    assert none is None
    torch.testing.assert_close(alone, full, atol=1e-12, rtol=1e-12)


def test_history_prediction_reads_only_earlier_events():
    """Event k's token (its action among it) moves the predictions of later events of its user only."""
    m = _module()
    tokens, offsets, positions, items, candidate = _inputs(seed=5)
    user, k = 4, 3  # the 4th event (index 3) of the user with 9 events
    row = int(offsets[user]) + k
    before_c, before = m(tokens, offsets, 9, positions, items, candidate, history_logits=True)
    changed = tokens.clone()
    changed[row] += 1.0
    after_c, after = m(changed, offsets, 9, positions, items, candidate, history_logits=True)
    moved = (after - before).abs().amax(dim=1) > 1e-9
    lo, hi = int(offsets[user]), int(offsets[user + 1])
    expect = torch.zeros(len(moved), dtype=torch.bool)
    expect[row + 1 : hi] = True  # strictly later events of the same user
    assert torch.equal(moved, expect), (moved.nonzero().flatten().tolist(), (row + 1, hi))
    assert (after_c - before_c).abs().amax(dim=1).gt(1e-9).nonzero().flatten().tolist() == [user]
    assert lo <= row < hi


def test_first_of_timestamp_and_loss():
    ts = torch.tensor([5, 5, 7, 1, 1, 1, 4, 9, 9], dtype=torch.int64)
    offsets = torch.tensor([0, 3, 3, 6, 7, 9])  # sequences of 3, 0, 3, 1, 2 events
    got = first_of_timestamp(ts, offsets)
    want = []
    for u in range(5):
        lo, hi = int(offsets[u]), int(offsets[u + 1])
        want += [j == lo or bool(ts[j] > ts[j - 1]) for j in range(lo, hi)]
    assert got.tolist() == want == [True, False, True, True, False, False, True, True, False]
    assert first_of_timestamp(ts[:0], torch.zeros(3, dtype=torch.int64)).shape == (0,)
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))
    actions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0])
    ce = F.cross_entropy(logits, actions, reduction="none")
    torch.testing.assert_close(history_action_loss(logits, actions, got), ce[got].mean())
    assert history_action_loss(logits, actions, torch.zeros(9, dtype=torch.bool)) == 0


def _spec() -> FeatureSpec:
    return FeatureSpec(
        n_dense=3,
        sparse=(SparseFeature("user", 20), SparseFeature("ad", 50), SparseFeature("ad_cat", 7, max_ids=2)),
        sequences=(SequenceFeature("hist", 50, 4, 16),),
    )


def _config(**changes) -> gm.GemConfig:
    base = dataclasses.replace(gm.get_config("tiny"), features=_spec(), embedding_dim=8)
    return dataclasses.replace(base, **changes)


def test_model_keys_unchanged_when_off_and_aux_loss_when_on():
    off = gm.GemModel(_config())
    on = gm.GemModel(_config(target_item_feature="ad", history_action_weight=0.5))
    keys_off, keys_on = set(off.state_dict()), set(on.state_dict())
    assert not any(k.startswith("target.") for k in keys_off)
    assert keys_off <= keys_on and all(k.startswith("target.") for k in keys_on - keys_off)
    batch = gm.random_batch(_spec(), 6, seed=0)
    out = on.train()(batch)
    assert set(out) == {"ctr", "cvr", "aux/history_action"}
    total, per = gm.multitask_loss(out, batch)
    plain, _ = gm.multitask_loss({t: out[t] for t in ("ctr", "cvr")}, batch)
    torch.testing.assert_close(total, plain + out["aux/history_action"])
    assert "aux/history_action" in per
    total.backward()
    table = dict(on.embeddings.sequences.named_parameters())["embeddings.t_hist_item.weight"]
    ad_rows = batch.sparse["ad"].values()
    assert table.grad is not None and table.grad[ad_rows].abs().sum() > 0  # the candidate reads this table
    assert set(on.eval()(batch)) == {"ctr", "cvr"}


def test_aux_loss_supervises_only_strictly_earlier_prefixes():
    """Through the whole model: changing an event's action never moves its own or an earlier event's
    prediction (the supervised events' predictions read strictly earlier events only)."""
    cfg = _config(target_item_feature="ad", history_action_weight=1.0)
    torch.manual_seed(0)
    model = gm.GemModel(cfg).train()  # float32: the embedding collections return float32
    batch = gm.random_batch(cfg.features, 4, seed=2, length_median=8)
    seq = batch.sequences["hist"]
    captured = []
    model.target.action_head.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
    model(batch)
    user = int(seq.lengths.argmax())
    assert int(seq.lengths[user]) >= 4
    k = int(seq.offsets[user]) + 2  # the third event of the longest history
    seq.action_ids[k] = (seq.action_ids[k] + 1) % cfg.features.sequences[0].num_actions
    model(batch)
    # Rows that do not read the event are recomputed from identical inputs (differences at rounding at
    # most); rows that do read it move by far more than 1e-5.
    moved = (captured[1] - captured[0]).abs().amax(dim=1) > 1e-5
    assert not moved[: k + 1].any() and not moved[int(seq.offsets[user + 1]) :].any()
    assert moved[k + 1 : int(seq.offsets[user + 1])].all()


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_flops_match_flop_counter_with_target(weight, loss_backward_flops):
    cfg = _config(target_item_feature="ad", history_action_weight=weight)
    torch.manual_seed(0)
    model = gm.GemModel(cfg)
    batch = gm.random_batch(cfg.features, 6, seed=6)
    assert gm.flops(cfg, batch) == loss_backward_flops(model, batch)
    assert gm.flops_by_block(cfg, batch)["target"] > 0


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"target_item_feature": "nope"}, "not a sparse feature"),
        ({"target_item_feature": "user"}, "item vocabulary"),
        ({"target_item_feature": "ad_cat"}, "one id per example"),
        ({"history_action_weight": 1.0}, "needs target_item_feature"),
        ({"target_item_feature": "ad", "history_action_weight": -1.0}, ">= 0"),
    ],
)
def test_config_checks(changes, match):
    with pytest.raises(ValueError, match=match):
        _config(**changes)
