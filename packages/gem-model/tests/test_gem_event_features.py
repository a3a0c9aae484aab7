"""Per-event dense side features (``JaggedSequence.event_features``): validation, row alignment, the model's
projection, FLOPs and the state dict."""

import dataclasses

import pytest
import torch

import gem_model as gm
from gem_model import FeatureSpec, GemBatch, GemModel, JaggedSequence, SequenceFeature, SparseFeature

F = 5


def _spec(n_features: int = F) -> FeatureSpec:
    # "hist" carries F event features, "ads" none: both kinds in one batch.
    return FeatureSpec(
        n_dense=3,
        sparse=(SparseFeature("user", 50), SparseFeature("ad", 20, max_ids=3)),
        sequences=(
            SequenceFeature("hist", 100, 4, 16, num_event_features=n_features),
            SequenceFeature("ads", 30, 2, 8),
        ),
    )


def _with_hist(batch: GemBatch, **changes) -> GemBatch:
    hist = dataclasses.replace(batch.sequences["hist"], **changes)
    return dataclasses.replace(batch, sequences={**batch.sequences, "hist": hist})


def test_spec_and_random_batch():
    with pytest.raises(ValueError, match="num_event_features"):
        SequenceFeature("h", 10, 2, 4, num_event_features=-1)
    spec = _spec()
    batch = gm.random_batch(spec, 8, seed=1)
    batch.validate(spec)
    hist, ads = batch.sequences["hist"], batch.sequences["ads"]
    assert hist.event_features is not None and hist.event_features.shape == (hist.total, F)
    assert ads.event_features is None
    # The features are drawn after the sequence's other fields: those are the F = 0 spec's.
    plain = gm.random_batch(_spec(0), 8, seed=1)
    assert plain.sequences["hist"].event_features is None
    assert torch.equal(plain.sequences["hist"].item_ids, hist.item_ids)
    assert torch.equal(plain.sequences["hist"].timestamps, hist.timestamps)


def test_validate_rejects_bad_event_features():
    spec = _spec()
    batch = gm.random_batch(spec, 8, seed=2)
    feats = batch.sequences["hist"].event_features
    assert feats is not None and feats.shape[0] > 1
    nan = feats.clone()
    nan[1, 2] = float("nan")
    inf = feats.clone()
    inf[0, 0] = float("inf")
    cases = {
        "shape": feats[:, :-1],
        "rows": feats[:-1],
        "1-D": feats[:, 0],
        "float": feats.double(),
        "int": feats.to(torch.int64),
        "NaN": nan,
        "inf": inf,
        "missing": None,
    }
    for why, bad in cases.items():
        with pytest.raises(ValueError, match=r"GemBatch\.sequences\['hist'\]\.event_features"):
            _with_hist(batch, event_features=bad).validate(spec)
            pytest.fail(f"accepted event_features with a wrong {why}")
    # Features on a sequence whose spec has none.
    ads = batch.sequences["ads"]
    extra = dataclasses.replace(ads, event_features=torch.zeros(ads.total, 1))
    with pytest.raises(ValueError, match=r"sequences\['ads'\]\.event_features.*must be None"):
        dataclasses.replace(batch, sequences={**batch.sequences, "ads": extra}).validate(spec)


def _tagged(batch: GemBatch) -> GemBatch:
    """Column 0 of every event-feature row = that event's item id: misaligned rows become visible."""
    hist = batch.sequences["hist"]
    assert hist.event_features is not None
    feats = hist.event_features.clone()
    feats[:, 0] = hist.item_ids.to(torch.float32)
    return _with_hist(batch, event_features=feats)


def test_select_to_pin_keep_rows_aligned():
    spec = _spec()
    batch = _tagged(gm.random_batch(spec, 9, seed=3))
    sub = batch.select([7, 0, 3, 3])
    sub.validate(spec)
    for b in (sub, sub.to("cpu")):
        h = b.sequences["hist"]
        assert h.event_features is not None
        assert torch.equal(h.event_features[:, 0], h.item_ids.to(torch.float32))
    # Each selected user's rows are that user's rows, in order.
    src = batch.sequences["hist"]
    h = sub.sequences["hist"]
    for k, i in enumerate([7, 0, 3, 3]):
        a, b = int(src.offsets[i]), int(src.offsets[i + 1])
        c, d = int(h.offsets[k]), int(h.offsets[k + 1])
        assert torch.equal(h.event_features[c:d], src.event_features[a:b])
    if torch.cuda.is_available():
        pinned = batch.pin_memory().sequences["hist"]
        assert pinned.event_features is not None and pinned.event_features.is_pinned()


def test_record_stream_skips_missing_features():
    seq = JaggedSequence(
        torch.zeros(2, dtype=torch.int64), 1, *(torch.zeros(0, dtype=torch.int64) for _ in range(3))
    )
    assert seq.event_features is None
    if torch.cuda.is_available():  # record_stream needs CUDA tensors
        seq.to("cuda").record_stream(torch.cuda.current_stream())


def _config(n_features: int) -> gm.GemConfig:
    return dataclasses.replace(
        gm.get_config("tiny"),
        features=_spec(n_features),
        embedding_dim=8,
        n_layers=1,
        attention="full",
        n_experts=1,
    )


def test_model_uses_event_features_and_state_dict():
    cfg, plain_cfg = _config(F), _config(0)
    torch.manual_seed(0)
    model = GemModel(cfg)
    proj = model.input.event_proj["hist"]
    assert proj.weight.shape == (8, F) and proj.bias is None
    assert any(p is proj.weight for p in model.dense_parameters())
    # Without event features the state dict is the one before the feature existed.
    plain = GemModel(plain_cfg)
    model.eval(), plain.eval()  # no dropout: outputs compared exactly
    extra = set(model.state_dict()) - set(plain.state_dict())
    assert extra == {"input.event_proj.hist.weight"}
    assert set(plain.state_dict()) == set(model.state_dict()) - extra
    assert not any("event_proj" in k for k in plain.state_dict())

    batch = gm.random_batch(cfg.features, 6, seed=4)
    loss = gm.multitask_loss(model.train()(batch), batch)[0]
    model.eval()
    loss.backward()
    assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0
    # Zero weights = the F = 0 model with the same other weights (same output, bit for bit).
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k not in extra})
    with torch.no_grad():
        with_feats = model(batch)
        proj.weight.zero_()
        zeroed = model(batch)
    without = plain(_with_hist(batch, event_features=None))
    for task in with_feats:
        torch.testing.assert_close(zeroed[task], without[task], atol=0, rtol=0)
        assert not torch.allclose(with_feats[task], without[task], atol=1e-4)
    # The features, not only the weights, reach the output: other rows, other logits.
    with torch.no_grad():
        proj.weight.normal_()
        a = model(batch)
        b = model(_with_hist(batch, event_features=1.0 - batch.sequences["hist"].event_features))
    assert not torch.allclose(a["ctr"], b["ctr"], atol=1e-4)
    with pytest.raises(ValueError, match="event features"):
        model(_with_hist(batch, event_features=None))


def test_flops_count_the_projection(loss_backward_flops):
    cfg = _config(F)
    model = GemModel(cfg)
    batch = gm.random_batch(cfg.features, 6, seed=6)
    assert gm.flops(cfg, batch) == loss_backward_flops(model, batch)
    # The difference to F = 0: forward 2*total*F*E plus the weight gradient (same), no input gradient.
    total = batch.sequences["hist"].total
    plain = gm.flops(_config(0), _with_hist(batch, event_features=None))
    assert gm.flops(cfg, batch) - plain == 2 * 2 * total * F * cfg.embedding_dim
