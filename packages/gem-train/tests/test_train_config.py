"""The typed config system: shipped configs, overrides, errors naming the key, TOML round trip."""

import importlib.resources
import tomllib

import pytest

from gem_train.cli import main
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


def test_shipped_configs_name_every_toml_file_of_the_folder():
    """The names live apart from the files (the command line lists them without the schema): no drift."""
    folder = importlib.resources.files("gem_train").joinpath("configs")
    files = {f.name.removesuffix(".toml") for f in folder.iterdir() if f.name.endswith(".toml")}
    assert set(SHIPPED_CONFIGS) == files and len(SHIPPED_CONFIGS) == len(files)


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
    # Added to the shipped overrides (tiny-cpu turns on the candidate x history crosses).
    assert cfg.model.overrides == {"cross_item_feature": "ad_id", "cross_like_action": 1, "d_model": 16}
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
        ("train.valid_every=often", "train.valid_every: expected int | 'auto'"),
        ("train.epochs=-1", "train.epochs must be in [0, 100000]"),
        ("train.epochs=inf", "train.epochs must be a finite number"),
        ("train.early_stop_patience=-1", "train.early_stop_patience must be >= 0"),
        ("data.parquet.valid_fraction=1.0", "data.parquet.valid_fraction must be in"),
        ("data.normalize_dense=1", "data.normalize_dense: expected bool"),
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


# Every key of every section, with an out-of-range value: a config error naming the key, exit 2, and no run
# directory (the checks run before anything is created).
OUT_OF_RANGE = [
    ("run.device=gpu", "run.device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got 'gpu'"),
    ("run.seed=-1", r"run.seed must be in [0, 4294967295], got -1"),
    ("run.seed=4294967296", "run.seed must be in [0, 4294967295]"),
    ('run.name="a/b"', "run.name must be letters, digits"),
    ('run.name=""', "run.name must be letters"),
    ('run.out_dir=""', "run.out_dir must name a directory"),
    ("run.cpu_threads=-1", "run.cpu_threads must be in [0, 4096]"),
    ("optim.lr=nan", "optim.lr must be a finite number, got nan"),
    ("optim.lr=inf", "optim.lr must be a finite number, got inf"),
    ("optim.lr=0", "optim.lr must be > 0"),
    ("optim.beta1=2", r"optim.beta1 must be in [0, 1), got 2.0"),
    ("optim.beta2=1", r"optim.beta2 must be in [0, 1)"),
    ("optim.eps=-1", "optim.eps must be > 0, got -1.0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0"),
    ("optim.min_lr_ratio=nan", "optim.min_lr_ratio must be a finite number"),
    ("optim.sparse_lr=-inf", "optim.sparse_lr must be a finite number"),
    ("optim.sparse_eps=0", "optim.sparse_eps must be > 0"),
    ("optim.grad_clip=-1", "optim.grad_clip must be >= 0"),
    ("data.synthetic.history_lognormal_sigma=-1", "history_lognormal_sigma must be in [0, 50], got -1.0"),
    ("data.synthetic.history_lognormal_mu=nan", "history_lognormal_mu must be a finite number"),
    ("data.synthetic.history_zipf_a=1", "data.synthetic.history_zipf_a must be > 1"),
    ("data.synthetic.item_zipf_s=-1", "data.synthetic.item_zipf_s must be in [0, 50]"),
    ("data.synthetic.base_ctr_logit=inf", "data.synthetic.base_ctr_logit must be a finite number"),
    ("data.synthetic.base_cvr_logit=1e9", "data.synthetic.base_cvr_logit must be in [-50, 50]"),
    ("data.synthetic.num_users=0", "data.synthetic.num_users must be > 0"),
    ("data.synthetic.num_items=0", "data.synthetic.num_items must be > 0"),
    ("data.synthetic.num_categories=0", "data.synthetic.num_categories must be > 0"),
    ("data.synthetic.num_advertisers=0", "data.synthetic.num_advertisers must be > 0"),
    ("data.synthetic.num_actions=1", "data.synthetic.num_actions must be >= 2"),
    ("data.synthetic.n_dense=-1", "data.synthetic.n_dense must be >= 0"),
    ("data.synthetic.max_len=0", "data.synthetic.max_len must be > 0"),
    ("data.synthetic.train_examples_per_epoch=-1", "data.synthetic.train_examples_per_epoch must be >= 0"),
    ("data.synthetic.eval_examples=0", "data.synthetic.eval_examples must be > 0"),
    ("data.movielens.max_len=0", "data.movielens.max_len must be > 0"),
    ("data.movielens.eval_fraction=1", r"data.movielens.eval_fraction must be in (0, 1)"),
    ("data.movielens.eval_fraction=nan", "data.movielens.eval_fraction must be a finite number"),
    ("data.movielens.valid_fraction=nan", "data.movielens.valid_fraction must be in"),
    ("data.movielens.like_threshold=6", r"data.movielens.like_threshold must be in [2, 5]"),
    ("data.movielens.max_users=-1", "data.movielens.max_users must be >= 0"),
    ("data.batch_size=0", "data.batch_size must be > 0"),
    ("data.eval_batch_size=-4", "data.eval_batch_size must be > 0"),
    ("data.num_workers=-1", r"data.num_workers must be in [0, 256]"),
    ("model.baseline.embedding_dim=0", "model.baseline.embedding_dim must be > 0"),
    ("model.baseline.hidden=[8, 0]", r"model.baseline.hidden[1] must be > 0"),
    ("model.baseline.dropout=1.0", r"model.baseline.dropout must be in [0, 1)"),
    ("model.gbdt.like_action=-1", "model.gbdt.like_action must be >= 0"),
    ("model.gbdt.threads=0", r"model.gbdt.threads must be in [1, 1024]"),
    ('model.name=""', "model.name must name a gem-model config"),
    ("train.steps=-5", "train.steps must be > 0"),
    ("train.log_every=0", "train.log_every must be > 0"),
    ("train.eval_every=-1", "train.eval_every must be >= 0"),
    ("train.eval_batches=-1", "train.eval_batches must be >= 0"),
    ("train.max_skipped_batches=-1", "train.max_skipped_batches must be >= 0"),
    ("train.peak_flops=nan", "train.peak_flops must be a finite number"),
    ("precision.min_features=-1", "precision.min_features must be >= 0"),
    ("precision.keep_last_blocks=-1", "precision.keep_last_blocks must be >= 0"),
    ("checkpoint.every=-1", "checkpoint.every must be >= 0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last must be > 0"),
    ("parallel.balancer_calibration=0", "parallel.balancer_calibration must be an int >= 1"),
    # Checked against gem-model and the dataset, still before the run directory exists.
    ("model.name=huge", "model.name"),
    ("model.overrides.d_model=-8", "model.overrides"),
    ("train.select_task=nope", "train.select_task = 'nope' is not a task"),
    # Asked for explicitly without a validation split; epochs of an endless stream.
    ("data.synthetic.valid_examples=0;train.valid_every=2", "needs a validation split"),
    ("train.epochs=2", "train.epochs = 2 needs a finite training set"),
]


@pytest.mark.parametrize(("override", "message"), OUT_OF_RANGE, ids=[o for o, _ in OUT_OF_RANGE])
def test_out_of_range_values_are_config_errors_before_any_run_directory(tmp_path, capsys, override, message):
    # The override comes last (it wins; ";" separates several); one step, so a value that slipped through
    # fails fast.
    argv = [
        "train",
        "train.progress_bar=false",
        "train.steps=1",
        f"run.out_dir={tmp_path}",
        *override.split(";"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gem-train: config error: ") and message in err, err
    assert not any(tmp_path.iterdir())  # no run directory left behind


def test_config_directory_and_negative_counts_are_usage_errors(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path)]) == 2
    assert f"config '{tmp_path}' is a directory" in capsys.readouterr().err
    for argv in (["eval", "--checkpoint", str(tmp_path), "--batches", "-1"], ["bench", "--steps", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "must be >=" in capsys.readouterr().err
