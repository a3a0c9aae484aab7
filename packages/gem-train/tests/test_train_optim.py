"""RowWiseAdagrad and the learning-rate schedule against reference computations written out here."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gem_train.loop.optim import RowWiseAdagrad, lr_factor


def _reference_rowwise_adagrad(
    w0: torch.Tensor, grads: list[torch.Tensor], lr: float, eps: float
) -> torch.Tensor:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD in float64, one row at a time: ``s_r += mean_j g_rj^2``,
    ``w_r -= lr * g_r / (sqrt(s_r) + eps)``."""
    w = w0.double().clone()
    s = [0.0] * w.shape[0]
    for g in grads:
        g = g.double()
        for r in range(w.shape[0]):
            s[r] += float((g[r] ** 2).mean())
            w[r] -= lr * g[r] / (math.sqrt(s[r]) + eps)
    return w


def _grads(rows: int, dim: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(steps):
        g = torch.randn(rows, dim, generator=gen) * (1 + 3 * i)  # growing scale: the accumulator matters
        g[i % rows] = 0.0  # a row not looked up this step
        out.append(g)
    return out


def _run(param: nn.Parameter, grads: list[torch.Tensor], lr: float, eps: float) -> None:
    opt = RowWiseAdagrad([param], lr=lr, eps=eps)
    for g in grads:
        param.grad = g.to(param.dtype).reshape(param.shape)
        opt.step()


def test_dense_gradients_match_the_reference():
    w0 = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    grads = _grads(5, 4, 3)
    p = nn.Parameter(w0.clone())
    _run(p, grads, lr=0.1, eps=1e-8)
    # fp32 updates against an fp64 reference: a few fp32 ulps of |w| ~ 1.
    torch.testing.assert_close(
        p.detach().double(), _reference_rowwise_adagrad(w0, grads, 0.1, 1e-8), rtol=1e-6, atol=1e-6
    )
    # Discriminates: element-wise Adagrad (one accumulator per element) ends elsewhere.
    elementwise = nn.Parameter(w0.clone())
    opt = torch.optim.Adagrad([elementwise], lr=0.1, eps=1e-8)
    for g in grads:
        elementwise.grad = g.clone()
        opt.step()
    assert (elementwise.detach() - p.detach()).abs().max() > 1e-2


def test_a_row_without_gradient_stays_put_and_keeps_its_accumulator():
    w0 = torch.randn(3, 2)
    p = nn.Parameter(w0.clone())
    g = torch.tensor([[1.0, -2.0], [0.0, 0.0], [3.0, 1.0]])
    _run(p, [g], lr=0.5, eps=1e-8)
    assert torch.equal(p.detach()[1], w0[1])
    opt_state = RowWiseAdagrad([p], lr=0.5)
    p.grad = g
    opt_state.step()
    acc = opt_state.state[p]["sum"]
    torch.testing.assert_close(acc, torch.tensor([2.5, 0.0, 5.0]))  # mean of the squared row


def test_sparse_gradients_of_an_embedding_bag_match_the_dense_path():
    torch.manual_seed(2)
    table = nn.EmbeddingBag(10, 4, mode="sum", sparse=True)
    dense = nn.Parameter(table.weight.detach().clone())
    w0 = dense.detach().clone()
    opt_sparse = RowWiseAdagrad(table.parameters(), lr=0.05, eps=1e-8)
    opt_dense = RowWiseAdagrad([dense], lr=0.05, eps=1e-8)
    grads = []
    for ids in ([1, 3, 3, 7], [0, 3], [9]):  # a repeated id: its gradient rows are summed (coalesce)
        table.zero_grad()
        out = table(torch.tensor(ids), torch.tensor([0]))
        (out * torch.arange(1.0, 5.0)).sum().backward()
        assert table.weight.grad.is_sparse
        g = table.weight.grad.to_dense()
        grads.append(g)
        opt_sparse.step()
        dense.grad = g.clone()
        opt_dense.step()
    torch.testing.assert_close(table.weight.detach(), dense.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        table.weight.detach().double(),
        _reference_rowwise_adagrad(w0, grads, 0.05, 1e-8),
        rtol=1e-6,
        atol=1e-6,
    )
    untouched = [2, 4, 5, 6, 8]
    assert torch.equal(table.weight.detach()[untouched], w0[untouched])


def test_bf16_table_keeps_an_fp32_accumulator_and_1d_params_are_width_one_tables():
    table = nn.Parameter(torch.randn(4, 8).to(torch.bfloat16))
    vec = nn.Parameter(torch.randn(6))
    opt = RowWiseAdagrad([table, vec], lr=0.1)
    table.grad = torch.randn(4, 8).to(torch.bfloat16)
    vec.grad = torch.randn(6)
    w_vec = vec.detach().clone()
    g_vec = vec.grad.clone()
    opt.step()
    assert opt.state[table]["sum"].dtype == torch.float32 and opt.state[table]["sum"].shape == (4,)
    assert table.dtype == torch.bfloat16
    # Width 1: s = g^2, so each element moves by lr * g / (|g| + eps) = lr * sign(g).
    torch.testing.assert_close(vec.detach(), w_vec - 0.1 * torch.sign(g_vec), rtol=0, atol=1e-6)


def test_rowwise_adagrad_rejects_a_non_positive_lr():
    with pytest.raises(ValueError, match="lr must be > 0"):
        RowWiseAdagrad([nn.Parameter(torch.zeros(2, 2))], lr=0.0)


def _reference_lr(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then a half cosine from 1 (step ``warmup``) to
    ``min_ratio`` (the last step, ``total - 1``)."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - 1 - warmup)
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * min(t, 1.0))) / 2


@pytest.mark.parametrize(
    ("total", "warmup", "min_ratio"), [(100, 10, 0.1), (50, 0, 0.0), (12, 11, 0.5), (1, 0, 0.2)]
)
def test_lr_factor_matches_the_reference_schedule(total, warmup, min_ratio):
    got = [lr_factor(s, total, warmup, min_ratio) for s in range(total)]
    want = [_reference_lr(s, total, warmup, min_ratio) for s in range(total)]
    assert got == pytest.approx(want, abs=1e-12)
    if warmup:
        assert got[0] == pytest.approx(1 / warmup) and got[warmup - 1] == pytest.approx(1.0)
    if total - 1 > warmup:
        assert got[warmup] == pytest.approx(1.0) and got[-1] == pytest.approx(min_ratio)
        assert all(a >= b for a, b in zip(got[warmup:], got[warmup + 1 :]))  # decays monotonically


def test_lr_factor_midpoint_and_past_the_end():
    # Half-way through the decay the cosine is at its mean; steps past the end stay at the floor.
    assert lr_factor(53, 102, 5, 0.2) == pytest.approx(0.6)  # decay over steps 5..101: 53 is half-way
    assert lr_factor(500, 102, 5, 0.2) == pytest.approx(0.2)


def _decay_groups(model, adamw):
    decay, no_decay = adamw.param_groups
    return decay, no_decay, {id(p) for p in decay["params"]}, {id(p) for p in no_decay["params"]}


def test_weight_decay_groups_of_a_gem_model():
    # AdamW decays dense matrices only; biases, norm gains, PMA seeds and sequence-type tokens go to the
    # no-decay group; every embedding table goes to the row-wise Adagrad (never decayed).
    import dataclasses

    import gem_model
    from gem_train.config import OptimConfig
    from gem_train.loop.optim import build_optimizers

    base = gem_model.get_config("tiny")
    spec = dataclasses.replace(
        base.features,
        sequences=(*base.features.sequences, gem_model.SequenceFeature("clicks", 50, 3, 8)),
    )
    model = gem_model.GemModel(dataclasses.replace(base, features=spec, n_layers=1, attention="full"))
    cfg = OptimConfig(weight_decay=0.1)
    adamw, adagrad = build_optimizers(
        model.dense_parameters(), model.sparse_parameters(), cfg, model.no_weight_decay_parameters()
    )
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(adagrad, RowWiseAdagrad)
    decay, no_decay, d_ids, n_ids = _decay_groups(model, adamw)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    tables = {id(p) for p in model.embeddings.parameters()}
    assert {id(p) for g in adagrad.param_groups for p in g["params"]} == tables
    names = dict(model.named_parameters())
    for name, p in names.items():
        leaf = name.rsplit(".", 1)[-1]
        if id(p) in tables:
            assert id(p) not in d_ids | n_ids, name
        elif p.dim() < 2 or leaf in ("seeds", "seq_type"):
            assert id(p) in n_ids, name
        else:
            assert id(p) in d_ids, name
    # Not vacuous: each kind exists in the model.
    no_decay_names = [n for n, p in names.items() if id(p) in n_ids]
    assert any(n.endswith(".bias") for n in no_decay_names)
    assert any("norm" in n and n.endswith(".weight") for n in no_decay_names)
    assert any(n.endswith(".seeds") for n in no_decay_names) and "input.seq_type" in no_decay_names
    assert any(n.endswith("w13.weight") for n, p in names.items() if id(p) in d_ids)
    assert len(d_ids) + len(n_ids) + len(tables) == len(names)


def test_a_gem_run_builds_its_optimizer_with_the_model_s_no_decay_parameters():
    from gem_train.config import load_config
    from gem_train.loop.build import build_run

    run = build_run(
        load_config("tiny-cpu", ["model.overrides.n_layers=1", 'model.overrides.attention="full"'])
    )
    _, _, d_ids, n_ids = _decay_groups(run.model, run.optimizers[0])
    seeds = [p for n, p in run.model.named_parameters() if n.endswith(".seeds")]
    assert seeds and all(id(p) in n_ids and id(p) not in d_ids for p in seeds)


def test_adamw_implementation_fused_on_cuda_only_unless_asked():
    from gem_train.config.schema import OptimConfig
    from gem_train.loop.optim import adamw_fused, build_optimizers

    cpu = [nn.Parameter(torch.randn(3, 4))]
    assert adamw_fused(cpu, "auto") is False  # CPU: foreach, the numbers CPU runs were made with
    assert adamw_fused(cpu, "fused") is True
    assert adamw_fused(cpu, "foreach") is False
    meta_cuda = [nn.Parameter(torch.empty(2, device="meta"))]
    assert adamw_fused(meta_cuda, "auto") is False
    assert adamw_fused([], "auto") is False

    # Fused and foreach AdamW take the same steps (fp32: within float rounding), decay groups included.
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(5, 7, generator=gen)
    b0 = torch.randn(7, generator=gen)
    grads = [(torch.randn(5, 7, generator=gen), torch.randn(7, generator=gen)) for _ in range(4)]
    finals = {}
    for impl in ("fused", "foreach"):
        w, b = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
        (opt,) = build_optimizers([w, b], [], OptimConfig(lr=0.05, weight_decay=0.1, adamw_impl=impl))
        assert opt.defaults["fused"] is (impl == "fused")
        for gw, gb in grads:
            w.grad, b.grad = gw.clone(), gb.clone()
            opt.step()
        finals[impl] = (w.detach().clone(), b.detach().clone())
        assert not torch.equal(finals[impl][0], w0)
    for got, want in zip(finals["fused"], finals["foreach"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 1e9, float("inf")])
def test_clip_grad_norm_matches_torch_on_plain_tensors(max_norm):
    from gem_train.loop.grad_norm import clip_grad_norm

    gen = torch.Generator().manual_seed(2)
    shapes = [(3, 4), (7,), (1,), (2, 3, 5), (0, 4)]  # an empty gradient counts zero
    grads = [torch.randn(s, generator=gen) for s in shapes]
    grads.append(torch.randn(6, generator=gen, dtype=torch.float64))  # a second dtype group
    ours = [g.clone() for g in grads]
    ref = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    got = clip_grad_norm(ours, max_norm)
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    for g, p, g0 in zip(ours, ref, grads, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
        if max_norm >= 1e9:
            assert torch.equal(g, g0)  # no clipping: untouched (coefficient clamped to 1)
    clipped = float(torch.stack([g.double().norm() for g in ours]).norm())
    assert clipped == pytest.approx(min(float(got), max_norm), rel=1e-5)
