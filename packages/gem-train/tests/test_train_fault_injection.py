"""Fault injection (slow): 20 SIGKILLs at random moments of a `gem-train train` run, each followed by a
resume of the run; the losses of every step and the final metrics are bit-identical to an uninterrupted run.

Checkpoints every step (so many kills land inside a checkpoint write or its background seal), keep_last=2.
A kill before the first checkpoint starts the run afresh. Run with ``pytest -m slow -k fault``.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from gem_train.checkpoint import latest_checkpoint, read_trainer_state

TOTAL = 120

ARGS = [
    "data.batch_size=16", "data.eval_batch_size=128", "data.synthetic.eval_examples=256",
    "data.synthetic.max_len=8", "model.overrides.n_layers=1", 'model.overrides.attention="full"',
    "data.synthetic.num_users=300", "data.synthetic.num_items=200", "train.log_every=1",
    "train.progress_bar=false", "optim.warmup_steps=2", f"train.steps={TOTAL}", "checkpoint.every=1",
    "checkpoint.keep_last=2",
]  # fmt: skip
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _train_losses(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]


def _start(out, resume=None):
    cmd = [sys.executable, "-m", "gem_train.cli", "train", *ARGS, f"run.out_dir={out}"]
    if resume is not None:
        cmd[4:4] = ["--resume", str(resume)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_twenty_random_sigkills_resume_bit_identically(tmp_path):
    t0 = time.monotonic()
    ref = _start(tmp_path / "ref")
    first_row = None
    while ref.poll() is None:
        if first_row is None and list((tmp_path / "ref").glob("*/metrics.jsonl")):
            first_row = time.monotonic() - t0
        time.sleep(0.1)
    assert ref.returncode == 0, ref.stderr.read()
    wall = time.monotonic() - t0
    startup = first_row or wall / 2
    (ref_run,) = (tmp_path / "ref").iterdir()
    want_losses = _train_losses(ref_run)
    want_eval = json.loads((ref_run / "eval.json").read_text())["tasks"]

    rng = random.Random(14)
    out = tmp_path / "killed"
    kills = 0
    while kills < 20:
        runs = list(out.glob("*")) if out.exists() else []
        ckpt = latest_checkpoint(runs[0] / "checkpoints") if runs else None
        if runs and ckpt is None:
            shutil.rmtree(out)  # killed before its first checkpoint: start afresh
        done_frac = read_trainer_state(ckpt)["step"] / TOTAL if ckpt is not None else 0.0
        proc = _start(out, resume=runs[0] if ckpt is not None else None)
        # Anywhere from the middle of start-up (imports, data, model, the resume's load) to a little into
        # training (at most 4% of the run, so 20 kills fit in it; every step writes a checkpoint).
        train_time = wall - startup
        time.sleep(rng.uniform(0.5 * startup, startup + min(0.9 * (1 - done_frac), 0.04) * train_time))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.read()[-3000:]
        if proc.returncode == 0:
            pytest.fail(f"the run finished after {kills} kills; lengthen it (train.steps) for 20")
    (run,) = out.iterdir()
    done = _start(out, resume=run)
    assert done.wait(timeout=600) == 0, done.stderr.read()[-3000:]
    assert _train_losses(run) == want_losses  # every step's loss, bit for bit
    assert json.loads((run / "eval.json").read_text())["tasks"] == want_eval
