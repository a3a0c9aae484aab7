"""SIGTERM in a real process: checkpoint, clean exit, and the checkpoint resumes."""

import json
import os
import signal
import subprocess
import sys
import time

from gem_train.checkpoint import list_checkpoints, read_trainer_state

ARGS = [
    "data.batch_size=16",
    "data.eval_batch_size=128",
    "data.synthetic.eval_examples=128",
    "data.synthetic.max_len=8",
    "model.overrides.n_layers=1",
    'model.overrides.attention="full"',
    "data.synthetic.num_users=300",
    "data.synthetic.num_items=200",
    "train.log_every=1",
    "train.progress_bar=false",
    "optim.warmup_steps=1",
]


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "gem_train.cli",
        "train",
        *ARGS,
        "train.steps=100000",
        f"run.out_dir={tmp_path}",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 240
        metrics = None
        # Wait until training has logged a few steps.
        while time.time() < deadline:
            found = list(tmp_path.glob("*/metrics.jsonl"))
            if found and len(found[0].read_text().splitlines()) >= 3:
                metrics = found[0]
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        assert metrics is not None, "training did not start in time"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "SIGTERM received" in err and "resume with: gem-train train --resume" in err
    run = metrics.parent
    ckpts = list_checkpoints(run / "checkpoints")
    assert len(ckpts) == 1
    state = read_trainer_state(ckpts[0])
    last_logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert state["step"] >= 3 and state["step"] >= last_logged and state["data_position"] == state["step"]
    # The interrupted run resumes from its checkpoint and finishes.
    n = state["step"] + 2
    cmd = [sys.executable, "-m", "gem_train.cli", "train", "--resume", str(ckpts[0]), f"train.steps={n}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    assert f"evaluation after {n} steps" in done.stdout
    assert list_checkpoints(run / "checkpoints")[-1].name == f"step_{n:08d}"
