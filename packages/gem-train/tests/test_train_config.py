"""The typed config system: shipped configs, overrides, errors naming the key, TOML round trip."""

import tomllib

import pytest

from gem_train.config import (
    SHIPPED_CONFIGS,
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dumps_toml,
    load_config,
    parse_override,
)


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_shipped_configs_load_and_round_trip(name):
    cfg = load_config(name)
    assert isinstance(cfg, TrainConfig)
    again = config_from_dict(TrainConfig, tomllib.loads(dumps_toml(config_to_dict(cfg))))
    assert again == cfg


def test_default_is_tiny_cpu():
    cfg = load_config()
    assert cfg.run.name == "tiny-cpu" and cfg.model.name == "tiny" and cfg.data.source == "synthetic"


def test_overrides_typed_and_dotted():
    cfg = load_config(
        "tiny-cpu",
        ["train.steps=7", "optim.lr=3e-4", "data.synthetic.history_dist=zipf", "model.overrides.d_model=16"],
    )
    assert cfg.train.steps == 7
    assert cfg.optim.lr == 3e-4
    assert cfg.data.synthetic.history_dist == "zipf"
    assert cfg.model.overrides == {"d_model": 16}
    # An int where a float is expected is accepted and converted.
    assert load_config("tiny-cpu", ["optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stepz=5", "unknown config key 'train.stepz'"),
        ("trian.steps=5", "unknown config key 'trian'"),
        ("train.steps=1.5", "train.steps: expected int"),
        ("train.steps=true", "train.steps: expected int"),
        ("train.steps=many", "train.steps: expected int"),
        ("optim.lr=fast", "optim.lr: expected float"),
        ("train.progress_bar=1", "train.progress_bar: expected bool"),
        ("data.source=criteo", "data.source: expected one of"),
        ("data.synthetic=3", "data.synthetic: expected a table"),
        ("train.steps=0", "train.steps must be > 0"),
        ("optim.min_lr_ratio=2.0", "optim.min_lr_ratio"),
        ("data.movielens.valid_fractoin=0.1", "unknown config key 'data.movielens.valid_fractoin'"),
        ("data.movielens.valid_fraction=high", "data.movielens.valid_fraction: expected float"),
        ("data.movielens.valid_fraction=-0.1", "data.movielens.valid_fraction must be in"),
        ("data.movielens.valid_fraction=0.9", "with eval_fraction"),
        ("train.valid_every=-1", "train.valid_every must be >= 0"),
        ("train.valid_every=1.5", "train.valid_every: expected int"),
        ("train.valid_batches=-2", "train.valid_batches must be >= 0"),
        ("train.select_task=3", "train.select_task: expected str"),
        ('train.select_task=""', "train.select_task must name a task"),
        ("data.synthetic.valid_examples=-1", "data.synthetic.valid_examples must be >= 0"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config("tiny-cpu", [override])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("train.steps")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not a shipped config"):
        load_config("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_file_config_with_unknown_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[run]\nname = "x"\n[optim]\nlearning_rate = 0.1\n')
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.learning_rate'"):
        load_config(f)
    f.write_text('[run]\nname = "x"\n[train]\nsteps = 3\n')
    cfg = load_config(f, ["train.steps=4"])
    assert cfg.run.name == "x" and cfg.train.steps == 4
