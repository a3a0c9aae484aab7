"""Two processes under torchrun (gloo, CPU) with no code change: train, evaluate, checkpoint."""

import json
import os
import subprocess
import sys

import pytest

from gem_train.checkpoint import list_checkpoints, read_trainer_state


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
