"""Atomic, verified, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint directory ``checkpoints/step_<N>/`` holds

- the DCP shards (``*.distcp`` + ``.metadata``) of every tensor of the training state: model weights,
  optimizer state (``get_state_dict`` FQN-keyed, so a DDP/FSDP wrapper does not change the keys), and each
  rank's RNG states;
- ``trainer_state.json``: everything that is not a tensor: step, data position, optimizer ``param_groups``,
  Python/NumPy RNG, world size, the resolved config;
- ``manifest.json``: the size and sha256 of every other file (:mod:`gem_train.manifest`), written last.

**Loading never runs code.** ``.metadata`` is unpickled by an allowlist unpickler
(:class:`gem_train.dcp_storage.SafeFileSystemReader`), tensors with ``torch.load(weights_only=True)``, the
rest is JSON. **Loading never reads a corrupt checkpoint**: :func:`verify_checkpoint` checks the manifest
(no file missing or extra, sizes, sha256; ranks share the hashing and agree on the verdict) before anything
else is read, and :func:`read_trainer_state` checks the JSON's digest and its keys. Every failure is a
:class:`CheckpointError` naming the directory and the file.

**Writing is atomic.** Every rank writes into ``checkpoints/.tmp-<name>`` (DCP fsyncs each file); rank 0
adds ``trainer_state.json``. Then the directory is *sealed* (:mod:`gem_train.sealing`): each rank hashes
its own files, rank 0 collects the digests, fsyncs every file and the directory, writes the manifest, and
renames the directory to ``<name>`` (``rename(2)``), then fsyncs the parent. With ``background=True`` (what
the trainer uses) the seal runs in a thread while training goes on, so the hashing costs no training time;
:func:`wait_for_checkpoints` joins it, and every save joins the previous one first. A crash before the
rename leaves a ``.tmp-*`` directory, which is never listed and is removed later.

**There is always a complete checkpoint.** A new checkpoint is in place before an old one is removed
(keep-last-K pruning runs after the rename, for every K). Saving a step that already has a checkpoint (e.g.
SIGTERM right after a periodic save) first renames the old copy to ``.replaced-<name>``, then renames the new
one into place, then removes the old: :func:`list_checkpoints` takes ``.replaced-step_<N>`` for step N while
``step_<N>`` is absent, so a crash between the two renames still leaves step N loadable. Removal renames a
directory to ``.trash-*`` first, so a half-deleted directory never carries a checkpoint's name.

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
from collections.abc import Callable, Iterable
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

from gem_train.dcp_storage import RecordingFileSystemWriter, SafeFileSystemReader, safe_load_metadata
from gem_train.errors import CheckpointError
from gem_train.manifest import (
    MANIFEST,
    check_files,
    digest_bytes,
    fsync_dir,
    fsync_file,
    read_manifest,
    write_manifest,
)
from gem_train.sealing import BackgroundSeal, exchange_digests, hash_files

__all__ = [
    "BEST_LINK",
    "CheckpointError",
    "best_checkpoint",
    "capture_rng_state",
    "checkpoint_pending",
    "checkpoint_step",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "read_trainer_state",
    "remove_checkpoint",
    "restore_rng_state",
    "save_best_checkpoint",
    "save_checkpoint",
    "set_aside_checkpoint",
    "verify_checkpoint",
    "wait_for_checkpoints",
]

STATE_FILE = "trainer_state.json"
SPARSE_OPTIM = "sparse_optim"  # DCP key of the fused optimizer state of TorchRec-sharded tables
_STEP_RE = re.compile(r"^step_(\d+)$")
_BEST_RE = re.compile(r"^best_step_(\d+)$")
BEST_LINK = "best"  # checkpoints/best -> best_step_<N>
_TMP = ".tmp-"  # being written
_REPLACED = ".replaced-"  # the previous copy of a step saved again, until the new copy is in place
_TRASH = ".trash-"  # being removed


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


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


def _is_complete(d: Path) -> bool:
    return d.is_dir() and (d / MANIFEST).is_file()


def checkpoint_step(path: str | Path) -> int | None:
    """The step of a checkpoint directory name (``step_<N>``, ``best_step_<N>``, ``.replaced-step_<N>``),
    or None."""
    name = Path(path).name
    name = name.removeprefix(_REPLACED)
    m = _STEP_RE.match(name) or _BEST_RE.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first: ``step_<N>`` directories with a manifest, and
    ``.replaced-step_<N>`` for a step whose ``step_<N>`` is absent (a crash while that step was re-saved)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    replaced: dict[int, Path] = {}
    for d in root.iterdir():
        is_replaced = d.name.startswith(_REPLACED)
        m = _STEP_RE.match(d.name.removeprefix(_REPLACED))
        if m and _is_complete(d):
            (replaced if is_replaced else found)[int(m.group(1))] = d
    for step, d in replaced.items():
        found.setdefault(step, d)
    return [found[s] for s in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def best_checkpoint(root: str | Path) -> Path | None:
    """``root/best`` (the link to the best-validation checkpoint) if it names a complete checkpoint (or the
    ``.replaced-`` copy of its target while that is being re-saved); else None."""
    root = Path(root)
    link = root / BEST_LINK
    if _is_complete(link):
        return link
    if link.is_symlink():
        old = root / (_REPLACED + os.readlink(link))
        if _is_complete(old):
            return old
    return None


# ----------------------------------------------------------------------------------------------------------
# Reading and verifying
# ----------------------------------------------------------------------------------------------------------

_STATE_KEYS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "world_size": int,
    "data_position": int,
    "optim_param_groups": list,
    "rng_plain": list,
    "config": dict,
}


def _check_state(state: Any, path: Path) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: corrupt trainer state (a JSON {type(state).__name__}, not an object)")
    for key, tp in _STATE_KEYS.items():
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
    return _check_state(state, path)


def verify_checkpoint(ckpt_dir: str | Path) -> None:
    """Check the whole checkpoint before it is loaded (all ranks call; every rank reaches the same verdict).

    The manifest (no file missing or extra, every size and sha256; each rank hashes its share of the
    files) and the safe unpickling of ``.metadata``. Raises :class:`CheckpointError` listing each damaged
    file.
    """
    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank(), _world()
    problems: list[str] = []
    try:
        if not ckpt_dir.is_dir():
            raise CheckpointError(f"checkpoint {ckpt_dir} does not exist (or is not a directory)")
        manifest = read_manifest(ckpt_dir)
        problems = check_files(ckpt_dir, manifest, hash_names=sorted(manifest)[rank::world])
        if not problems and ".metadata" in manifest:
            safe_load_metadata(ckpt_dir / ".metadata")
        elif not problems:
            problems = [f"{ckpt_dir}: no DCP .metadata in {MANIFEST}: not a gem-train checkpoint"]
    except CheckpointError as e:
        problems = [str(e)]
    merged: list[str] = []
    for part in _all_gather(problems):
        merged += [p for p in part if p not in merged]
    if merged:
        if len(merged) == 1:
            raise CheckpointError(merged[0])
        raise CheckpointError(f"checkpoint {ckpt_dir} is damaged:\n  " + "\n  ".join(merged[:20]))


# ----------------------------------------------------------------------------------------------------------
# Save
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
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def _rename(src: Path, dst: Path) -> None:
    """``rename(2)`` then fsync of the parent (one place, so tests can inject a crash between steps)."""
    os.rename(src, dst)
    fsync_dir(dst.parent)


def remove_checkpoint(path: str | Path) -> None:
    """Remove a checkpoint directory: renamed to ``.trash-<name>`` first (atomic), then deleted, so a crash
    mid-delete never leaves a partial directory under a checkpoint's name."""
    path = Path(path)
    if not path.exists():
        return
    trash = path.parent / (_TRASH + path.name.removeprefix(_REPLACED))
    if trash.exists():
        shutil.rmtree(trash)
    _rename(path, trash)
    shutil.rmtree(trash)


def set_aside_checkpoint(path: str | Path, prefix: str = "nonfinite-") -> Path:
    """Rename a checkpoint to ``<prefix><name>`` (no longer listed, kept for inspection); returns the new
    path. Call on one rank only."""
    path = Path(path)
    dest = path.parent / (prefix + path.name.removeprefix(_REPLACED))
    if dest.exists():
        shutil.rmtree(dest)
    _rename(path, dest)
    return dest


def _install(tmp: Path, final: Path) -> None:
    """Move the complete ``tmp`` to ``final``; an existing ``final`` stays as ``.replaced-<name>`` until the
    new one is in place."""
    old = final.parent / (_REPLACED + final.name)
    if final.exists() and not _is_complete(final):
        remove_checkpoint(final)  # not a checkpoint (a partial copy): nothing to keep
    if final.exists():
        if old.exists():
            remove_checkpoint(old)  # a leftover of an earlier crash: the complete `final` supersedes it
        _rename(final, old)
    _rename(tmp, final)
    if old.exists():
        remove_checkpoint(old)


_SEAL = BackgroundSeal()


def checkpoint_pending() -> bool:
    """Whether this process is still sealing a checkpoint in the background (hashing, manifest, rename)."""
    return _SEAL.pending()


def wait_for_checkpoints() -> None:
    """Wait until the checkpoint being sealed in the background is in place (all ranks call; a no-op when
    none is). Raises :class:`CheckpointError` on every rank if the seal failed on any."""
    errors = [e for e in _all_gather(_SEAL.join()) if e is not None]
    if errors:
        raise CheckpointError("; ".join(dict.fromkeys(errors)))


def _write_checkpoint(
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
    ``background`` (:mod:`gem_train.sealing`). Waits for the previous seal first."""
    wait_for_checkpoints()
    rank, world = _rank(), _world()
    final = root / name
    tmp = root / f"{_TMP}{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()

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
    gathered = _all_gather(rng_plain)
    if rank == 0:
        trainer_state = dict(extra)
        trainer_state.update(
            step=int(step),
            data_position=int(extra.get("data_position", step)),
            optim_param_groups=_jsonable_groups(cast(list[dict[str, Any]], optim_sd["param_groups"])),
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
        _fsync_tree(tmp)  # DCP fsynced its files; this covers every rank's files and the directory
        write_manifest(tmp, digests)  # last: its presence marks the directory complete
        _install(tmp, final)
        if then is not None:
            then(final)

    _SEAL.run(str(final), seal, background)
    if not background:
        wait_for_checkpoints()
    return final


def prune_checkpoints(root: str | Path, keep_last: int, protect: Iterable[str | Path] = ()) -> None:
    """Keep the newest ``keep_last`` complete checkpoints under ``root`` (and those in ``protect``); remove
    the older ones and leftovers of interrupted writes (``.tmp-*``, ``.trash-*``). Call on one rank only,
    with no save in flight."""
    root = Path(root)
    keep = {Path(p).name for p in protect}
    ckpts = list_checkpoints(root)
    keep |= {c.name for c in ckpts[-keep_last:]} if keep_last > 0 else {c.name for c in ckpts}
    for c in ckpts:
        if c.name not in keep:
            remove_checkpoint(c)
    for d in root.iterdir() if root.is_dir() else ():
        if d.name.startswith((_TMP, _TRASH)) and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)


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

    return _write_checkpoint(
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
        tmp_link = root / f"{_TMP}{BEST_LINK}"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(name, tmp_link)  # relative: the run directory may be moved
        os.replace(tmp_link, link)  # atomic: readers see the old or the new target, never neither
        fsync_dir(root)
        for d in root.iterdir():
            if _BEST_RE.match(d.name) and d.name != name:
                remove_checkpoint(d)

    _write_checkpoint(root, name, step, model, optimizers, extra, background, then=relink, sparse=sparse)
    return link


# ----------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------


def _dcp_error_line(e: BaseException) -> str:
    """The message of the first real error inside DCP's wrapped exception."""
    if isinstance(e, CheckpointException):
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                return str(exc)
    lines = [ln.strip() for ln in str(e).splitlines() if "Error:" in ln] or [str(e)]
    return lines[-1]


def load_checkpoint(
    ckpt_dir: str | Path,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer] | None,
    restore_rng: bool = True,
    *,
    reshard: bool = False,
    sparse: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint in place into ``model`` (and ``optimizers``, and this rank's RNG); all ranks call.

    The checkpoint is verified first (:func:`verify_checkpoint`). Model and optimizer tensors are FQN-keyed
    and loaded by DCP, which reshards them: a checkpoint of FSDP2 DTensors loads into a plain model (one
    process) and the other way round, on any world size. Resuming on another world size than the one that
    wrote the checkpoint needs ``reshard=True``; the RNG states are per rank, so they are then *not*
    restored (``trainer_state["resharded"]`` is True) and the caller reseeds. Loading the model alone
    (evaluation) works on any world size. ``sparse``: the run's ``SparseSharding`` (TorchRec-sharded tables),
    whose fused optimizer state is loaded too. Between a run with TorchRec-sharded tables and one without
    (``parallel.strategy``), the tables' row-wise Adagrad accumulators have different homes (fused in the
    TBE kernels vs :class:`gem_train.optim.RowWiseAdagrad`): with ``reshard`` the weights and every other
    state still load, and those accumulators restart at zero (``trainer_state["sparse_state_reset"]``).

    Returns the JSON trainer state (``step``, data position, config, ...). Raises :class:`CheckpointError`
    if the checkpoint is incomplete, damaged, unsafe, of another world size (without ``reshard``), or does
    not match the model.
    """
    ckpt_dir = Path(ckpt_dir)
    verify_checkpoint(ckpt_dir)
    trainer_state = read_trainer_state(ckpt_dir)
    rank, world = _rank(), _world()
    optimizers = optimizers or []
    saved_world = trainer_state["world_size"]
    if (optimizers or restore_rng) and saved_world != world and not reshard:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was written by {saved_world} process(es) and this run has {world}: "
            "its RNG states are per rank; resume with reshard=True (the trainer does: the data position "
            "carries over, the RNG streams are reseeded), or evaluate it with `gem-train eval --checkpoint`"
            " (any world size)"
        )
    restore_rng = restore_rng and saved_world == world
    saved_sparse = trainer_state.get("sparse_strategy")
    current_sparse = None if sparse is None else str(sparse.strategy)
    sparse_reset = bool(optimizers) and (saved_sparse is None) != (current_sparse is None)
    if sparse_reset and not reshard:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has {'no ' if saved_sparse is None else ''}TorchRec-sharded tables and "
            f"this run has {'none' if current_sparse is None else current_sparse}: resume with reshard=True"
        )
    if sparse is not None:
        sparse.prepare_checkpoint()
    model_sd, optim_sd = get_state_dict(model, optimizers)
    rng_tensors, _ = capture_rng_state()
    state: dict[str, Any] = {"model": model_sd}
    if optimizers:
        state["optim"] = optim_sd["state"]
        if sparse is not None and not sparse_reset:
            state[SPARSE_OPTIM] = sparse.fused_optimizer.state_dict()
    if restore_rng:
        state[f"rng/rank{rank}"] = rng_tensors
    try:
        # Only the optimizer state the checkpoint cannot have (the other home of the tables'
        # accumulators) may be missing: everything else must be there.
        planner = _TensorsOnlyLoadPlanner(allow_partial_load=sparse_reset)
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt_dir), planner=planner)
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        # DCP wraps each rank's traceback; keep the error line ("Missing key in checkpoint ...").
        raise CheckpointError(
            f"cannot load checkpoint {ckpt_dir} into this model: {_dcp_error_line(e)}"
        ) from e
    if optimizers:
        # The hyper-parameters are the saved ones; the parameter names are this rank's (under expert
        # parallelism each rank holds other experts, and only rank 0's groups are in the JSON).
        saved = _restore_groups(trainer_state["optim_param_groups"])
        current = cast(list[dict[str, Any]], optim_sd["param_groups"])
        if len(saved) != len(current) and not sparse_reset:
            raise CheckpointError(
                f"cannot load checkpoint {ckpt_dir}: {len(saved)} optimizer parameter groups, this run has "
                f"{len(current)}"
            )
        # Across sharded and unsharded tables the dense optimizer's groups (first) are common; the row-wise
        # Adagrad of unsharded tables exists on one side only and keeps this run's settings.
        groups = [{**g, "params": c["params"]} for g, c in zip(saved, current, strict=False)]
        groups += current[len(groups) :]
        set_state_dict(
            model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict={"state": state["optim"], "param_groups": groups},
        )
        if SPARSE_OPTIM in state:
            sparse.fused_optimizer.load_state_dict(state[SPARSE_OPTIM])
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    if restore_rng:
        restore_rng_state(state[f"rng/rank{rank}"], trainer_state["rng_plain"][rank])
    trainer_state["resharded"] = saved_world != world
    trainer_state["sparse_state_reset"] = sparse_reset
    return trainer_state
