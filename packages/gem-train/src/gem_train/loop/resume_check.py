"""What a resume may change: this run's settings and data against its checkpoint's, refused unless allowed.

A checkpoint holds the resolved config of the run that wrote it (``trainer_state["config"]``) and the identity
of its data (``trainer_state["data_identity"]``, :mod:`gem_train.data.identity`). A resume compares both, key
by key, before anything is written. Each difference is one of:

- **no effect on the run's meaning** (:data:`NO_EFFECT`): where the run happens, how it is logged,
  checkpointed, laid out over processes or how fast it goes. Never needs allowing; said at start-up.
- **the run continues** (:data:`CONTINUES`): a new length (``train.steps``), the ordinary use of a resume.
  Allowed; said at start-up.
- **a change of meaning**: everything else, i.e. what is trained on, the model, the optimisation or the
  evaluation (and any setting added later until it is listed above). Refused with one
  :class:`~gem_train.config.ConfigError` listing each difference (``key: old -> new``), unless named by
  ``--allow-change KEY`` (a key, or a prefix covering its subkeys: ``data.parquet``, ``optim``).

The data's content (the Parquet files' sizes, rows and footers; MovieLens' events) is compared too: files
rewritten in place under the same config are refused, naming the files. Such a difference is accepted by
allowing its key (``data.parquet.train``), or by an allowed change that moves the data (``data.parquet.root``,
``data.source``; see :class:`~gem_train.data.identity.DataDifference`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gem_train.config import ConfigError, TrainConfig, config_from_dict, config_to_dict
from gem_train.data.identity import DataDifference, identity_differences, show

__all__ = [
    "CONTINUES",
    "NO_EFFECT",
    "Change",
    "ResumePlan",
    "check_resume",
    "covers",
    "flatten",
    "optimizer_settings",
    "restore_optimizer_settings",
]

# Settings whose change does not change the run's meaning (a key or a prefix), and why.
NO_EFFECT: dict[str, str] = {
    "run.name": "names the run directory; a resume keeps its run's",
    "run.out_dir": "where new run directories go; a resume keeps its run's",
    "run.device": "where the run computes: other rounding, the same run (like another world size)",
    "run.cpu_threads": "speed",
    "data.num_workers": "loader processes: the same batches (a streamed Parquet position refuses another "
    "count itself)",
    "data.movielens.cache_dir": "where the files are kept; their sha256s are checked",
    "train.log_every": "logging",
    "train.progress_bar": "logging",
    "train.peak_flops": "the MFU denominator (logging)",
    "train.eval_every": "test-split metrics logged during training; the final evaluation is the same",
    "train.compile": "speed: the same computation, compiled",
    "train.overlap_steps": "speed: when a step's loss is read",
    "optim.adamw_impl": "speed: the same AdamW with other kernels",
    "checkpoint": "when checkpoints are written and how many are kept",
    "parallel.dp_replicate": "layout over processes (like the world size, which a resume may change)",
    "parallel.dp_shard": "layout over processes",
    "parallel.ep": "layout over processes",
    "parallel.strategy": "layout of the tables (a change of their optimizer's home is said at start-up)",
    "parallel.group_size": "layout of the tables",
    "parallel.sync_every": "layout of the tables",
    "parallel.all_gather": "memory and speed",
    "parallel.activation_checkpointing": "memory and speed",
    "parallel.memory_budget": "memory and speed",
    "parallel.saved_activations": "memory and speed",
    "parallel.timeout_s": "how long a collective waits",
    "parallel.balancer_calibration": "the level of a fresh balanced stream; a resume keeps its checkpoint's",
}
# Settings that continue the run (allowed, said at start-up).
CONTINUES: dict[str, str] = {
    "train.steps": "the run's length",
    "train.epochs": "the run's length",
}

_ABSENT = object()  # a key one of the two configs does not have


def covers(prefix: str, key: str) -> bool:
    """Whether ``--allow-change prefix`` (or a table entry) covers the dotted ``key``."""
    return key == prefix or key.startswith(prefix + ".")


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables -> ``{"dotted.key": value}`` (empty tables have no keys; lists are values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _tables(d: dict[str, Any], prefix: str = "") -> set[str]:
    """Every dotted key of a table, at every depth (what ``--allow-change`` may name)."""
    out: set[str] = set()
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.add(key)
        if isinstance(v, dict):
            out |= _tables(v, key)
    return out


def _normalised(raw: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config with this gem-train's defaults filled in (a key added since compares with its
    default), and the Parquet feature tables' too; as it was if it no longer parses."""
    try:
        cfg = config_from_dict(TrainConfig, raw)
        out = config_to_dict(cfg)
        pq = out["data"]["parquet"]
        pq["sparse"] = {n: config_to_dict(sp) for n, sp in cfg.data.parquet.sparse_features()}
        pq["sequences"] = {n: config_to_dict(sq) for n, sq in cfg.data.parquet.sequence_features()}
        return out
    except (ConfigError, KeyError, TypeError):
        return raw


@dataclass(frozen=True)
class Change:
    """One setting that differs: ``key: old -> new`` (``None`` where a side does not have the key)."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        def side(v: Any) -> str:
            return "(absent)" if v is _ABSENT else show(v)

        return f"{self.key}: {side(self.old)} -> {side(self.new)}"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "old": None if self.old is _ABSENT else self.old,
                "new": None if self.new is _ABSENT else self.new}  # fmt: skip


@dataclass
class ResumePlan:
    """An accepted resume: what changed, by kind (see the module docstring)."""

    run: str
    step: int
    checkpoint: Path
    continues: list[Change] = field(default_factory=list)
    no_effect: list[Change] = field(default_factory=list)
    allowed: list[Change] = field(default_factory=list)
    data_allowed: list[DataDifference] = field(default_factory=list)
    allow: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # --allow-change keys under which nothing changed
    notes: list[str] = field(default_factory=list)  # e.g. which run --resume latest picked
    data_note: str = ""  # e.g. the checkpoint records no data identity

    def message(self) -> str:
        """What rank 0 says at start-up (stderr)."""
        lines = [*self.notes, f"resuming {self.run} from step {self.step} (checkpoint {self.checkpoint})"]
        lines += [f"  {c} (the run continues to its new length; the learning-rate decay ends there)"
                  for c in self.continues]  # fmt: skip
        lines += [f"  allowed (--allow-change): {c}" for c in self.allowed]
        lines += [f"  allowed (--allow-change): {d.key}: {d.detail}" for d in self.data_allowed]
        if self.no_effect:
            changed = "; ".join(map(str, self.no_effect))
            lines.append(f"  changed, without effect on the run's meaning: {changed}")
        lines += [f"  --allow-change {k}: nothing under it changed" for k in self.unused]
        lines += [f"  {self.data_note}"] if self.data_note else []
        return "\n".join(f"gem-train: {x}" if not x.startswith("  ") else x for x in lines)

    @property
    def changes_optimizer(self) -> bool:
        """Whether an allowed change is an optimizer setting (the checkpoint's are then replaced by this
        run's, :func:`restore_optimizer_settings`)."""
        return any(covers("optim", c.key) for c in self.allowed)

    @property
    def new_train_data(self) -> bool:
        """Whether the training files differ, allowed (a streamed position then goes on over them)."""
        return any(d.key in ("data.source", "data.parquet.train") for d in self.data_allowed)

    def history_entry(self) -> dict[str, Any]:
        """The changes, for the run's ``config_history.jsonl``."""
        return {
            "continues": [c.as_dict() for c in self.continues],
            "allowed": [c.as_dict() for c in self.allowed],
            "data_allowed": [{"key": d.key, "detail": d.detail} for d in self.data_allowed],
            "no_effect": [c.as_dict() for c in self.no_effect],
            "allow_change": list(self.allow),
        }


def _kind(key: str) -> str:
    if any(covers(p, key) for p in NO_EFFECT):
        return "no_effect"
    if key in CONTINUES:
        return "continues"
    return "meaning"


def check_resume(
    state: dict[str, Any],
    cfg: TrainConfig,
    identity: dict[str, Any],
    allow: Sequence[str],
    checkpoint: Path,
    notes: Sequence[str] = (),
) -> ResumePlan:
    """Compare the checkpoint's ``state`` (config and data identity) with this run's ``cfg`` and data
    ``identity``; return the accepted :class:`ResumePlan`.

    Raises:
        ConfigError: a difference that changes the run's meaning and is not allowed (each one listed, with
            the ``--allow-change`` keys that would accept them), or an ``--allow-change`` key that names no
            setting.
    """
    old_cfg, new_cfg = _normalised(state["config"]), _normalised(config_to_dict(cfg))
    known = _tables(old_cfg) | _tables(new_cfg)
    for a in allow:
        if not any(covers(a, k) for k in known):
            raise ConfigError(
                f"--allow-change {a}: no such setting (name a dotted config key such as data.parquet.root, "
                "or a section such as optim)"
            )
    a_flat, b_flat = flatten(old_cfg), flatten(new_cfg)
    changes = [
        Change(k, a_flat.get(k, _ABSENT), b_flat.get(k, _ABSENT))
        for k in sorted(set(a_flat) | set(b_flat))
        if a_flat.get(k, _ABSENT) != b_flat.get(k, _ABSENT)
    ]
    run = checkpoint.parent.parent.name
    plan = ResumePlan(run, int(state["step"]), checkpoint, allow=list(allow), notes=list(notes))
    refused: list[str] = []
    suggest: list[str] = []
    for c in changes:
        kind = _kind(c.key)
        if kind == "no_effect":
            plan.no_effect.append(c)
        elif kind == "continues":
            plan.continues.append(c)
        elif any(covers(a, c.key) for a in allow):
            plan.allowed.append(c)
        else:
            refused.append(str(c))
            suggest.append(c.key)
    saved_identity = state.get("data_identity")
    if not isinstance(saved_identity, dict):
        plan.data_note = (
            "the checkpoint records no data identity (an older gem-train wrote it): its data is not compared"
        )
        data_diffs: list[DataDifference] = []
    else:
        data_diffs = identity_differences(saved_identity, identity)
    moved = [c.key for c in plan.allowed]  # and allowed data (the valid split cut from the training files)
    moved += [d.key for d in data_diffs if any(covers(a, d.key) for a in allow)]
    for d in data_diffs:
        if any(covers(a, d.key) for a in allow) or any(covers(loc, k) for loc in d.locators for k in moved):
            plan.data_allowed.append(d)
        else:
            refused.append(f"{d.key}: {d.detail}")
            if not any(covers(loc, k) for loc in d.locators for k in suggest):  # not explained by another
                suggest.append(d.key)
    if refused:
        flags = " ".join(f"--allow-change {k}" for k in dict.fromkeys(suggest))
        notes = "".join(f"({n})\n" for n in plan.notes)
        raise ConfigError(
            f"cannot resume {run} from step {plan.step} ({checkpoint}): {len(refused)} difference(s) from "
            "the checkpoint's run would change what it trains on, its model, its optimisation or its "
            "evaluation:\n  " + "\n  ".join(refused) + f"\n{notes}resume with the checkpoint's settings and "
            f"data, name each intended change ({flags}), or start a new run (without --resume)"
        )
    touched = [c.key for c in changes] + [d.key for d in data_diffs]
    plan.unused = [a for a in allow if not any(covers(a, k) for k in touched)]
    return plan


def optimizer_settings(optimizers: Sequence[Any]) -> list[list[dict[str, Any]]]:
    """The hyper-parameters of every parameter group (all but ``params``) of freshly built optimizers: the
    config's. A checkpoint's load replaces them with the saved ones (exact resume)."""
    return [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers]


def restore_optimizer_settings(optimizers: Sequence[Any], settings: list[list[dict[str, Any]]]) -> None:
    """Put the config's hyper-parameters (:func:`optimizer_settings`) back after a load, in place (the
    group dicts stay the ones the optimizers read), where an allowed change says the config's apply."""
    for opt, groups in zip(optimizers, settings, strict=True):
        for group, fresh in zip(opt.param_groups, groups, strict=False):
            group.update(fresh)
