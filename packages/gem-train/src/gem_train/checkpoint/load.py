"""Verifying and loading a checkpoint with DCP: the manifest first, then a safe read of every tensor,
resharded to this run's layout."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gem_train.checkpoint.errors import CheckpointError
from gem_train.checkpoint.manifest import MANIFEST, check_files, read_manifest
from gem_train.checkpoint.ranks import all_gather, current_rank, world_size
from gem_train.checkpoint.rng import capture_rng_state, restore_rng_state
from gem_train.checkpoint.state import SPARSE_OPTIM, read_trainer_state, restore_groups
from gem_train.checkpoint.storage import SafeFileSystemReader, safe_load_metadata

__all__ = ["TensorsOnlyLoadPlanner", "dcp_error_line", "load_checkpoint", "verify_checkpoint"]


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that never unpickles: a non-tensor entry is loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        value.seek(0)
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def verify_checkpoint(ckpt_dir: str | Path) -> None:
    """Check the whole checkpoint before it is loaded (all ranks call; every rank reaches the same verdict).

    The manifest (no file missing or extra, every size and sha256; each rank hashes its share of the
    files) and the safe unpickling of ``.metadata``. Raises :class:`CheckpointError` listing each damaged
    file.
    """
    ckpt_dir = Path(ckpt_dir)
    rank, world = current_rank(), world_size()
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
    for part in all_gather(problems):
        merged += [p for p in part if p not in merged]
    if merged:
        if len(merged) == 1:
            raise CheckpointError(merged[0])
        raise CheckpointError(f"checkpoint {ckpt_dir} is damaged:\n  " + "\n  ".join(merged[:20]))


def dcp_error_line(e: BaseException) -> str:
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
    TBE kernels vs :class:`gem_train.loop.optim.RowWiseAdagrad`): with ``reshard`` the weights and every other
    state still load, and those accumulators restart at zero (``trainer_state["sparse_state_reset"]``).

    Returns the JSON trainer state (``step``, data position, config, ...). Raises :class:`CheckpointError`
    if the checkpoint is incomplete, damaged, unsafe, of another world size (without ``reshard``), or does
    not match the model.
    """
    ckpt_dir = Path(ckpt_dir)
    verify_checkpoint(ckpt_dir)
    trainer_state = read_trainer_state(ckpt_dir)
    rank, world = current_rank(), world_size()
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
        planner = TensorsOnlyLoadPlanner(allow_partial_load=sparse_reset)
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt_dir), planner=planner)
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        # DCP wraps each rank's traceback; keep the error line ("Missing key in checkpoint ...").
        raise CheckpointError(
            f"cannot load checkpoint {ckpt_dir} into this model: {dcp_error_line(e)}"
        ) from e
    if optimizers:
        # The hyper-parameters are the saved ones; the parameter names are this rank's (under expert
        # parallelism each rank holds other experts, and only rank 0's groups are in the JSON).
        saved = restore_groups(trainer_state["optim_param_groups"])
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
