"""Sealing a written checkpoint: hash its files, write the manifest, rename it into place — in the background.

``dcp.save`` returns once every rank's files are written and fsynced. What makes the directory a checkpoint is
the manifest (:mod:`gem_train.checkpoint.manifest`: every file's size and sha256) and the rename that follows
it. Hashing costs about 3 s per 4 GB on one core here (``benchmarks/bench_checkpoint_hashing.py``), so the
trainer seals in a background thread and training goes on meanwhile: the hashing stays off the training step.
Until the seal is done the new checkpoint does not exist (it is still ``.tmp-<name>``) and the previous one is
still there, so a crash at any moment leaves a complete checkpoint.

The seal of one checkpoint, on every rank (a file system shared by the ranks, as DCP's ``FileSystemWriter``
assumes; no collective runs in the thread):

- each rank hashes the files it wrote itself (the ranks share the hashing);
- a rank other than 0 writes its digests to ``<tmp>/.digests-rank<r>.json`` (atomically) and is done;
- rank 0 waits for those files (:data:`SEAL_TIMEOUT_S`), removes them, and calls ``finish`` with all the
  digests: the caller's fsync, manifest, rename and pruning.

:class:`BackgroundSeal` runs one seal at a time per process; :func:`gem_train.checkpoint.wait_for_checkpoints`
joins it on every rank and lets every rank see the same verdict.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from gem_train.checkpoint.errors import CheckpointError
from gem_train.checkpoint.manifest import FileDigest, fsync_dir, hash_file

__all__ = ["DIGESTS_PREFIX", "SEAL_TIMEOUT_S", "BackgroundSeal", "exchange_digests", "hash_files"]

SEAL_TIMEOUT_S = 1800.0  # rank 0 waits this long for another rank's digests (hashing GBs takes seconds)
DIGESTS_PREFIX = ".digests-rank"
_POLL_S = 0.02


def hash_files(directory: Path, names: Iterable[str]) -> dict[str, FileDigest]:
    """``{name: size and sha256}`` of the files ``names`` in ``directory``."""
    return {n: hash_file(directory / n) for n in sorted(set(names))}


def _digests_path(directory: Path, rank: int) -> Path:
    return directory / f"{DIGESTS_PREFIX}{rank}.json"


def exchange_digests(
    directory: Path,
    rank: int,
    world: int,
    own: Mapping[str, FileDigest],
    timeout_s: float = SEAL_TIMEOUT_S,
) -> dict[str, FileDigest] | None:
    """Bring every rank's digests to rank 0 through ``directory``.

    A rank other than 0 writes its digests (fsynced, renamed into place) and gets None. Rank 0 waits for
    every other rank's file, reads and removes them, and gets the union with ``own``.
    """
    if rank != 0:
        path = _digests_path(directory, rank)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({n: [d.size, d.sha256] for n, d in own.items()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)
        return None
    merged = dict(own)
    deadline = time.monotonic() + timeout_s
    for r in range(1, world):
        path = _digests_path(directory, r)
        while not path.is_file():
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"{directory}: rank {r} did not report the digests of its files within {timeout_s:.0f} s "
                    "(did it die?); this checkpoint stays incomplete"
                )
            time.sleep(_POLL_S)
        for name, (size, sha) in json.loads(path.read_text(encoding="utf-8")).items():
            merged[name] = FileDigest(int(size), str(sha))
        path.unlink()
    if world > 1:
        fsync_dir(directory)
    return merged


class BackgroundSeal:
    """At most one seal in flight in this process: :meth:`run` starts one (in a daemon thread, or inline),
    :meth:`join` waits for it and returns its failure as a message (None: it succeeded or none ran).

    The thread is a daemon: a process stopped at once (a second signal, a crash) does not wait for it, and
    the checkpoint it was sealing stays ``.tmp-*`` (never listed), the previous one complete.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def pending(self) -> bool:
        """Whether a seal is still running."""
        return self._thread is not None and self._thread.is_alive()

    def run(self, what: str, seal: Callable[[], None], background: bool) -> None:
        """Run ``seal`` (``what`` names the checkpoint in an error); the previous seal must be joined."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint seal is still pending: join it first")

        def body() -> None:
            try:
                seal()
            except BaseException as e:  # reported by join() on this rank, then on every rank
                self._error = f"sealing checkpoint {what} failed: {type(e).__name__}: {e}"

        if not background:
            body()
            return
        self._thread = threading.Thread(target=body, name=f"gem-train-seal-{Path(what).name}", daemon=True)
        self._thread.start()

    def join(self) -> str | None:
        """Wait for the seal in flight (if any); its failure message, or None. Clears the failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error
