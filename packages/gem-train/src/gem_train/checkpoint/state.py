"""``trainer_state.json``: the JSON part of a checkpoint (step, data position, optimizer ``param_groups``,
Python/NumPy RNG, world size, the resolved config), its schema and its checked reading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gem_train.checkpoint.errors import CheckpointError
from gem_train.checkpoint.manifest import MANIFEST, check_files, digest_bytes, read_manifest

__all__ = [
    "SPARSE_OPTIM",
    "STATE_FILE",
    "STATE_KEYS",
    "check_state",
    "jsonable_groups",
    "read_trainer_state",
    "restore_groups",
]


STATE_FILE = "trainer_state.json"
SPARSE_OPTIM = "sparse_optim"  # DCP key of the fused optimizer state of TorchRec-sharded tables

STATE_KEYS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "world_size": int,
    "data_position": int,
    "optim_param_groups": list,
    "rng_plain": list,
    "config": dict,
}


def check_state(state: Any, path: Path) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: corrupt trainer state (a JSON {type(state).__name__}, not an object)")
    for key, tp in STATE_KEYS.items():
        if key not in state:
            raise CheckpointError(f"{path}: corrupt trainer state (no {key!r})")
        value = state[key]
        if not isinstance(value, tp) or isinstance(value, bool):
            raise CheckpointError(f"{path}: corrupt trainer state ({key!r} is {value!r})")
    if state["step"] < 0 or state["world_size"] < 1 or len(state["rng_plain"]) != state["world_size"]:
        raise CheckpointError(
            f"{path}: corrupt trainer state (step {state['step']}, world_size {state['world_size']}, "
            f"{len(state['rng_plain'])} RNG states)"
        )
    return state


def read_trainer_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The JSON part of a checkpoint (step, data position, config, ...), checked against the manifest.

    Cheap (no shard is hashed): the directory listing and sizes against the manifest, then the sha256 and
    the keys of ``trainer_state.json``. Raises :class:`CheckpointError` naming the file.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint {ckpt_dir} does not exist (or is not a directory)")
    manifest = read_manifest(ckpt_dir)
    problems = check_files(ckpt_dir, manifest, hash_names=())
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: " + "; ".join(problems[:5]))
    path = ckpt_dir / STATE_FILE
    if STATE_FILE not in manifest:
        raise CheckpointError(f"{ckpt_dir}: no {STATE_FILE} in {MANIFEST}: not a gem-train checkpoint")
    data = path.read_bytes()
    if digest_bytes(data) != manifest[STATE_FILE]:
        raise CheckpointError(f"{path}: corrupt (its sha256 differs from {MANIFEST})")
    try:
        state = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt trainer state (not JSON: {e})") from None
    return check_state(state, path)


def jsonable_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for g in groups:
        h = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            h[k] = list(v) if isinstance(v, tuple) else v
        out.append(h)
    return out


def restore_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # JSON turned tuples (AdamW's betas) into lists; optimizers expect the tuple back.
    return [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
