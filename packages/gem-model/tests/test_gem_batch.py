"""Feature specs, configs, the batch type and the random-batch helper."""

import dataclasses

import pytest
import torch

import gem_model as gm
from gem_model import FeatureSpec, GemBatch, JaggedSequence, SequenceFeature, SparseFeature


def _spec() -> FeatureSpec:
    return FeatureSpec(
        n_dense=3,
        sparse=(SparseFeature("user", 50), SparseFeature("ad", 20, max_ids=3)),
        sequences=(SequenceFeature("hist", 100, 4, 16), SequenceFeature("ads", 30, 2, 8)),
    )


def test_spec_rejects_bad_input():
    with pytest.raises(ValueError, match="num_embeddings"):
        SparseFeature("x", 0)
    with pytest.raises(ValueError, match="name"):
        SparseFeature("a.b", 3)
    with pytest.raises(ValueError, match="max_len"):
        SequenceFeature("s", 3, 3, 0)
    with pytest.raises(ValueError, match="duplicate sparse"):
        FeatureSpec(1, (SparseFeature("a", 2), SparseFeature("a", 3)), (SequenceFeature("s", 3, 3, 3),))
    with pytest.raises(ValueError, match="at least one SequenceFeature"):
        FeatureSpec(1, (), ())
    spec = FeatureSpec(1, [SparseFeature("a", 2)], [SequenceFeature("s", 3, 3, 3)])
    assert isinstance(spec.sparse, tuple) and hash(spec)


@pytest.mark.parametrize("name", gm.CONFIG_NAMES)
def test_named_configs(name):
    config = gm.get_config(name)
    assert [config.attention_kind(i) for i in range(config.n_layers)]
    assert all(config.attention_kind(i) in gm.ATTENTION_KINDS for i in range(config.n_layers))
    assert config.n_tokens == config.n_dense_tokens + len(config.features.sparse)


def test_config_errors_and_replace():
    with pytest.raises(KeyError, match="known configs: tiny"):
        gm.get_config("huge")
    tiny = gm.get_config("tiny")
    with pytest.raises(ValueError, match="unknown kinds"):
        dataclasses.replace(tiny, attention="dense")
    with pytest.raises(ValueError, match="one per layer"):
        dataclasses.replace(tiny, n_layers=3)
    three = dataclasses.replace(tiny, n_layers=3, attention="block")
    assert [three.attention_kind(i) for i in range(3)] == ["block"] * 3
    other = dataclasses.replace(tiny, features=_spec())
    assert other.features.sequence_names == ["hist", "ads"]
    with pytest.raises(ValueError, match="d_model"):
        dataclasses.replace(tiny, d_model=0)


def test_random_batch_valid_and_deterministic():
    spec = _spec()
    a = gm.random_batch(spec, 32, seed=3)
    a.validate(spec)
    b = gm.random_batch(spec, 32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sequences["hist"].timestamps, b.sequences["hist"].timestamps)
    c = gm.random_batch(spec, 32, seed=4)
    assert not torch.equal(a.dense, c.dense)
    assert a.batch_size == 32 and a.labels.shape == (32, 2)


def test_random_lengths_heavy_tailed():
    g = torch.Generator().manual_seed(0)
    n = gm.random_lengths(4000, 1000, generator=g, empty_fraction=0.05)
    assert n.min() == 0 and n.max() == 1000
    assert 0.03 < (n == 0).float().mean() < 0.07
    # Log-normal tail: mean well above the median, a visible share truncated at max_len.
    assert n.float().mean() > 1.1 * n.float().median()
    assert (n == 1000).float().mean() > 0.03


def test_timestamps_oldest_first_and_before_request():
    spec = _spec()
    batch = gm.random_batch(spec, 16, seed=0)
    for seq in batch.sequences.values():
        for i in range(16):
            ts = seq.timestamps[seq.offsets[i] : seq.offsets[i + 1]]
            assert torch.all(ts[1:] >= ts[:-1])
            assert torch.all(ts <= batch.request_time[i])


def _mutated(batch: GemBatch, **changes) -> GemBatch:
    return dataclasses.replace(batch, **changes)


def test_validate_names_the_field():
    spec = _spec()
    batch = gm.random_batch(spec, 8, seed=1)
    hist = batch.sequences["hist"]
    cases = {
        "dense": _mutated(batch, dense=batch.dense.double()),
        "labels": _mutated(batch, labels=batch.labels[:, :1]),
        "label_mask": _mutated(batch, label_mask=batch.label_mask.float()),
        "request_time": _mutated(batch, request_time=batch.request_time[:4]),
        "sequences": _mutated(batch, sequences={"hist": hist}),
        r"sequences\['hist'\].offsets": _mutated(
            batch,
            sequences={**batch.sequences, "hist": dataclasses.replace(hist, offsets=hist.offsets.flip(0))},
        ),
        r"sequences\['hist'\].item_ids": _mutated(
            batch,
            sequences={**batch.sequences, "hist": dataclasses.replace(hist, item_ids=hist.item_ids + 100)},
        ),
        r"sequences\['hist'\].max_len": _mutated(
            batch, sequences={**batch.sequences, "hist": dataclasses.replace(hist, max_len=0)}
        ),
        r"sequences\['hist'\].timestamps": _mutated(
            batch,
            sequences={
                **batch.sequences,
                "hist": dataclasses.replace(hist, timestamps=hist.timestamps.flip(0)),
            },
        ),
    }
    for field, bad in cases.items():
        with pytest.raises(ValueError, match=f"GemBatch.{field}"):
            bad.validate(spec)
    # Sparse ids out of range and wrong keys.
    kjt = batch.sparse
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    big = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() + 1000, lengths=kjt.lengths(), stride=8)
    with pytest.raises(ValueError, match=r"sparse\['user'\]"):
        _mutated(batch, sparse=big).validate(spec)
    swapped = KeyedJaggedTensor(keys=["ad", "user"], values=kjt.values(), lengths=kjt.lengths(), stride=8)
    with pytest.raises(ValueError, match=r"GemBatch\.sparse"):
        _mutated(batch, sparse=swapped).validate(spec)


def test_to_and_pin_memory_roundtrip():
    spec = _spec()
    batch = gm.random_batch(spec, 4, seed=2)
    moved = batch.to("cpu")
    moved.validate(spec)
    assert torch.equal(moved.sequences["ads"].item_ids, batch.sequences["ads"].item_ids)
    assert isinstance(moved.sequences["ads"], JaggedSequence)
    if torch.cuda.is_available():
        pinned = batch.pin_memory()
        assert pinned.dense.is_pinned()


def test_host_lengths_cached_when_built_and_kept():
    """The pooled-id KJT's per-key counts are host lists from construction on, through ``to`` and ``select``,
    and match the device lengths; the sequence KJT's come from shapes."""
    spec = _spec()
    batch = gm.random_batch(spec, 7, seed=4)
    lengths = batch.sparse.lengths().view(len(spec.sparse), 7)
    want = lengths.sum(1).tolist()
    assert batch.sparse._length_per_key == want  # torchrec's cache: length_per_key() reads no tensor
    assert batch.sparse._offset_per_key == [0, want[0], want[0] + want[1]]
    assert batch.to("cpu").sparse._length_per_key == want
    sub = batch.select([6, 0, 3])
    assert sub.sparse._length_per_key == lengths[:, [6, 0, 3]].sum(1).tolist()
    kjt = gm.GemEmbeddings(gm.GemConfig(features=spec)).sequence_kjt(batch)
    totals = [batch.sequences[s].total for s in ("hist", "ads")]
    assert kjt._length_per_key == [totals[0], totals[0], totals[1], totals[1]]
    assert kjt._length_per_key == kjt.lengths().view(4, 7).sum(1).tolist()
    assert kjt._offset_per_key[-1] == kjt.values().numel()
