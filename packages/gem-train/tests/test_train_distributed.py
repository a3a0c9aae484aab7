"""Two processes under torchrun (gloo, CPU) with no code change: train, evaluate, checkpoint; `gem-train
launch` stopped by SIGTERM; a 2-process checkpoint resumes in one process (resharded)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gem_train.checkpoint import list_checkpoints, read_trainer_state
from gem_train.cli import main


@pytest.mark.distributed
def test_torchrun_two_process_gloo_smoke(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "gem_train.cli", "train",
        "data.batch_size=16", "data.eval_batch_size=64", "data.synthetic.eval_examples=192",
        "data.synthetic.max_len=8", "data.synthetic.num_users=300", "data.synthetic.num_items=200",
        "model.overrides.n_layers=1", 'model.overrides.attention="full"',
        "train.steps=4", "train.log_every=2", "train.eval_every=2", "train.progress_bar=false",
        "checkpoint.every=2", f"run.out_dir={tmp_path}",
        "data.synthetic.valid_examples=128", "train.valid_every=2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1  # one run directory, made by rank 0 and shared
    run = runs[0]
    assert done.stdout.count("run directory:") == 1  # only rank 0 prints
    summary = json.loads((run / "eval.json").read_text())
    # Both ranks' shares of the evaluation split were gathered: all 192 examples are counted.
    assert summary["tasks"]["ctr"]["count"] == 192
    ckpts = list_checkpoints(run / "checkpoints")
    assert [c.name for c in ckpts] == ["step_00000002", "step_00000004"]
    state = read_trainer_state(ckpts[-1])
    assert state["world_size"] == 2 and len(state["rng_plain"]) == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4]
    # Model selection across ranks: the validation split is gathered too, and checkpoints/best (written by
    # both ranks, linked by rank 0) loads into the final test evaluation.
    valid = [r for r in rows if r["split"] == "valid"]
    assert [r["step"] for r in valid] == [2, 4] and all(r["ctr/count"] == 128 for r in valid)
    best = summary["best"]
    assert best["step"] == min(valid, key=lambda r: r["select_ne"])["step"]
    assert best["tasks"]["ctr"]["count"] == 192
    assert read_trainer_state(run / "checkpoints" / "best")["step"] == best["step"]


@pytest.mark.distributed
def test_launcher_sigterm_exits_0_once_all_workers_saved_and_resumes_on_one_process(tmp_path, capsys):
    """SIGTERM to the launcher (what a scheduler sends): torchrun forwards it to both workers (their loader
    workers included: data.num_workers=1), both finish the step and checkpoint, and `gem-train launch` exits
    0 saying how to resume. That 2-process checkpoint then resumes in one process, saying what differs."""
    cmd = [
        sys.executable, "-m", "gem_train.cli", "launch", "--standalone", "--nproc-per-node=2", "train",
        "data.batch_size=16", "data.eval_batch_size=64", "data.synthetic.eval_examples=64",
        "data.synthetic.max_len=8", "data.synthetic.num_users=300", "data.synthetic.num_items=200",
        "model.overrides.n_layers=1", 'model.overrides.attention="full"', "data.num_workers=1",
        "train.steps=100000", "train.log_every=1", "train.progress_bar=false", f"run.out_dir={tmp_path}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            found = list(tmp_path.glob("*/metrics.jsonl"))
            if found and len(found[0].read_text().splitlines()) >= 3:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        else:
            pytest.fail("training did not start in time")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert "gem-train launch: SIGTERM received: all 2 workers stopped after step" in err
    run = next(tmp_path.iterdir())
    (ckpt,) = list_checkpoints(run / "checkpoints")
    assert f"resume with: gem-train launch --standalone --nproc-per-node=2 train --resume {ckpt}" in err
    state = read_trainer_state(ckpt)
    assert state["world_size"] == 2 and state["step"] >= 3
    # The 2-process checkpoint resumes in one process (DCP reshards), one more step, and says what differs.
    assert main(["train", "--resume", str(ckpt), f"train.steps={state['step'] + 1}"]) == 0
    err = capsys.readouterr().err
    assert "resuming a 2-process checkpoint on 1 process(es)" in err and "not bit-identical" in err
    assert f"global batch {2 * state['step']}" in err
    # Evaluating it works on any world size.
    assert main(["eval", "--checkpoint", str(ckpt), "--batches", "1"]) == 0
