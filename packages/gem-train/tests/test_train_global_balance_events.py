"""``exchange_batch`` (the global balancer's all-to-all) on 2 gloo ranks moves each event's side features
(``JaggedSequence.event_features``) with that event: the received batches equal the single-process
reference (the ranks' batches joined, then ``partition_batches``' rows of each rank)."""

from __future__ import annotations

import torch

import gem_model as gm
from gem_model import FeatureSpec, GemBatch, SequenceFeature, SparseFeature
from gem_parallel.testing import run_distributed

B = 6


def _spec() -> FeatureSpec:
    return FeatureSpec(
        n_dense=2,
        sparse=(SparseFeature("user", 40), SparseFeature("tags", 9, max_ids=3)),
        sequences=(
            SequenceFeature("hist", 50, 4, 24, num_event_features=3),
            SequenceFeature("ads", 20, 2, 8),
        ),
    )


def _batch(rank: int) -> GemBatch:
    batch = gm.random_batch(_spec(), B, seed=10 + rank, empty_fraction=0.2)
    hist = batch.sequences["hist"]
    assert hist.event_features is not None
    feats = hist.event_features.clone()
    # Column 0 names the event's sample (rank * 100 + row), column 1 its item: a row that moved without its
    # event shows.
    feats[:, 0] = torch.repeat_interleave(torch.arange(B) + 100 * rank, hist.lengths).float()
    feats[:, 1] = hist.item_ids.float()
    seqs = {**batch.sequences, "hist": gm.JaggedSequence(
        hist.offsets, hist.max_len, hist.item_ids, hist.action_ids, hist.timestamps, feats
    )}  # fmt: skip
    return GemBatch(batch.dense, batch.sparse, seqs, batch.request_time, batch.labels, batch.label_mask)


def _worker(rank: int, world_size: int) -> dict:
    from gem_parallel.balance import GlobalBalancer
    from gem_train.data.balance import concat_batches, sample_lengths
    from gem_train.data.global_balance import exchange_batch, partition_batches

    bal = GlobalBalancer("mix")
    batch = _batch(rank)
    got = exchange_batch(bal, bal.plan(sample_lengths(batch)), batch)
    got.validate(_spec())
    everyone = [_batch(r) for r in range(world_size)]
    want = concat_batches(everyone).select(partition_batches(everyone)[rank])
    out = {}
    for name in ("hist", "ads"):
        g, w = got.sequences[name], want.sequences[name]
        out[name] = (g.offsets, g.item_ids, g.event_features, w.offsets, w.item_ids, w.event_features)
    return out


def test_exchange_batch_moves_event_features_with_their_events() -> None:
    out = run_distributed(__file__, "_worker", world_size=2, timeout_s=240)
    moved = 0
    for rank, o in enumerate(out):
        g_off, g_items, g_feats, w_off, w_items, w_feats = o["hist"]
        assert torch.equal(g_off, w_off) and torch.equal(g_items, w_items)
        assert g_feats is not None and torch.equal(g_feats, w_feats)
        assert torch.equal(g_feats[:, 1], g_items.float())
        moved += int((g_feats[:, 0] // 100 != rank).sum())  # events that came from the other rank
        assert o["ads"][2] is None and o["ads"][5] is None
    # The ranks' batches are unbalanced enough that some events change rank (else the test shows nothing).
    assert moved > 0
