"""Typed run configuration: dataclasses, TOML loading, ``key=value`` overrides, shipped configs.

A run is a config, not a script (torchtitan style). ``load_config`` reads a TOML file (or a shipped config by
name), applies dotted ``key=value`` overrides, and checks every key and type: an unknown key or a value of the
wrong type raises :class:`ConfigError` naming the dotted key.

The ``[model]`` section names a gem-model config (``gem_model.get_config(name)``) and may override its fields
in ``[model.overrides]``; those are checked against ``GemConfig`` when the model is built
(:func:`gem_train.model_factory.build_gem_config`), because the field set belongs to gem-model.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gem_train.data.parquet.config import ParquetConfig  # [data.parquet] (issue 17)

__all__ = [
    "SHIPPED_CONFIGS",
    "BaselineConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "ModelSection",
    "MovieLensConfig",
    "OptimConfig",
    "PrecisionConfig",
    "RunConfig",
    "SyntheticConfig",
    "TrainConfig",
    "TrainerConfig",
    "apply_overrides",
    "check_value",
    "config_from_dict",
    "config_to_dict",
    "dumps_toml",
    "load_config",
    "parse_override",
]

SHIPPED_CONFIGS: tuple[str, ...] = ("tiny-cpu", "movielens", "base-h200", "movielens-parquet")


class ConfigError(ValueError):
    """A bad configuration: the message names the dotted key and what is wrong with it."""


# --------------------------------------------------------------------------------------------------------
# Range checks (each section's validate() uses these; types are checked at load time)
# --------------------------------------------------------------------------------------------------------


def _int_in(key: str, value: int, lo: int, hi: int | None = None) -> None:
    if value < lo or (hi is not None and value > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else (f"> {lo - 1}" if lo == 1 else f">= {lo}")
        raise ConfigError(f"{key} must be {rng}, got {value!r}")


def _real(
    key: str,
    value: float,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    """``value`` must be finite and within the bounds (open or closed)."""
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if below or above:
        if lo is not None and hi is not None:
            rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"{'<' if hi_open else '<='} {hi:g}"
        raise ConfigError(f"{key} must be {rng}, got {value!r}")


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


# --------------------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    """Where and how a run happens."""

    name: str = "run"
    out_dir: str = "runs"  # run directories go to <out_dir>/<name>-<UTC timestamp>
    seed: int = 0
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1", ...
    # Intra-op threads of torch on the CPU (0: torch's default, one per core). 1 by default: the CPU work is
    # many small ops, where extra threads gain little, and OpenMP threads spin-waiting on cores that other
    # processes also use made steps up to 50x slower on a shared 2-core machine (measured).
    cpu_threads: int = 1

    def validate(self, key: str = "run") -> None:
        if not _RUN_NAME.match(self.name):
            raise ConfigError(
                f"{key}.name must be letters, digits, '.', '_', '+' or '-' (it names the run directory), "
                f"got {self.name!r}"
            )
        if not self.out_dir:
            raise ConfigError(f"{key}.out_dir must name a directory, got ''")
        # NumPy's legacy seeding takes [0, 2**32); torch takes any of these.
        _int_in(f"{key}.seed", self.seed, 0, 2**32 - 1)
        if not _DEVICE.match(self.device):
            raise ConfigError(
                f"{key}.device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}"
            )
        _int_in(f"{key}.cpu_threads", self.cpu_threads, 0, 4096)


@dataclass
class BaselineConfig:
    """The plain baseline (``model.arch = "mlp"``): mean-pooled embeddings + dense features -> MLP."""

    embedding_dim: int = 16
    hidden: list[int] = field(default_factory=lambda: [128, 64])  # [] = logistic regression

    def validate(self, key: str = "model.baseline") -> None:
        _int_in(f"{key}.embedding_dim", self.embedding_dim, 1)
        for i, h in enumerate(self.hidden):
            _int_in(f"{key}.hidden[{i}]", h, 1)


@dataclass
class ModelSection:
    """A gem-model named config plus field overrides (checked against ``gem_model.GemConfig``).

    The features of the model always come from the dataset (``FeatureSpec`` of the data source); ``name``
    and ``overrides`` choose the architecture. ``arch = "mlp"`` trains the baseline instead of GEM.
    """

    arch: Literal["gem", "mlp"] = "gem"
    name: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)

    def validate(self, key: str = "model") -> None:
        # The name and the overrides belong to gem-model: checked against it when the run is built
        # (gem_train.model_factory.build_gem_config), still before the run directory exists.
        if not self.name:
            raise ConfigError(f"{key}.name must name a gem-model config (e.g. 'tiny'), got ''")
        self.baseline.validate(f"{key}.baseline")


@dataclass
class SyntheticConfig:
    """The built-in synthetic ads dataset (see :mod:`gem_train.data.synthetic`)."""

    num_users: int = 20_000
    num_items: int = 5_000  # ads; history items and candidate ads share this id space
    num_categories: int = 50
    num_advertisers: int = 400
    num_actions: int = 4  # action types in histories (view, click, add-to-cart, buy)
    n_dense: int = 8
    max_len: int = 128  # longest history kept (the most recent events)
    history_dist: Literal["lognormal", "zipf"] = "lognormal"
    history_lognormal_mu: float = 3.0  # median length e^mu ~ 20
    history_lognormal_sigma: float = 1.0
    history_zipf_a: float = 1.6
    item_zipf_s: float = 1.1  # item popularity ~ 1 / rank^s
    base_ctr_logit: float = -1.6
    base_cvr_logit: float = -1.0
    train_examples_per_epoch: int = 0  # 0: an endless stream; else the stream repeats after this many
    eval_examples: int = 8192  # the held-out (test) split
    # A second held-out split for model selection (train.valid_every); 0: none. Its impressions come from
    # their own random stream (split code "valid"), disjoint from the training and the test streams.
    valid_examples: int = 0

    def validate(self, key: str = "data.synthetic") -> None:
        for name in (
            "num_users",
            "num_items",
            "num_categories",
            "num_advertisers",
            "max_len",
            "eval_examples",
        ):
            _int_in(f"{key}.{name}", getattr(self, name), 1)
        if self.num_actions < 2:
            raise ConfigError(
                f"{key}.num_actions must be >= 2 (views and clicks at least), got {self.num_actions!r}"
            )
        for name in ("n_dense", "train_examples_per_epoch", "valid_examples"):
            _int_in(f"{key}.{name}", getattr(self, name), 0)
        _real(f"{key}.history_lognormal_mu", self.history_lognormal_mu, -50.0, 50.0)
        _real(f"{key}.history_lognormal_sigma", self.history_lognormal_sigma, 0.0, 50.0)
        _real(f"{key}.history_zipf_a", self.history_zipf_a, 1.0, None, lo_open=True)  # NumPy's zipf: a > 1
        _real(f"{key}.item_zipf_s", self.item_zipf_s, 0.0, 50.0)
        _real(f"{key}.base_ctr_logit", self.base_ctr_logit, -50.0, 50.0)
        _real(f"{key}.base_cvr_logit", self.base_cvr_logit, -50.0, 50.0)


@dataclass
class MovieLensConfig:
    """MovieLens-100K as a CTR task (see :mod:`gem_train.data.movielens`)."""

    cache_dir: str = ""  # "" -> $GEM_CACHE_DIR or ~/.cache/gem
    max_len: int = 128
    eval_fraction: float = 0.1  # the last fraction of each user's events (by time): the test split
    # The fraction of each user's events just before the test events: the validation split (model
    # selection); 0 disables it. Training keeps the rest (at least one event per user when it can).
    valid_fraction: float = 0.1
    like_threshold: int = 4  # label = rating >= like_threshold
    max_users: int = 0  # 0: all users; >0 keeps the first users (tests use a small slice)

    def validate(self, key: str = "data.movielens") -> None:
        _int_in(f"{key}.max_len", self.max_len, 1)
        _real(f"{key}.eval_fraction", self.eval_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if not (math.isfinite(self.valid_fraction) and 0.0 <= self.valid_fraction < 1.0) or (
            self.eval_fraction + self.valid_fraction >= 1.0
        ):
            raise ConfigError(
                f"{key}.valid_fraction must be in [0, 1) with eval_fraction + valid_fraction < 1, "
                f"got {self.valid_fraction!r} (eval_fraction {self.eval_fraction!r})"
            )
        # Ratings are 1..5: a threshold of 1 makes every label positive, above 5 every label negative.
        _int_in(f"{key}.like_threshold", self.like_threshold, 2, 5)
        _int_in(f"{key}.max_users", self.max_users, 0)


@dataclass
class DataConfig:
    """Which dataset, batch sizes, loader workers."""

    source: Literal["synthetic", "movielens-100k", "parquet"] = "synthetic"
    batch_size: int = 256
    eval_batch_size: int = 1024
    num_workers: int = 0  # DataLoader worker processes per rank (0: load in the main process)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    movielens: MovieLensConfig = field(default_factory=MovieLensConfig)
    parquet: ParquetConfig = field(default_factory=ParquetConfig)  # your own Parquet files

    def validate(self, key: str = "data") -> None:
        _int_in(f"{key}.batch_size", self.batch_size, 1)
        _int_in(f"{key}.eval_batch_size", self.eval_batch_size, 1)
        _int_in(f"{key}.num_workers", self.num_workers, 0, 256)
        self.synthetic.validate(f"{key}.synthetic")
        self.movielens.validate(f"{key}.movielens")
        self.parquet.validate(f"{key}.parquet", required=self.source == "parquet")


@dataclass
class OptimConfig:
    """Dense AdamW with linear warm-up then cosine decay; sparse tables row-wise Adagrad."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    sparse_lr: float = 0.05
    sparse_eps: float = 1e-8
    grad_clip: float = 1.0  # max global norm of the dense gradients; 0 disables clipping

    def validate(self, key: str = "optim") -> None:
        _real(f"{key}.lr", self.lr, 0.0, None, lo_open=True)
        _real(f"{key}.weight_decay", self.weight_decay, 0.0)
        _real(f"{key}.beta1", self.beta1, 0.0, 1.0, hi_open=True)
        _real(f"{key}.beta2", self.beta2, 0.0, 1.0, hi_open=True)
        _real(f"{key}.eps", self.eps, 0.0, None, lo_open=True)
        _int_in(f"{key}.warmup_steps", self.warmup_steps, 0)
        _real(f"{key}.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _real(f"{key}.sparse_lr", self.sparse_lr, 0.0, None, lo_open=True)
        _real(f"{key}.sparse_eps", self.sparse_eps, 0.0, None, lo_open=True)
        _real(f"{key}.grad_clip", self.grad_clip, 0.0)


@dataclass
class TrainerConfig:
    """The loop: length, logging, evaluation, precision, failure policy."""

    steps: int = 1000
    log_every: int = 20
    eval_every: int = 0  # steps between evaluations on the test split; 0: only at the end
    eval_batches: int = 0  # 0: the whole evaluation (test) split
    # Model selection: evaluate the validation split every valid_every steps (and at the last step), keep the
    # checkpoint of the lowest validation NE in checkpoints/best, and report its test metrics at the end.
    # 0: no validation. Needs a validation split (data.movielens.valid_fraction or
    # data.synthetic.valid_examples > 0).
    valid_every: int = 0
    valid_batches: int = 0  # 0: the whole validation split
    select_task: str = "ctr"  # the task whose validation NE selects; "mean": the mean NE over all tasks
    autocast: Literal["auto", "bf16", "none"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    nan_policy: Literal["stop", "skip"] = "stop"
    max_skipped_batches: int = 10  # with nan_policy="skip": stop after this many non-finite losses
    peak_flops: float = 0.0  # MFU denominator; 0: look the device up in gem_train.mfu.PEAK_FLOPS
    progress_bar: bool = True
    compile: bool = False  # torch.compile the model

    def validate(self, key: str = "train") -> None:
        _int_in(f"{key}.steps", self.steps, 1)
        _int_in(f"{key}.log_every", self.log_every, 1)
        for name in ("eval_every", "eval_batches", "valid_every", "valid_batches", "max_skipped_batches"):
            _int_in(f"{key}.{name}", getattr(self, name), 0)
        if not self.select_task:
            raise ConfigError(f"{key}.select_task must name a task (e.g. 'ctr') or be 'mean'")
        _real(f"{key}.peak_flops", self.peak_flops, 0.0)


@dataclass
class PrecisionConfig:
    """A gem-precision recipe for the model's linear layers (``gem_precision.convert``), on top of autocast.

    ``recipe = "none"`` keeps every layer as it is; otherwise one of the ``gem_precision.Recipe``
    constructors: "mxfp8" (MXFP8 forward and dgrad, bf16 wgrad), "mxfp8_all", "fp8_rowwise", "bf16".
    """

    recipe: Literal["none", "mxfp8", "mxfp8_all", "fp8_rowwise", "bf16"] = "none"
    min_features: int = 128  # layers narrower than this stay unconverted
    keep_last_blocks: int = 0  # keep the last N layers unconverted (the most sensitive)

    def validate(self, key: str = "precision") -> None:
        _int_in(f"{key}.min_features", self.min_features, 0)
        _int_in(f"{key}.keep_last_blocks", self.keep_last_blocks, 0)


@dataclass
class CheckpointConfig:
    """torch.distributed.checkpoint snapshots of the whole training state."""

    every: int = 0  # steps between checkpoints; 0: only at the end (and on SIGTERM/Ctrl-C)
    keep_last: int = 3
    resume_from: str = ""  # a checkpoint directory, or "latest" for this config's newest run

    def validate(self, key: str = "checkpoint") -> None:
        _int_in(f"{key}.every", self.every, 0)
        _int_in(f"{key}.keep_last", self.keep_last, 1)


@dataclass
class TrainConfig:
    """The whole run configuration (one TOML file)."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainerConfig = field(default_factory=TrainerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> None:
        """Check every value's range (types are checked at load time), section by section; raise
        :class:`ConfigError` naming the dotted key."""
        self.run.validate("run")
        self.model.validate("model")
        self.data.validate("data")
        self.optim.validate("optim")
        self.train.validate("train")
        self.precision.validate("precision")
        self.checkpoint.validate("checkpoint")


# --------------------------------------------------------------------------------------------------------
# dict <-> dataclass with type checks
# --------------------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "table"
    if origin is dict or tp is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))


def check_value(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` (int -> float only), or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            try:
                return check_value(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected None, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return config_from_dict(tp, value, prefix=key)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return dict(value)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected an array, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [check_value(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected bool, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        # bool is an int subclass in Python; `steps = true` is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected str, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {tp!r}")


_T = typing.TypeVar("_T")


def config_from_dict(cls: type[_T], data: dict[str, Any], prefix: str = "") -> _T:
    """Build dataclass ``cls`` from a (TOML) dict, checking every key and type.

    Missing keys take the dataclass default. Raises :class:`ConfigError` naming the dotted key of an unknown
    key or a value of the wrong type.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(f"unknown config key '{dotted}' (known keys here: {', '.join(names)})")
        kwargs[key] = check_value(value, hints[key], dotted)
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The dataclass as nested plain dicts (tuples become lists), ready for TOML/JSON."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [conv(x) for x in v]
        return v

    return conv(cfg)


# --------------------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key=value``: the value is read as a TOML literal (``3``, ``1e-3``, ``true``, ``"x"``,
    ``[1, 2]``); anything that is not a TOML literal is taken as a bare string (``lognormal``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of the raw config dict with dotted ``key=value`` overrides set (before type checks)."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[: i + 1])}' is not a table")
            node = child
        node[parts[-1]] = value
    return out


# --------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------


def _read_shipped(name: str) -> str:
    res = importlib.resources.files("gem_train").joinpath("configs", f"{name}.toml")
    return res.read_text(encoding="utf-8")


def load_config(source: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Load a run config.

    Args:
        source: a path to a TOML file, or the name of a shipped config (``SHIPPED_CONFIGS``); ``None`` is
            ``"tiny-cpu"``.
        overrides: dotted ``key=value`` strings applied on top (``train.steps=20``).

    Raises:
        ConfigError: unreadable TOML, an unknown key, a wrong type or an out-of-range value (naming the key).
    """
    source = "tiny-cpu" if source is None else source
    path = Path(source)
    if path.suffix == ".toml" or path.exists():
        if path.is_dir():
            raise ConfigError(
                f"config {str(path)!r} is a directory; pass a TOML file or a shipped config name"
            )
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        text, origin = path.read_text(encoding="utf-8"), str(path)
    elif str(source) in SHIPPED_CONFIGS:
        text, origin = _read_shipped(str(source)), f"shipped config {source!r}"
    else:
        raise ConfigError(
            f"no config file {str(source)!r}, and it is not a shipped config ({', '.join(SHIPPED_CONFIGS)})"
        )
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin}: invalid TOML: {e}") from e
    raw = apply_overrides(raw, list(overrides or []))
    cfg = config_from_dict(TrainConfig, raw)
    cfg.validate()
    return cfg


# --------------------------------------------------------------------------------------------------------
# Writing TOML (tomllib only reads); enough for our nested tables of scalars and arrays.
# --------------------------------------------------------------------------------------------------------


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return {"nan": "nan", "inf": "inf", "-inf": "-inf"}[repr(v)]
        return repr(v)
    if isinstance(v, str):
        escaped = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dumps_toml(data: dict[str, Any]) -> str:
    """Nested dicts of scalars/arrays -> TOML text (tables after scalars, so it re-reads identically)."""
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix and (scalars or not tables):
            lines.append(f"[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{_toml_key(k)} = {_toml_scalar(v)}")
        if scalars:
            lines.append("")
        for k, v in tables.items():
            emit(v, f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k))

    emit(data, "")
    return "\n".join(lines).rstrip() + "\n"


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml_scalar(k)
