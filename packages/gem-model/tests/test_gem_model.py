"""The GEM model on the CPU: shapes, gradients, jagged isolation, FLOPs, training, meta init."""

import dataclasses
from pathlib import Path

import pytest
import torch

import gem_model as gm
from gem_model import FeatureSpec, GemModel, SequenceFeature, SparseFeature


def _config(**changes) -> gm.GemConfig:
    """A small config that exercises every block: 3 attention kinds, 2 sequences, E != d, 2 experts."""
    spec = FeatureSpec(
        n_dense=4,
        sparse=(SparseFeature("user", 40), SparseFeature("ad", 30), SparseFeature("ad_cat", 7, max_ids=3)),
        sequences=(SequenceFeature("hist", 60, 4, 24), SequenceFeature("ads", 20, 3, 12)),
    )
    base = dataclasses.replace(
        gm.get_config("tiny"),
        features=spec,
        embedding_dim=8,
        n_layers=3,
        attention=("full", "window", "block"),
        window=5,
        block_size=8,
        n_experts=2,
    )
    return dataclasses.replace(base, **changes)


def _model(config: gm.GemConfig, seed: int = 0) -> GemModel:
    torch.manual_seed(seed)
    return GemModel(config)


def _loss(model: GemModel, batch: gm.GemBatch) -> torch.Tensor:
    return gm.multitask_loss(model(batch), batch)[0]


def test_forward_shapes_and_dtypes():
    config = _config()
    model = _model(config)
    batch = gm.random_batch(config.features, 6, seed=0)
    logits = model(batch)
    assert list(logits) == list(config.features.tasks)
    for v in logits.values():
        assert v.shape == (6,) and v.dtype == torch.float32 and torch.isfinite(v).all()


def test_logits_are_tensors_of_their_own_with_the_heads_values():
    """FSDP2 warns when a wrapped model returns a view (an in-place op on one would skip its pre-backward
    hook): every task's logits own their memory, in fp32 and under bf16 autocast, and equal the head's
    ``[B, 1]`` output bit for bit."""
    config = _config()
    model = _model(config)
    batch = gm.random_batch(config.features, 5, seed=1)
    for ctx in (torch.autocast("cpu", enabled=False), torch.autocast("cpu", dtype=torch.bfloat16)):
        with ctx:
            logits = model(batch)
        for v in logits.values():
            assert v._base is None and v.dtype == torch.float32
    z = torch.randn(4, config.d_model * 2)
    head = gm.model.TaskHead(z.shape[1], (8,), 1e-5)
    out = head(z)
    assert out._base is None and torch.equal(
        out, head.out(head.dropout(torch.nn.functional.silu(head.hidden[0](head.norm(z))))).squeeze(-1)
    )


def test_blocks_shapes():
    config = _config()
    model = _model(config)
    batch = gm.random_batch(config.features, 5, seed=1)
    pooled, embedded, _ = model.embeddings(batch)
    assert pooled.shape == (5, 3, 8) and pooled.dtype == torch.float32
    assert embedded["hist"][0].shape == (batch.sequences["hist"].item_ids.numel(), 8)
    x = model.input.tokens(batch, pooled)
    s, offsets, max_len, positions = model.input.history(batch, embedded)
    total = sum(seq.item_ids.numel() for seq in batch.sequences.values())
    assert x.shape == (5, config.n_tokens, config.d_model)
    assert (
        s.shape == (total, config.d_model)
        and positions.shape == (total,)
        and positions.dtype == torch.float32
    )
    assert offsets.tolist()[-1] == total and max_len == sum(q.max_len for q in batch.sequences.values())
    layer = model.layers["0"]
    x_sum = layer.x_summary(x)
    s_sum = layer.s_summary(s, offsets, max_len)
    assert x_sum.shape == (5, config.n_sum_tokens, config.d_model)
    assert s_sum.shape == (5, config.n_seq_summary_tokens, config.d_model)
    mixed = layer.mixer(torch.cat([x, s_sum], dim=1))
    assert mixed.shape == x.shape
    assert layer.cross(s, offsets, max_len, torch.cat([x_sum, s_sum], 1)).shape == s.shape
    for name in ("0", "1", "2"):
        out = model.layers[name].attn(s, offsets, max_len, positions)
        assert out.shape == s.shape and out.dtype == torch.float32
        x2, s2 = model.layers[name](x, s, offsets, max_len, positions)
        assert x2.shape == x.shape and s2.shape == s.shape


def test_bf16_autocast_gives_fp32_logits_close_to_fp32():
    config = _config(n_layers=1, attention="window", n_experts=1)
    model = _model(config)
    batch = gm.random_batch(config.features, 4, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch)
    with torch.no_grad():
        fp32 = model(batch)
        other_seed = _model(config, seed=1)(batch)
    # Measured over 4 seeds (model and batch): max |bf16 - fp32| = 2.1e-4 .. 5.2e-4 at logits of |.| <= 0.06
    # (the heads start small). The bound is 4x the worst: 2e-3.
    bound = 2e-3
    for task, v in logits.items():
        assert v.dtype == torch.float32
        torch.testing.assert_close(v, fp32[task], atol=bound, rtol=0.0)
        # The bound discriminates: an all-zero output, or a model built from another seed, is outside it.
        assert fp32[task].abs().max() > 5 * bound
        assert (other_seed[task] - fp32[task]).abs().max() > 5 * bound


@pytest.mark.parametrize("pma_kind", ["softmax", "gdpa"])
def test_gradients_reach_every_parameter(pma_kind):
    config = _config(pma_kind=pma_kind)
    model = _model(config)
    batch = gm.random_batch(config.features, 8, seed=3)
    _loss(model, batch).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.any(p.grad != 0)]
    assert not missing, f"no gradient reaches {missing}"


def test_jagged_isolation_batch_and_padding():
    """A sample's logits do not depend on the other samples of its batch, nor on max_len padding."""
    config = _config()
    model = _model(config).eval()
    batch = gm.random_batch(config.features, 7, seed=4, empty_fraction=0.3)
    full = model(batch)
    for i in (0, 3, 6):
        alone = batch.select([i])
        # Extra padding: a max_len far above the real lengths must change nothing.
        for seq in alone.sequences.values():
            seq.max_len = seq.max_len + 17
        out = model(alone)
        reordered = model(batch.select([i, *[j for j in range(7) if j != i]]))
        for task in full:
            # Same math, different matmul shapes: fp32 summation-order noise only.
            torch.testing.assert_close(out[task][0], full[task][i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(reordered[task][0], full[task][i], atol=1e-5, rtol=1e-5)


def test_empty_histories():
    config = _config(n_experts=1)
    model = _model(config)
    batch = gm.random_batch(config.features, 4, seed=5, empty_fraction=1.0)
    assert all(s.item_ids.numel() == 0 for s in batch.sequences.values())
    loss = _loss(model, batch)
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("changes", [{}, {"pma_kind": "gdpa", "causal": False, "embedding_dim": 32}])
def test_flops_match_flop_counter(changes, loss_backward_flops):
    config = _config(**changes)
    model = _model(config)
    batch = gm.random_batch(config.features, 6, seed=6)
    measured, predicted = loss_backward_flops(model, batch), gm.flops(config, batch)
    # Every op's formula counts the valid pairs of the real lengths (block attention included, partial
    # last blocks too), so the analytic count must agree exactly.
    assert predicted == measured, (predicted, measured)
    by_block = gm.flops_by_block(config, batch)
    assert sum(by_block.values()) == predicted and "layers.2.self_attention" in by_block


def test_attention_pairs():
    assert gm.attention_pairs([3, 0, 1], "full", causal=True, window=0, block_size=4) == 6 + 0 + 1
    assert gm.attention_pairs([3], "full", causal=False, window=0, block_size=4) == 9
    # window 1 causal over 4 tokens: 1 + 2 + 2 + 2
    assert gm.attention_pairs([4], "window", causal=True, window=1, block_size=4) == 7
    assert gm.attention_pairs([4], "window", causal=False, window=1, block_size=4) == 10
    # blocks of 4 over 6 tokens: a full block (10 causal pairs) and a partial one of 2 (3 pairs)
    assert gm.attention_pairs([6], "block", causal=True, window=0, block_size=4) == 13
    assert gm.attention_pairs([6], "block", causal=False, window=0, block_size=4) == 20


def test_multitask_loss_masks():
    config = _config(n_layers=1, attention="full")
    model = _model(config)
    batch = gm.random_batch(config.features, 8, seed=7)
    logits = model(batch)
    loss, per_task = gm.multitask_loss(logits, batch)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    for t, task in enumerate(config.features.tasks):
        m = batch.label_mask[:, t]
        torch.testing.assert_close(per_task[task], bce(logits[task][m], batch.labels[m, t]))
    torch.testing.assert_close(loss, sum(per_task.values()) / 2)
    # Flipping masked-out labels changes nothing; a task with no label leaves the mean.
    flipped = dataclasses.replace(batch, labels=torch.where(batch.label_mask, batch.labels, 1 - batch.labels))
    torch.testing.assert_close(gm.multitask_loss(logits, flipped)[0], loss)
    mask = batch.label_mask.clone()
    mask[:, 1] = False
    only_ctr = gm.multitask_loss(logits, dataclasses.replace(batch, label_mask=mask))
    torch.testing.assert_close(only_ctr[0], per_task["ctr"])


def test_tiny_overfits_fixed_batch():
    config = gm.get_config("tiny")
    model = _model(config)
    # 16 users (histories of up to 48 events): memorised within ~20 Adam steps.
    batch = gm.random_batch(config.features, 16, seed=8, missing_label_rate=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(25):
        loss = _loss(model, batch)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert _loss(model, batch).item() < 0.1 * first


def test_meta_build_and_init_weights():
    config = _config()
    meta = GemModel(config, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for p in meta.parameters():
            p.fill_(float("nan"))
    torch.manual_seed(0)
    meta.init_weights()
    nan = [n for n, p in meta.named_parameters() if not torch.isfinite(p).all()]
    assert not nan, f"init_weights left {nan} uninitialised"
    batch = gm.random_batch(config.features, 4, seed=9)
    assert all(torch.isfinite(v).all() for v in meta(batch).values())
    # Same seed, same init as building on the CPU directly.
    torch.manual_seed(0)
    direct = GemModel(config, device="meta")
    direct.to_empty(device="cpu")
    torch.manual_seed(0)
    direct.init_weights()
    for (n, a), (_, b) in zip(meta.named_parameters(), direct.named_parameters()):
        assert torch.equal(a, b), n


def test_parameter_split_and_counts():
    config = _config()
    model = _model(config)
    sparse = {id(p) for p in model.sparse_parameters()}
    dense = {id(p) for p in model.dense_parameters()}
    assert sparse and dense and not sparse & dense
    assert sparse | dense == {id(p) for p in model.parameters()}
    counts = gm.parameter_counts(config)
    assert counts["sparse"] == sum(p.numel() for p in model.sparse_parameters())
    assert counts["dense"] == sum(p.numel() for p in model.dense_parameters())
    assert counts["total"] == counts["dense"] + counts["sparse"]
    table = 40 * 8 + 30 * 8 + 7 * 8 + (60 + 4 + 20 + 3) * 8
    assert counts["sparse"] == table
    summary = gm.model_summary(config)
    assert "sparse total" in summary and "layers.2 (block)" in summary
    # Layers and experts have stable names for checkpoints and expert parallelism.
    names = dict(model.named_parameters())
    assert "layers.0.mixer.experts.1.fm_y" in names and "layers.2.attn.qkv.weight" in names


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_named_configs_train_a_step(name):
    config = gm.get_config(name)
    model = _model(config)
    batch = gm.random_batch(config.features, 4, seed=10)
    loss = _loss(model, batch)
    loss.backward()
    assert torch.isfinite(loss)


def _readme_table() -> dict[str, dict[str, str]]:
    """The README's table of named configs: config name -> column -> cell."""
    lines = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| config | d_model |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _within_printed_rounding(count: int, cell: str) -> bool:
    """``count`` rounds to ``cell`` ("0.09M", "161.7M", "7.45B"): within half a unit of its last digit."""
    number, unit = cell[:-1], {"M": 1e6, "B": 1e9}[cell[-1]]
    decimals = len(number.split(".")[1]) if "." in number else 0
    return abs(count - float(number) * unit) <= 0.5 * 10.0**-decimals * unit


def test_readme_table_lists_every_named_config():
    assert sorted(_readme_table()) == sorted(gm.CONFIG_NAMES)


@pytest.mark.parametrize("name", gm.CONFIG_NAMES)
def test_readme_table_matches_config_and_parameter_counts(name):
    row, config = _readme_table()[name], gm.get_config(name)
    assert int(row["d_model"]) == config.d_model and int(row["layers"]) == config.n_layers
    assert row["heads × dim"] == f"{config.n_heads} × {config.head_dim}"
    assert int(row["experts"]) == config.n_experts
    assert row["history max_len"] == " + ".join(str(s.max_len) for s in config.features.sequences)
    counts = gm.parameter_counts(config)
    assert _within_printed_rounding(counts["dense"], row["dense params"]), (counts, row)
    assert _within_printed_rounding(counts["sparse"], row["sparse params"]), (counts, row)
    assert counts["total"] == counts["dense"] + counts["sparse"]


def test_printed_rounding_rejects_a_wrong_count():
    assert _within_printed_rounding(89_364, "0.09M") and _within_printed_rounding(7_452_636_002, "7.45B")
    assert not _within_printed_rounding(96_000, "0.09M") and not _within_printed_rounding(7.46e9, "7.45B")


def test_select_subbatch():
    config = _config()
    batch = gm.random_batch(config.features, 6, seed=11)
    sub = batch.select([4, 1])
    sub.validate(config.features)
    h, hs = batch.sequences["hist"], sub.sequences["hist"]
    assert torch.equal(hs.item_ids[: hs.lengths[0]], h.item_ids[h.offsets[4] : h.offsets[5]])
    cat, sub_cat = batch.sparse["ad_cat"], sub.sparse["ad_cat"]
    expected = cat.values()[cat.offsets()[4] : cat.offsets()[5]]
    assert torch.equal(sub_cat.values()[: sub_cat.lengths()[0]], expected)


@pytest.mark.slow
def test_compiled_layers_match_eager():
    """Each layer compiles with torch.compile (the gem_kernels ops have fake implementations)."""
    config = gm.get_config("tiny")
    model = _model(config)
    batch = gm.random_batch(config.features, 8, seed=12)
    eager = model(batch)
    for name, layer in model.layers.items():
        model.layers[name] = torch.compile(layer)
    compiled = model(batch)
    _loss(model, batch).backward()
    for task in eager:
        torch.testing.assert_close(compiled[task], eager[task], atol=1e-5, rtol=1e-5)


def test_cli_prints_summaries(capsys):
    from gem_model.__main__ import main

    main(["tiny"])
    out = capsys.readouterr().out
    assert "== tiny" in out and "dense total" in out


def test_attention_pairs_closed_forms_match_mask_counts():
    # The closed forms against counting the entries of an explicit mask, lengths 0..70 around the
    # window and block sizes.
    def mask_count(n, kind, causal, window, block_size):
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        if kind == "full":
            m = torch.ones(n, n, dtype=torch.bool)
        elif kind == "window":
            m = (j >= i - window) & (j <= i + (0 if causal else window))
        else:
            m = (i // block_size) == (j // block_size)
        if causal:
            m &= j <= i
        return int(m.sum())

    for kind in ("full", "window", "block"):
        for causal in (True, False):
            for window, block in ((0, 1), (1, 4), (7, 16), (64, 64)):
                lengths = [0, 1, 2, window, window + 1, block, block + 1, 70]
                want = sum(mask_count(n, kind, causal, window, block) for n in lengths)
                got = gm.attention_pairs(lengths, kind, causal=causal, window=window, block_size=block)
                assert got == want, (kind, causal, window, block)
    with pytest.raises(ValueError, match="unknown attention kind"):
        gm.attention_pairs([3], "sparse", causal=True, window=0, block_size=4)


def test_ensemble_halves_compose_to_forward():
    # gate_weights + expert_sum is forward, bit for bit; a partial sum over a subset adds up to the whole.
    torch.manual_seed(0)
    config = gm.get_config("tiny")
    layer = gm.GemLayer(config, 0)
    layer.reset_parameters()  # a bare layer is allocated, not initialised
    ens = layer.mixer
    torch.nn.init.normal_(ens.gate.weight)  # a gate that is not uniform
    nn_in = config.n_tokens + config.n_seq_summary_tokens
    x = torch.randn(3, nn_in, config.d_model)
    w = ens.gate_weights(x)
    assert w.shape == (3, config.n_experts) and w.dtype == torch.float32
    assert torch.equal(ens.expert_sum(x, w), ens(x))
    parts = [ens.expert_sum(x, w, [(e, ens.experts[e])]) for e in range(config.n_experts)]
    torch.testing.assert_close(sum(parts), ens(x))


def test_pooled_embeddings_follow_the_feature_names_whatever_the_key_order_of_the_bags():
    # A TorchRec-sharded EmbeddingBagCollection returns its KeyedTensor keys ordered by shard, not by
    # feature: the pooled embeddings must still come out in the spec's feature order.
    from torchrec.sparse.jagged_tensor import KeyedTensor

    config = _config()
    model = _model(config)
    batch = gm.random_batch(config.features, 6, seed=3)
    expected, _, _ = model.embeddings(batch)
    bags = model.embeddings.bags

    class Permuted(torch.nn.Module):
        def forward(self, kjt):
            d = bags(kjt).to_dict()
            keys = list(reversed(list(d)))
            return KeyedTensor.from_tensor_list(keys, [d[k] for k in keys])

    model.embeddings.bags = Permuted()
    got, _, _ = model.embeddings(batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_dropout_is_off_by_default_and_only_active_in_training():
    # Default: no Dropout module at all (so no RNG draw: existing runs compute what they did before).
    assert not any(isinstance(m, torch.nn.Dropout) for m in _model(_config()).modules())
    with pytest.raises(ValueError, match="dropout must lie in"):
        _config(dropout=1.0)
    config = _config(dropout=0.3, embedding_dropout=0.2)
    model = _model(config)
    ref = _model(_config())  # same seed, same weights (dropout has no parameters)
    ref.load_state_dict(model.state_dict())
    # 3 layers + the encoder + 2 task heads.
    assert sum(isinstance(m, torch.nn.Dropout) for m in model.modules()) == 3 + 1 + 2
    batch = gm.random_batch(config.features, 8, seed=1)
    model.eval()
    ref.eval()
    for task, v in model(batch).items():
        torch.testing.assert_close(v, ref(batch)[task], rtol=0, atol=0)
    model.train()
    a, b = model(batch), model(batch)
    assert all(not torch.equal(a[t], b[t]) for t in a)  # a different mask each call
    _loss(model, batch).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
