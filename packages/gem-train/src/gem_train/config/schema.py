"""The run configuration's schema: one dataclass per TOML section, each with its range checks beside it.

``validate(key)`` of a section checks every value's range and raises :class:`ConfigError` naming the dotted
key; types are checked when the TOML is read (:mod:`gem_train.config.typed`). The ``[data]`` sections are in
:mod:`gem_train.config.data`.

The ``[model]`` section names a gem-model config (``gem_model.get_config(name)``) and may override its fields
in ``[model.overrides]``; those are checked against ``GemConfig`` when the model is built
(:func:`gem_train.loop.model.build_gem_config`), because the field set belongs to gem-model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from gem_train.config.checks import ConfigError
from gem_train.config.checks import int_in as _int_in
from gem_train.config.checks import real as _real
from gem_train.config.data import DataConfig
from gem_train.config.distill import DistillConfig
from gem_train.config.gbdt import GbdtConfig
from gem_train.config.parallel import ParallelSection

__all__ = [
    "BaselineConfig",
    "CheckpointConfig",
    "ModelSection",
    "OptimConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "TrainerConfig",
]

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


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
    dropout: float = 0.0  # after each hidden layer (training only)

    def validate(self, key: str = "model.baseline") -> None:
        _int_in(f"{key}.embedding_dim", self.embedding_dim, 1)
        _real(f"{key}.dropout", self.dropout, 0.0, 1.0, hi_open=True)
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
    gbdt: GbdtConfig = field(default_factory=GbdtConfig)  # gem-train baseline --model gbdt

    def validate(self, key: str = "model") -> None:
        # The name and the overrides belong to gem-model: checked against it when the run is built
        # (gem_train.loop.model.build_gem_config), still before the run directory exists.
        if not self.name:
            raise ConfigError(f"{key}.name must name a gem-model config (e.g. 'tiny'), got ''")
        self.baseline.validate(f"{key}.baseline")
        self.gbdt.validate(f"{key}.gbdt")


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
    # AdamW's kernels: "fused" (one multi-tensor kernel per group: on CUDA the fastest), "foreach" (several
    # multi-tensor ops), "auto": fused when every dense parameter is on CUDA, else foreach.
    adamw_impl: Literal["auto", "fused", "foreach"] = "auto"

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
    # Run length in passes over the training data (a float; 0: use train.steps): steps = ceil(epochs x
    # batches per epoch / ranks). Finite datasets only (Parquet, MovieLens, synthetic with
    # data.synthetic.train_examples_per_epoch > 0).
    epochs: float = 0.0
    log_every: int = 20
    eval_every: int = 0  # steps between evaluations on the test split; 0: only at the end
    eval_batches: int = 0  # 0: the whole evaluation (test) split
    # Model selection: evaluate the validation split every valid_every steps and at the last step, keep the
    # checkpoint of the lowest validation NE in checkpoints/best, and report its test metrics at the end.
    # "auto": about 10 validations per run (every ceil(steps / 10) steps), and at least one per pass over
    # a finite training set; 0: only at the last step. Every dataset has a validation split by default;
    # with none (its size set to 0) no selection happens.
    valid_every: int | Literal["auto"] = "auto"
    valid_batches: int = 0  # 0: the whole validation split
    select_task: str = "ctr"  # the task whose validation NE selects; "mean": the mean NE over all tasks
    # Early stopping: end the run after this many validation evaluations in a row without a new best
    # (the best checkpoint is then evaluated on the test split as usual); 0: off. 3 by default: with the
    # ~10 validations of valid_every = "auto" a run ends at most ~30% of its length after its best
    # checkpoint (Lightning's EarlyStopping default patience is 3 too).
    early_stop_patience: int = 3
    autocast: Literal["auto", "bf16", "none"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    nan_policy: Literal["stop", "skip"] = "stop"
    max_skipped_batches: int = 10  # with nan_policy="skip": stop after this many non-finite losses
    peak_flops: float = 0.0  # MFU denominator; 0: look the device up in gem_train.loop.mfu.PEAK_FLOPS
    progress_bar: bool = True
    compile: bool = False  # torch.compile the model
    # Read a step's loss after queueing the next one (no host sync between two steps) where the optimizers
    # skip non-finite steps on the device (fused AdamW: optim.adamw_impl, auto on CUDA); false: read each
    # step's loss before the next.
    overlap_steps: bool = True
    # CUDA, one process: pad each batch to one of a few bucketed jagged sizes and replay the whole step as
    # one CUDA graph per bucket (gem_train.loop.cuda_graph; needs the fused AdamW). Ignored on the CPU.
    cuda_graphs: bool = False

    def validate(self, key: str = "train") -> None:
        _int_in(f"{key}.steps", self.steps, 1)
        _int_in(f"{key}.log_every", self.log_every, 1)
        for name in (
            "eval_every", "eval_batches", "valid_batches", "max_skipped_batches", "early_stop_patience",
        ):  # fmt: skip
            _int_in(f"{key}.{name}", getattr(self, name), 0)
        if self.valid_every != "auto":
            if isinstance(self.valid_every, str):
                raise ConfigError(
                    f"{key}.valid_every must be 'auto' or an int >= 0, got {self.valid_every!r}"
                )
            _int_in(f"{key}.valid_every", self.valid_every, 0)
        _real(f"{key}.epochs", self.epochs, 0.0, 100_000.0)
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
    # fp8_rowwise: each GEMM in FP8 only where gem-precision's roofline predicts it pays, bf16 elsewhere
    # (Recipe.fp8_rowwise(auto_fallback=True)); false: every GEMM FP8 can take runs FP8.
    fp8_auto_fallback: bool = True
    # Cast each FP8 layer's weight once per optimizer step, not in every GEMM
    # (gem_precision.cache_fp8_weights).
    cache_weight_casts: bool = True

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
    parallel: ParallelSection = field(default_factory=ParallelSection)
    distill: DistillConfig = field(default_factory=DistillConfig)  # knowledge transfer (gem_train.transfer)

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
        self.parallel.validate("parallel")
        self.distill.validate("distill")
