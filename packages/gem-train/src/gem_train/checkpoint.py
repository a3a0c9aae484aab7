"""Atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint directory ``checkpoints/step_<N>/`` holds

- the DCP shards (``*.distcp`` + ``.metadata``) of every tensor of the training state: model weights,
  optimizer state (``get_state_dict`` FQN-keyed, so a DDP/FSDP wrapper does not change the keys), and each
  rank's RNG states;
- ``trainer_state.json``: everything that is not a tensor: step, data position, optimizer ``param_groups``,
  Python/NumPy RNG, the resolved config.

Only tensors go through DCP, so loading never unpickles Python objects: DCP would ``torch.load`` non-tensor
values with ``weights_only=False``; our load planner refuses them outright (any ``torch.load`` here is
``weights_only=True``).

Atomicity: every rank writes into ``checkpoints/.tmp-step_<N>``; after a barrier, rank 0 writes
``trainer_state.json``, fsyncs every file and the directory, and renames it to ``step_<N>`` (an atomic
``rename(2)`` on POSIX), then fsyncs the parent. A crash at any point before the rename leaves only a
``.tmp-*`` directory, which :func:`latest_checkpoint` ignores and the next save removes: a checkpoint either
loads whole or is not there.

The best checkpoint (model selection on a validation split): :func:`save_best_checkpoint` writes
``checkpoints/best_step_<N>/`` the same way, then points the symbolic link ``checkpoints/best`` at it by
an atomic ``rename(2)`` of a fresh link over the old one, then removes the older ``best_step_*``
directories. ``checkpoints/best`` therefore always names one complete checkpoint (or does not exist yet);
it is not one of the keep-last-K ``step_<N>`` checkpoints and is never pruned by them.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = [
    "BEST_LINK",
    "CheckpointError",
    "best_checkpoint",
    "capture_rng_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_trainer_state",
    "restore_rng_state",
    "save_best_checkpoint",
    "save_checkpoint",
]

STATE_FILE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
_BEST_RE = re.compile(r"^best_step_(\d+)$")
BEST_LINK = "best"  # checkpoints/best -> best_step_<N>


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model being loaded into."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class _TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that never unpickles: a non-tensor entry is loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        value.seek(0)
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


# ----------------------------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------------------------


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's RNG states: torch CPU/CUDA as tensors, Python/NumPy as JSON-able values."""
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    py = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: (name, keys, pos, has_gauss, cached_gaussian)
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    plain = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, plain


def restore_rng_state(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["cuda"].unbind(0)))
    v, internal, gauss = plain["python"]
    random.setstate((v, tuple(internal), gauss))
    name, pos, has_gauss, cached = plain["numpy"]
    keys = tensors["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((name, keys, pos, has_gauss, cached))


# ----------------------------------------------------------------------------------------------------------
# Listing
# ----------------------------------------------------------------------------------------------------------


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root`` (``step_<N>`` directories with a state file), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_RE.match(d.name)
        if m and d.is_dir() and (d / STATE_FILE).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def best_checkpoint(root: str | Path) -> Path | None:
    """``root/best`` (the link to the best-validation checkpoint) if it names a complete checkpoint; else
    None."""
    link = Path(root) / BEST_LINK
    if link.is_dir() and (link / STATE_FILE).is_file():
        return link
    return None


def read_trainer_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The JSON part of a checkpoint (step, data position, config, ...)."""
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a complete gem-train checkpoint (no {STATE_FILE}); "
            "pass a checkpoints/step_<N> directory of a run"
        )
    return json.loads(path.read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------------------------------------
# Save / load
# ----------------------------------------------------------------------------------------------------------


def _jsonable_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for g in groups:
        h = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            h[k] = list(v) if isinstance(v, tuple) else v
        out.append(h)
    return out


def _restore_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # JSON turned tuples (AdamW's betas) into lists; optimizers expect the tuple back.
    return [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any],
    keep_last: int = 3,
) -> Path:
    """Write ``root/step_<step>`` atomically (all ranks call this) and keep the newest ``keep_last``.

    Args:
        model: the (possibly DDP-wrapped) model.
        optimizers: all optimizers of the run, in a fixed order.
        extra: JSON-able trainer state (data position, config, ...); stored in ``trainer_state.json``.
    Returns:
        The final checkpoint directory.
    """
    final = _write_checkpoint(Path(root), f"step_{step:08d}", step, model, optimizers, extra)
    if _rank() == 0:
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def save_best_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any],
) -> Path:
    """Write ``root/best_step_<step>`` atomically and point the link ``root/best`` at it (all ranks call).

    The older ``best_step_*`` directories are removed once the link has moved, so a crash at any point leaves
    ``root/best`` naming a complete checkpoint (the old or the new one). ``extra`` as in
    :func:`save_checkpoint` (the trainer stores the validation metrics that made it the best there).

    Returns:
        ``root/best`` (the link).
    """
    root = Path(root)
    name = f"best_step_{step:08d}"
    _write_checkpoint(root, name, step, model, optimizers, extra)
    link = root / BEST_LINK
    if _rank() == 0:
        tmp_link = root / f".tmp-{BEST_LINK}"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(name, tmp_link)  # relative: the run directory may be moved
        os.replace(tmp_link, link)  # atomic: readers see the old or the new target, never neither
        _fsync_dir(root)
        for d in root.iterdir():
            if _BEST_RE.match(d.name) and d.name != name:
                shutil.rmtree(d, ignore_errors=True)
    _barrier()
    return link


def _write_checkpoint(
    root: Path,
    name: str,
    step: int,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any],
) -> Path:
    """Write ``root/<name>`` through ``root/.tmp-<name>`` and an atomic rename (all ranks call)."""
    rank = _rank()
    final = root / name
    tmp = root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()

    model_sd, optim_sd = get_state_dict(model, optimizers)
    rng_tensors, rng_plain = capture_rng_state()
    state = {
        "model": model_sd,
        "optim": optim_sd["state"],
        f"rng/rank{rank}": rng_tensors,
    }
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    # Gather every rank's non-tensor RNG state so each rank can get its own back on resume.
    plain_all: list[Any] = [rng_plain]
    if dist.is_available() and dist.is_initialized():
        plain_all = [None] * dist.get_world_size()
        dist.all_gather_object(plain_all, rng_plain)
    if rank == 0:
        trainer_state = dict(extra)
        trainer_state.update(
            step=int(step),
            optim_param_groups=_jsonable_groups(cast(list[dict[str, Any]], optim_sd["param_groups"])),
            rng_plain=plain_all,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
        )
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state), encoding="utf-8")
        _fsync_tree(tmp)
        if final.exists():  # the same step saved twice (e.g. SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    _barrier()
    return final


def load_checkpoint(
    ckpt_dir: str | Path,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer] | None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint in place into ``model`` (and ``optimizers``, and this rank's RNG).

    Returns the JSON trainer state (``step``, data position, config, ...). Raises :class:`CheckpointError`
    if the directory is not a complete checkpoint or its keys do not match the model.
    """
    ckpt_dir = Path(ckpt_dir)
    trainer_state = read_trainer_state(ckpt_dir)
    rank = _rank()
    optimizers = optimizers or []
    model_sd, optim_sd = get_state_dict(model, optimizers)
    rng_tensors, _ = capture_rng_state()
    state: dict[str, Any] = {"model": model_sd}
    if optimizers:
        state["optim"] = optim_sd["state"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if restore_rng and world == trainer_state.get("world_size", 1):
        state[f"rng/rank{rank}"] = rng_tensors
    try:
        dcp.load(state, checkpoint_id=str(ckpt_dir), planner=_TensorsOnlyLoadPlanner())
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        # DCP wraps each rank's traceback; keep the error lines ("Missing key in checkpoint ...").
        lines = [ln.strip() for ln in str(e).splitlines() if "Error:" in ln] or [str(e)]
        raise CheckpointError(f"cannot load checkpoint {ckpt_dir} into this model: {lines[-1]}") from e
    if optimizers:
        set_state_dict(
            model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict={
                "state": state["optim"],
                "param_groups": _restore_groups(trainer_state["optim_param_groups"]),
            },
        )
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    if f"rng/rank{rank}" in state:
        restore_rng_state(state[f"rng/rank{rank}"], trainer_state["rng_plain"][rank])
    return trainer_state
