"""Atomic, verified, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint directory ``checkpoints/step_<N>/`` holds

- the DCP shards (``*.distcp`` + ``.metadata``) of every tensor of the training state: model weights,
  optimizer state (``get_state_dict`` FQN-keyed, so a DDP/FSDP wrapper does not change the keys), and each
  rank's RNG states;
- ``trainer_state.json``: everything that is not a tensor: step, data position, optimizer ``param_groups``,
  Python/NumPy RNG, world size, the resolved config;
- ``manifest.json``: the size and sha256 of every other file (:mod:`gem_train.checkpoint.manifest`), written
  last.

**Loading never runs code.** ``.metadata`` is unpickled by an allowlist unpickler
(:class:`gem_train.checkpoint.storage.SafeFileSystemReader`), tensors with ``torch.load(weights_only=True)``,
the rest is JSON. **Loading never reads a corrupt checkpoint**: :func:`verify_checkpoint` checks the manifest
(no file missing or extra, sizes, sha256; ranks share the hashing and agree on the verdict) before anything
else is read, and :func:`read_trainer_state` checks the JSON's digest and its keys. Every failure is a
:class:`CheckpointError` naming the directory and the file.

**Writing is atomic.** Every rank writes into ``checkpoints/.tmp-<name>`` (DCP fsyncs each file); rank 0
adds ``trainer_state.json``. Then the directory is *sealed* (:mod:`gem_train.checkpoint.sealing`): each rank
hashes its own files, rank 0 collects the digests, fsyncs every file and the directory, writes the manifest,
and renames the directory to ``<name>`` (``rename(2)``), then fsyncs the parent. With ``background=True``
(what the trainer uses) the seal runs in a thread while training goes on, so the hashing costs no training
time; :func:`wait_for_checkpoints` joins it, and every save joins the previous one first. A crash before the
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

Modules: :mod:`.layout` (names, listing, finding), :mod:`.atomic` (durable renames, install, removal,
pruning), :mod:`.state` (``trainer_state.json``), :mod:`.rng`, :mod:`.manifest` and :mod:`.sealing`
(integrity), :mod:`.storage` (DCP reader/writer), :mod:`.save`, :mod:`.load`, :mod:`.keeper` (which
checkpoints are good), :mod:`.errors`.
"""

from gem_train.checkpoint.atomic import prune_checkpoints, remove_checkpoint, set_aside_checkpoint
from gem_train.checkpoint.errors import CheckpointError
from gem_train.checkpoint.layout import (
    BEST_LINK,
    best_checkpoint,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
)
from gem_train.checkpoint.load import load_checkpoint, verify_checkpoint
from gem_train.checkpoint.rng import capture_rng_state, restore_rng_state
from gem_train.checkpoint.save import (
    checkpoint_pending,
    save_best_checkpoint,
    save_checkpoint,
    wait_for_checkpoints,
)
from gem_train.checkpoint.state import read_trainer_state

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
    "resolve_checkpoint",
    "restore_rng_state",
    "save_best_checkpoint",
    "save_checkpoint",
    "set_aside_checkpoint",
    "verify_checkpoint",
    "wait_for_checkpoints",
]
