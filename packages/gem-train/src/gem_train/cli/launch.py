"""``gem-train launch``: torchrun that exits 0 when it is stopped by a signal and every worker saved.

``torchrun`` forwards SIGTERM/SIGINT to its workers' process groups, waits for them (``--shutdown-timeout``,
30 s by default, then SIGKILL) and then raises, so it exits non-zero even when every worker finished its
step, wrote its checkpoint and exited 0. ``gem-train launch`` runs torchrun's own launcher in this process
(``torch.distributed.run``, same options) with ``GEM_TRAIN_STATUS_DIR`` set; each ``gem-train`` worker
that ends cleanly writes a status file there (:func:`write_worker_status`). When the launcher stops on a
signal it exits 0 if all its local workers reported a complete checkpoint of the same step (and prints how
to resume), and ``128 + signal`` otherwise; a worker failure exits 1, as with torchrun.

    gem-train launch --standalone --nproc-per-node 2 train --config tiny-cpu
    # = torchrun --standalone --nproc-per-node 2 -m gem_train.cli train --config tiny-cpu

With several workers per node and no ``OMP_NUM_THREADS`` set, each worker gets ``OMP_NUM_THREADS=1``, as
torchrun would give it (without torchrun's banner saying so). ``gem-train launch --help`` prints its help.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["COMMANDS", "STATUS_ENV", "main", "write_worker_status"]

STATUS_ENV = "GEM_TRAIN_STATUS_DIR"
COMMANDS = ("train", "eval", "bench", "baseline", "data", "config")


def write_worker_status(status: str, step: int, checkpoint: str | Path | None) -> None:
    """Tell ``gem-train launch`` (if it started this worker) how this worker ended; atomic (rename)."""
    directory = os.environ.get(STATUS_ENV)
    if not directory:
        return
    rank = os.environ.get("LOCAL_RANK", "0")
    path = Path(directory) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"status": status, "step": step, "checkpoint": str(checkpoint) if checkpoint else None})
    )
    os.replace(tmp, path)


def _read_statuses(directory: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(directory.glob("rank*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def main(argv: list[str]) -> int:
    """``argv``: torchrun's options, then a gem-train command and its arguments. Returns the exit status."""
    cut = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if cut is None:
        print(
            "gem-train launch: usage: gem-train launch [torchrun options] COMMAND [args] "
            f"(COMMAND one of {', '.join(COMMANDS)}), e.g. gem-train launch --standalone --nproc-per-node 2 "
            "train --config tiny-cpu",
            file=sys.stderr,
        )
        return 2
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, parse_args, run

    args = parse_args([*argv[:cut], "-m", "gem_train.cli", *argv[cut:]])
    nproc = determine_local_world_size(args.nproc_per_node)
    if nproc > 1:
        # torchrun's own default, set here so that torchrun does not print its banner about it on every run.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    status_dir = Path(tempfile.mkdtemp(prefix="gem-launch-"))
    os.environ[STATUS_ENV] = str(status_dir)  # the workers inherit the launcher's environment
    try:
        run(args)
        return 0
    except SignalException as e:
        # torchrun has already forwarded the signal and waited for the workers to exit.
        name = signal.Signals(e.sigval).name
        reports = _read_statuses(status_dir)
        done = [r for r in reports if r.get("status") in ("interrupted", "completed") and r.get("checkpoint")]
        same = {(r["step"], r["checkpoint"]) for r in done}
        if len(done) == nproc and len(same) == 1:
            step, ckpt = same.pop()
            print(
                f"gem-train launch: {name} received: all {nproc} workers stopped after step {step}; "
                f"checkpoint {ckpt} is complete\n  resume with: gem-train launch {' '.join(argv[:cut])} "
                f"train --resume {ckpt}",
                file=sys.stderr,
            )
            return 0
        print(
            f"gem-train launch: {name} received: {len(done)} of {nproc} workers reported a complete "
            "checkpoint (the newest complete checkpoint of the run is still usable with --resume)",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # Each worker printed its own error above; say which ended how (torchrun's report is a framed block
        # pointing at error files that gem-train workers do not write).
        how = {r: f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit status {f.exitcode}"
               for r, f in e.failures.items()}  # fmt: skip
        ended = ", ".join(f"rank {r}: {how[r]}" for r in sorted(how))
        print(f"gem-train launch: {len(how)} of the {nproc} workers here failed ({ended})", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
