"""Writing a checkpoint with DCP, atomically: into ``.tmp-<name>``, then sealed (hashed, manifest, renamed) in
the background; ``best`` re-pointed atomically."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from gem_train.checkpoint.atomic import fsync_tree, install, prune_checkpoints, remove_checkpoint
from gem_train.checkpoint.errors import CheckpointError
from gem_train.checkpoint.layout import BEST_LINK, BEST_RE, TMP_PREFIX
from gem_train.checkpoint.manifest import fsync_dir, write_manifest
from gem_train.checkpoint.ranks import all_gather, barrier, current_rank, world_size
from gem_train.checkpoint.rng import capture_rng_state
from gem_train.checkpoint.sealing import BackgroundSeal, exchange_digests, hash_files
from gem_train.checkpoint.state import SPARSE_OPTIM, STATE_FILE, jsonable_groups
from gem_train.checkpoint.storage import RecordingFileSystemWriter

__all__ = [
    "checkpoint_pending",
    "save_best_checkpoint",
    "save_checkpoint",
    "wait_for_checkpoints",
    "wait_for_local_seal",
    "write_checkpoint",
]


_SEAL = BackgroundSeal()


def checkpoint_pending() -> bool:
    """Whether this process is still sealing a checkpoint in the background (hashing, manifest, rename)."""
    return _SEAL.pending()


def wait_for_local_seal() -> str | None:
    """Wait for this process's seal in flight, without a collective (a process about to end); its failure
    message, or None."""
    return _SEAL.join()


def wait_for_checkpoints() -> None:
    """Wait until the checkpoint being sealed in the background is in place (all ranks call; a no-op when
    none is). Raises :class:`CheckpointError` on every rank if the seal failed on any."""
    errors = [e for e in all_gather(_SEAL.join()) if e is not None]
    if errors:
        raise CheckpointError("; ".join(dict.fromkeys(errors)))


def write_checkpoint(
    root: Path,
    name: str,
    step: int,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any],
    background: bool,
    then: Callable[[Path], None] | None = None,
    sparse: Any = None,
) -> Path:
    """Write ``root/<name>`` through ``root/.tmp-<name>`` (all ranks), then seal it: hash every file,
    write the manifest, rename it into place, then ``then(final)`` on rank 0 — in a background thread if
    ``background`` (:mod:`gem_train.checkpoint.sealing`). Waits for the previous seal first."""
    wait_for_checkpoints()
    rank, world = current_rank(), world_size()
    final = root / name
    tmp = root / f"{TMP_PREFIX}{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()

    if sparse is not None:
        sparse.prepare_checkpoint()  # 2D replicas agree (DCP writes one copy of a shard); FS-2D gathered
    model_sd, optim_sd = get_state_dict(model, optimizers)
    rng_tensors, rng_plain = capture_rng_state()
    state = {
        "model": model_sd,
        "optim": optim_sd["state"],
        f"rng/rank{rank}": rng_tensors,
    }
    if sparse is not None:
        state[SPARSE_OPTIM] = sparse.fused_optimizer.state_dict()  # the fused row-wise Adagrad state
    writer = RecordingFileSystemWriter(tmp)
    dcp.save(state, storage_writer=writer)
    mine = writer.written
    # Every rank's non-tensor RNG state goes to rank 0 (also the barrier after which every file is written).
    gathered = all_gather(rng_plain)
    if rank == 0:
        trainer_state = dict(extra)
        trainer_state.update(
            step=int(step),
            data_position=int(extra.get("data_position", step)),
            optim_param_groups=jsonable_groups(cast(list[dict[str, Any]], optim_sd["param_groups"])),
            rng_plain=gathered,
            world_size=world,
            config=extra.get("config", {}),
            sparse_strategy=None if sparse is None else str(sparse.strategy),
        )
        with open(tmp / STATE_FILE, "wb") as f:
            f.write(json.dumps(trainer_state).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        mine.add(STATE_FILE)

    def seal() -> None:
        digests = exchange_digests(tmp, rank, world, hash_files(tmp, mine))
        if digests is None:
            return  # rank 0 finishes
        fsync_tree(tmp)  # DCP fsynced its files; this covers every rank's files and the directory
        write_manifest(tmp, digests)  # last: its presence marks the directory complete
        install(tmp, final)
        if then is not None:
            then(final)

    _SEAL.run(str(final), seal, background)
    if not background:
        wait_for_checkpoints()
    return final


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any],
    keep_last: int = 3,
    protect: Iterable[str | Path] = (),
    background: bool = False,
    sparse: Any = None,
) -> Path:
    """Write ``root/step_<step>`` atomically (all ranks call this), then keep the newest ``keep_last``.

    Args:
        model: the (possibly DDP-wrapped) model.
        optimizers: all optimizers of the run, in a fixed order.
        extra: JSON-able trainer state (data position, config, ...); stored in ``trainer_state.json``.
        protect: checkpoints never pruned by this call (the trainer's last checkpoint known to be good).
        background: return once the files are written; hashing, manifest, rename and pruning run in a
            background thread (:func:`wait_for_checkpoints` joins it; the next save does too).
        sparse: the ``gem_parallel.sparse.SparseSharding`` of TorchRec-sharded tables, whose fused
            optimizer state is saved too (None: no sharded tables).
    Returns:
        The final checkpoint directory (in place on return, or once sealed with ``background``).
    """
    root = Path(root)
    keep = [*protect]

    def prune(final: Path) -> None:
        prune_checkpoints(root, keep_last, [*keep, final])

    return write_checkpoint(
        root, f"step_{step:08d}", step, model, optimizers, extra, background, then=prune, sparse=sparse
    )


def save_best_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any],
    background: bool = False,
    sparse: Any = None,
) -> Path:
    """Write ``root/best_step_<step>`` atomically and point the link ``root/best`` at it (all ranks call).

    The older ``best_step_*`` directories are removed once the link has moved, so a crash at any point leaves
    ``root/best`` naming a complete checkpoint (the old or the new one). ``extra`` as in
    :func:`save_checkpoint` (the trainer stores the validation metrics that made it the best there);
    ``background`` too (the link moves when the seal is done).

    Returns:
        ``root/best`` (the link).
    """
    root = Path(root)
    name = f"best_step_{step:08d}"
    link = root / BEST_LINK

    def relink(final: Path) -> None:
        tmp_link = root / f"{TMP_PREFIX}{BEST_LINK}"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(name, tmp_link)  # relative: the run directory may be moved
        os.replace(tmp_link, link)  # atomic: readers see the old or the new target, never neither
        fsync_dir(root)
        for d in root.iterdir():
            if BEST_RE.match(d.name) and d.name != name:
                remove_checkpoint(d)

    write_checkpoint(root, name, step, model, optimizers, extra, background, then=relink, sparse=sparse)
    return link
