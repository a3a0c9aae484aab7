"""Checkpoints: round trip of model/optimizer/RNG, atomicity under a crash mid-write, keep-last-K."""

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from gem_train.checkpoint import (
    CheckpointError,
    best_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_trainer_state,
    save_best_checkpoint,
    save_checkpoint,
)


def _model_and_optims(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    dense = torch.optim.AdamW(m[2].parameters(), lr=1e-2, betas=(0.8, 0.9))
    sparse = torch.optim.Adagrad(m[0].parameters(), lr=0.1)
    return m, [dense, sparse]


def _train_step(m, opts):
    x = torch.randint(0, 10, (5, 2))
    loss = m(x).square().mean() + torch.rand(()) * 0  # consumes RNG like dropout would
    loss.backward()
    for o in opts:
        o.step()
        o.zero_grad()


def test_round_trip_restores_everything(tmp_path):
    m, opts = _model_and_optims(0)
    for _ in range(3):
        _train_step(m, opts)
    path = save_checkpoint(tmp_path, 3, m, opts, extra={"data_position": 17, "config": {"a": 1}})
    assert path.name == "step_00000003"
    _train_step(m, opts)  # what an uninterrupted run does next
    after = [p.detach().clone() for p in m.parameters()]

    m2, opts2 = _model_and_optims(1)  # different init, different RNG position
    state = load_checkpoint(path, m2, opts2)
    assert state["data_position"] == 17 and state["config"] == {"a": 1} and state["step"] == 3
    # One more step: identical weights to the uninterrupted run (weights, optimizer state and RNG restored).
    _train_step(m2, opts2)
    for a, b in zip(after, m2.parameters()):
        assert torch.equal(a, b)
    assert opts2[0].param_groups[0]["betas"] == (0.8, 0.9)


def test_rng_restored(tmp_path):
    m, opts = _model_and_optims(0)
    random.seed(5)
    np.random.seed(6)
    path = save_checkpoint(tmp_path, 1, m, opts, extra={})
    want = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(1)
    np.random.seed(2)
    load_checkpoint(path, m, opts)
    got = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_crash_mid_write_leaves_no_loadable_checkpoint(tmp_path, monkeypatch):
    m, opts = _model_and_optims(0)
    save_checkpoint(tmp_path, 1, m, opts, extra={})

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, 2, m, opts, extra={})
    monkeypatch.undo()
    # The half-written step 2 is a .tmp directory: not listed, the last good checkpoint stays the latest.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert (tmp_path / ".tmp-step_00000002").exists()
    # The next save of that step cleans it up.
    save_checkpoint(tmp_path, 2, m, opts, extra={})
    assert not (tmp_path / ".tmp-step_00000002").exists()
    assert latest_checkpoint(tmp_path).name == "step_00000002"


def test_keep_last_k(tmp_path):
    m, opts = _model_and_optims(0)
    for s in range(1, 6):
        save_checkpoint(tmp_path, s, m, opts, extra={}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]


def test_errors(tmp_path):
    m, opts = _model_and_optims(0)
    with pytest.raises(CheckpointError, match="not a complete gem-train checkpoint"):
        load_checkpoint(tmp_path, m, opts)
    path = save_checkpoint(tmp_path, 1, m, opts, extra={})
    other = torch.nn.Linear(3, 3)
    with pytest.raises(CheckpointError, match="cannot load"):
        load_checkpoint(path, other, [torch.optim.SGD(other.parameters(), lr=0.1)])
    # Only tensors are in the DCP files; the JSON holds the rest.
    assert json.loads((path / "trainer_state.json").read_text())["step"] == 1


def test_best_checkpoint_link_is_replaced_atomically_and_never_pruned(tmp_path):
    m, opts = _model_and_optims(0)
    assert best_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, m, opts, extra={}, keep_last=1)
    link = save_best_checkpoint(tmp_path, 1, m, opts, extra={"selection": {"value": 0.9}})
    assert link == tmp_path / "best" and link.is_symlink() and best_checkpoint(tmp_path) == link
    _train_step(m, opts)
    w2 = [p.detach().clone() for p in m.parameters()]
    save_best_checkpoint(tmp_path, 2, m, opts, extra={"selection": {"value": 0.8}})
    for step in (2, 3, 4):
        save_checkpoint(tmp_path, step, m, opts, extra={}, keep_last=1)
    # keep_last prunes step_<N> only; the best is not one of them, and the older best directory is gone.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "best_step_00000002", "step_00000004"]
    assert latest_checkpoint(tmp_path).name == "step_00000004"
    state = read_trainer_state(best_checkpoint(tmp_path))
    assert state["step"] == 2 and state["selection"] == {"value": 0.8}
    m2, _ = _model_and_optims(1)
    load_checkpoint(tmp_path / "best", m2, None, restore_rng=False)
    assert all(torch.equal(a, b) for a, b in zip(w2, m2.parameters()))
    # A crash while writing the next best leaves its .tmp directory (and maybe a stray link): the old best
    # still loads.
    (tmp_path / ".tmp-best_step_00000005").mkdir()
    (tmp_path / ".tmp-best").symlink_to(".tmp-best_step_00000005")
    assert read_trainer_state(best_checkpoint(tmp_path))["step"] == 2
    save_best_checkpoint(tmp_path, 5, m, opts, extra={})
    assert read_trainer_state(best_checkpoint(tmp_path))["step"] == 5
    assert not (tmp_path / ".tmp-best").exists() and not (tmp_path / ".tmp-best_step_00000005").exists()
