"""A rank SIGKILLed in the middle of a 4-process run (HSDP 2x2, EP 2, gloo): every other rank exits with a
clear error well within the collective timeout (no hang), and the newest complete checkpoint loads."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest

from gem_parallel.testing import run_distributed
from gem_train.checkpoint import latest_checkpoint, read_trainer_state
from gem_train.cli import main
from gem_train.data.synthetic import SyntheticAds

COLLECTIVE_TIMEOUT_S = 240.0  # the process group's timeout (run_distributed's); start-up counts too here
ARGS = [
    "data.batch_size=8", "data.eval_batch_size=32", "data.synthetic.eval_examples=100",
    "model.overrides.n_layers=1", 'model.overrides.attention="full"', "data.synthetic.max_len=12",
    "data.synthetic.num_users=300", "data.synthetic.num_items=200", "train.log_every=1",
    "train.progress_bar=false", "train.steps=8", "checkpoint.every=2",
    "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2",
]  # fmt: skip
VICTIM = 2
KILL_STEP = 4  # 1-based: the victim dies fetching its batch of step 4 (the checkpoint of step 2 exists)


def _worker(rank: int, world_size: int, out: str) -> dict:
    orig = SyntheticAds.get

    def get(self, split, index, batch_size):
        if split == "train" and rank == VICTIM and index == (KILL_STEP - 1) * world_size + rank:
            Path(out, "killed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(self, split, index, batch_size)

    SyntheticAds.get = get  # type: ignore[method-assign]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *ARGS, f"run.out_dir={out}/runs"])
    # expect_failure hands back exit codes only: each survivor leaves its own outcome next to the run.
    result = {"code": code, "stderr": err.getvalue()[-3000:], "ended_at": time.time()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    return result


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_rank_makes_every_other_rank_fail_clearly_and_the_last_checkpoint_loads(tmp_path, capsys):
    outcomes = run_distributed(__file__, "_worker", 4, kwargs={"out": str(tmp_path)},
                               timeout_s=COLLECTIVE_TIMEOUT_S, expect_failure=True)  # fmt: skip
    killed_at = float((tmp_path / "killed_at").read_text())
    assert outcomes[VICTIM].returncode == -signal.SIGKILL
    for o in outcomes:
        if o.rank == VICTIM:
            continue
        assert o.returncode == 0, (o.rank, o.returncode, o.message, o.stderr_tail[-2000:])
        r = json.loads((tmp_path / f"rank{o.rank}.json").read_text())
        # main() caught the failed collective: exit status 1 and a message that says what happened.
        assert r["code"] == 1, (o.rank, r["stderr"])
        assert f"gem-train: error: rank {o.rank}: a collective failed" in r["stderr"], r["stderr"]
        assert "another rank died or did not answer" in r["stderr"]
        assert r["ended_at"] - killed_at < COLLECTIVE_TIMEOUT_S, (o.rank, r["ended_at"] - killed_at)
    run = next((tmp_path / "runs").iterdir())
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None and read_trainer_state(ckpt)["step"] == 2
    assert main(["eval", "--checkpoint", str(ckpt), "--batches", "1"]) == 0
    assert "split:" in capsys.readouterr().out
