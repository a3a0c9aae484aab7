"""Model building: gem-model config overrides checked by key, the baseline, a gem-precision recipe."""

import pytest
import torch

import gem_precision
from gem_model import multitask_loss
from gem_train.config import ConfigError, load_config
from gem_train.data.synthetic import SyntheticAds
from gem_train.loop.model import build_gem_config, build_model

SMALL = ["data.synthetic.max_len=8", "data.synthetic.num_users=200", "data.synthetic.num_items=100"]


def _setup(*extra):
    cfg = load_config("tiny-cpu", [*SMALL, *extra])
    return cfg, SyntheticAds(cfg.data.synthetic, 0)


def test_overrides_reach_the_gem_config_and_features_come_from_the_data():
    cfg, ds = _setup("model.overrides.d_model=48", 'model.overrides.attention="full"')
    gc = build_gem_config(cfg.model, ds.spec)
    assert gc.d_model == 48 and gc.attention == "full" and gc.features == ds.spec


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.overrides.d_modle=48", "unknown config key 'model.overrides.d_modle'"),
        ("model.overrides.d_model=4.5", "model.overrides.d_model: expected int"),
        ('model.overrides.attention="sparse"', "model.overrides.attention"),
        ("model.name=huge", "model.name: unknown GEM config 'huge'"),
    ],
)
def test_override_errors_name_the_key(override, message):
    cfg, ds = _setup(override)
    with pytest.raises(ConfigError, match=message):
        build_gem_config(cfg.model, ds.spec)


def test_same_seed_same_weights_and_baseline_runs():
    cfg, ds = _setup()
    a = build_model(cfg.model, ds.spec, torch.device("cpu"), seed=3).model
    b = build_model(cfg.model, ds.spec, torch.device("cpu"), seed=3).model
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    cfg, ds = _setup("model.arch=mlp")
    mlp = build_model(cfg.model, ds.spec, torch.device("cpu"), seed=0)
    batch = ds.make_batch("train", 0, 16).batch
    loss, _ = multitask_loss(mlp.model(batch), batch)
    loss.backward()
    assert mlp.flops is None and torch.isfinite(loss)
    assert all(p.grad is not None for p in mlp.model.parameters())


def test_precision_recipe_converts_linears_and_keeps_parameter_names():
    from gem_train.loop.build import build_model_for
    from gem_train.loop.distributed import DistInfo

    cfg, ds = _setup("precision.recipe=mxfp8", "precision.min_features=16")
    plain = build_model(cfg.model, ds.spec, torch.device("cpu"), seed=0).model
    # The run's own path: gem-parallel's parallelize applies the recipe (training or evaluation alike).
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    conv = build_model_for(cfg, ds.spec, one, training=False).built.model
    assert build_model_for(cfg, ds.spec, one, training=True).module is not None
    n = sum(isinstance(m, gem_precision.MXFP8Linear) for m in conv.modules())
    assert n > 0
    assert list(plain.state_dict()) == list(conv.state_dict())  # checkpoints stay compatible
    batch = ds.make_batch("train", 0, 8).batch
    loss, _ = multitask_loss(conv(batch), batch)
    loss.backward()
    assert torch.isfinite(loss)


def test_baseline_dropout_acts_in_training_only():
    cfg, ds = _setup("model.arch=mlp", "model.baseline.dropout=0.5")
    mlp = build_model(cfg.model, ds.spec, torch.device("cpu"), seed=0).model
    assert sum(isinstance(m, torch.nn.Dropout) for m in mlp.modules()) == len(cfg.model.baseline.hidden)
    batch = ds.make_batch("train", 0, 16).batch
    mlp.eval()
    a, b = mlp(batch)["ctr"], mlp(batch)["ctr"]
    assert torch.equal(a, b)  # no dropout at evaluation
    mlp.train()
    assert not torch.equal(mlp(batch)["ctr"], a)
    # Without dropout the layers (and a checkpoint's parameter names) are the ones before the option.
    cfg, ds = _setup("model.arch=mlp")
    plain = build_model(cfg.model, ds.spec, torch.device("cpu"), seed=0).model
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    assert [k for k in plain.state_dict() if k.startswith("mlp.")] == [
        "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "mlp.4.weight", "mlp.4.bias",
    ]  # fmt: skip


def test_target_attention_and_history_objective_train_through_the_loop(tmp_path, small_config):
    """The issue-35 options reach the model from the TOML overrides, and the trainer's step adds the model's
    auxiliary loss (the logged loss is above the tasks' mean BCE by that weighted loss)."""
    from gem_train.loop.trainer import Trainer

    on = ('model.overrides.target_item_feature="ad_id"', "model.overrides.history_action_weight=0.5")
    cfg = small_config(tmp_path, *on, "train.steps=2", "checkpoint.every=0")
    gc = build_gem_config(cfg.model, SyntheticAds(cfg.data.synthetic, 0).spec)
    assert gc.target_item_feature == "ad_id" and gc.history_action_weight == 0.5
    trainer = Trainer(cfg)
    model = trainer.built_run.model
    batch = SyntheticAds(cfg.data.synthetic, 0).make_batch("train", 0, 16).batch
    out = model.train()(batch)
    loss, per_task = multitask_loss(out, batch)
    aux = per_task["aux/history_action"]
    assert float(aux) > 0 and torch.isclose(loss, (per_task["ctr"] + per_task["cvr"]) / 2 + aux)
    result = trainer.fit()
    assert result.status == "completed" and result.final_eval is not None
    assert set(result.final_eval.tasks) == {"ctr", "cvr"}


def test_history_crosses_train_through_the_loop(tmp_path, small_config):
    """The crosses option reaches the model from the TOML overrides (a bad feature name is a ConfigError), and
    a run with it trains and evaluates."""
    from gem_train.loop.trainer import Trainer

    on = ('model.overrides.cross_item_feature="ad_id"', "model.overrides.cross_like_action=1")
    cfg = small_config(tmp_path, *on, "train.steps=2", "checkpoint.every=0")
    gc = build_gem_config(cfg.model, SyntheticAds(cfg.data.synthetic, 0).spec)
    assert gc.has_crosses and gc.cross_item_feature == "ad_id" and gc.cross_attribute_feature is None
    trainer = Trainer(cfg)
    crosses = trainer.built_run.model.input.crosses
    assert crosses is not None and crosses.proj.in_features == 6
    result = trainer.fit()
    assert result.status == "completed" and result.final_eval is not None
    off, ds = _setup('model.overrides.cross_item_feature=""')  # TOML has no null: "" is None
    assert not build_gem_config(off.model, ds.spec).has_crosses
    bad, _ = _setup('model.overrides.cross_item_feature="ad_category"')
    with pytest.raises(ConfigError, match=r"model\.overrides: GemConfig\.cross_item_feature 'ad_category'"):
        build_gem_config(bad.model, SyntheticAds(bad.data.synthetic, 0).spec)
