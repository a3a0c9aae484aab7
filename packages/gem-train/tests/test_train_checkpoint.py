"""Checkpoints: round trip of model/optimizer/RNG, atomicity under a crash mid-write, keep-last-K; no code
runs on load (a crafted .metadata), a damaged checkpoint is refused naming the file, a complete checkpoint
exists at every moment of a save."""

import json
import pickle
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

import gem_train.checkpoint as ckpt_mod
from gem_parallel.testing import run_distributed
from gem_train.checkpoint import (
    CheckpointError,
    best_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_trainer_state,
    save_best_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from gem_train.checkpoint import atomic as ckpt_atomic
from gem_train.checkpoint import save as ckpt_save
from gem_train.checkpoint.manifest import write_manifest
from gem_train.checkpoint.storage import allowed_metadata_globals, safe_load_metadata
from gem_train.cli import main
from gem_train.loop.trainer import Trainer


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


# ----------------------------------------------------------------------------------------------------------
# Loading never runs code
# ----------------------------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this runs ``exec``: it writes a marker file (what a crafted checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def _short_str(b):
    """The SHORT_BINUNICODE opcode pushing the string ``b``."""
    return b"\x8c" + bytes([len(b)]) + b


def _plant(ckpt, payload):
    """Hide ``payload`` inside the real ``.metadata`` of ``ckpt`` and re-seal the manifest, as an attacker
    who can write the directory would: the integrity check passes, only the unpickler stands in the way."""
    meta = safe_load_metadata(ckpt / ".metadata")
    meta.planner_data = payload
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(ckpt, {})


def test_malicious_metadata_is_refused_and_runs_nothing(tmp_path):
    m, opts = _model_and_optims(0)
    path = save_checkpoint(tmp_path, 1, m, opts, extra={})
    marker = tmp_path / "marker"
    # The payload is real: plain pickle (what DCP's FileSystemReader uses) runs it.
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()
    marker.unlink()
    _plant(path, _Payload(marker))
    with pytest.raises(
        CheckpointError, match=r"\.metadata: refused to load: it names the global builtins\.exec"
    ):
        load_checkpoint(path, m, opts)
    with pytest.raises(CheckpointError, match=r"builtins\.exec"):
        verify_checkpoint(path)
    assert not marker.exists()
    # A dotted name that walks attributes from an allowed class is refused too (exact names only).
    (path / ".metadata").write_bytes(
        b"\x80\x04" + _short_str(b"torch.distributed.checkpoint.metadata")
        + _short_str(b"Metadata.__init__.__globals__") + b"\x93."
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"Metadata\.__init__\.__globals__"):
        safe_load_metadata(path / ".metadata")
    # BUILD on an allowed *class* would rewrite DCP's classes: refused, and Metadata keeps its attributes.
    # Opcodes: STACK_GLOBAL Metadata, state (None, {"planted": True}), BUILD.
    (path / ".metadata").write_bytes(
        b"\x80\x04" + _short_str(b"torch.distributed.checkpoint.metadata") + _short_str(b"Metadata") + b"\x93"
        + b"N}" + _short_str(b"planted") + b"\x88s\x86b."
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="refused to load: it sets the state of the class Metadata"):
        safe_load_metadata(path / ".metadata")
    assert not hasattr(Metadata, "planted")
    # Extension codes (looked up in copyreg's process-wide cache, past find_class) are refused.
    (path / ".metadata").write_bytes(b"\x80\x04\x82\x01.")
    with pytest.raises(CheckpointError, match=r"extension code \(EXT opcode\)"):
        safe_load_metadata(path / ".metadata")


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    """A crafted .metadata (allowed classes only, manifest re-sealed) whose entry names ../secret must not
    make the loader read a file outside the checkpoint directory."""
    m, opts = _model_and_optims(0)
    path = save_checkpoint(tmp_path / "ck", 1, m, opts, extra={})
    meta = safe_load_metadata(path / ".metadata")
    for info in meta.storage_data.values():
        info.relative_path = "../secret.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(path, {})
    with pytest.raises(CheckpointError, match=r"refused to load: entry .* points at '\.\./secret\.distcp'"):
        load_checkpoint(path, m, opts)


def test_every_load_path_refuses_malicious_metadata(tmp_path, capsys, small_config):
    """`gem-train eval`, `train --resume` and the best-checkpoint link all read through the safe reader."""
    res = Trainer(small_config(tmp_path, "train.steps=2", "data.synthetic.valid_examples=64",
                               "train.valid_every=2")).fit()  # fmt: skip
    marker = tmp_path / "marker"
    best = res.best_checkpoint.resolve()
    _plant(res.last_checkpoint, _Payload(marker))
    _plant(best, _Payload(marker))
    assert main(["eval", "--checkpoint", str(res.last_checkpoint)]) == 1
    assert "refused to load" in capsys.readouterr().err
    assert main(["train", "--resume", str(res.last_checkpoint), "train.steps=3"]) == 1
    assert "refused to load" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(res.run_dir / "checkpoints" / "best")]) == 1
    assert "builtins.exec" in capsys.readouterr().err
    tr = Trainer(small_config(tmp_path, "train.steps=2", "data.synthetic.valid_examples=64"))
    tr.run_dir = type(tr.run_dir)(res.run_dir)
    with pytest.raises(CheckpointError, match="refused to load"):
        tr.evaluate_best()
    assert not marker.exists()


def _sharded_save_load(rank, world_size, root):
    """FSDP2-sharded (DTensor) parameters and optimizer state, plus a ShardedTensor (what TorchRec's sharded
    tables hold), saved by gem's checkpoint with the background seal (each rank hashes its own file) and
    loaded back through the safe reader."""
    from torch.distributed._shard.sharded_tensor import rand as sharded_rand
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])

    class Model(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
            self.table = sharded_rand(spec, 7, 4)  # rows 0-3 on rank 0, 4-6 on rank 1

        # The ShardedTensor goes through the state dict as TorchRec's sharded modules put it there.
        def state_dict(self, *args, **kwargs):
            sd = super().state_dict(*args, **kwargs)
            sd["table"] = self.table
            return sd

        def load_state_dict(self, state_dict, *args, **kwargs):
            state_dict = dict(state_dict)
            self.table.local_tensor().copy_(state_dict.pop("table").local_tensor())
            return super().load_state_dict(state_dict, *args, **kwargs)

    def build(seed):
        m = Model(seed)
        fully_shard(m.net[0], mesh=mesh)
        fully_shard(m.net, mesh=mesh)
        return m, [torch.optim.AdamW(m.net.parameters(), lr=1e-2)]

    m, opts = build(0)
    m.net(torch.randn(4, 6)).sum().backward()
    opts[0].step()
    save_checkpoint(root, 1, m, opts, extra={"config": {}}, background=True)
    ckpt_mod.wait_for_checkpoints()
    path = Path(root) / "step_00000001"
    globals_seen = sorted(f"{a}.{b}" for a, b in _recorded_globals(path / ".metadata"))
    m2, opts2 = build(1)
    load_checkpoint(path, m2, opts2)
    params = zip(m.net.parameters(), m2.net.parameters())
    exp_avg = [opts2[0].state[p]["exp_avg"].full_tensor() for p in m2.net.parameters()]
    want = [opts[0].state[p]["exp_avg"].full_tensor() for p in m.net.parameters()]
    table = torch.equal(m.table.local_tensor(), m2.table.local_tensor())
    return {
        "same": all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in params),
        "optim_same": all(torch.equal(a, b) for a, b in zip(exp_avg, want)),
        "table_same": table and not torch.equal(m.table.local_tensor(), Model(1).table.local_tensor()),
        "globals": globals_seen,
        "files": sorted(p.name for p in path.iterdir()),
    }


def _recorded_globals(path):
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Recorder(f).load()
    return seen


@pytest.mark.distributed
def test_sharded_dtensor_and_sharded_tensor_checkpoint_seals_and_loads_through_the_safe_reader(tmp_path):
    out = run_distributed(__file__, "_sharded_save_load", 2, kwargs={"root": str(tmp_path)}, timeout_s=120)
    assert all(o["same"] and o["optim_same"] and o["table_same"] for o in out)
    # Both ranks' files are in the manifest (rank 1's digests reached rank 0), nothing else is left over.
    assert out[0]["files"] == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
        "trainer_state.json",
    ]
    # Every global DCP wrote is on the allowlist (the load above would have failed otherwise).
    allowed = {f"{a}.{b}" for a, b in allowed_metadata_globals()}
    assert set(out[0]["globals"]) <= allowed and "torch.Size" in out[0]["globals"]


# ----------------------------------------------------------------------------------------------------------
# Integrity: a damaged checkpoint names the file, before anything is loaded
# ----------------------------------------------------------------------------------------------------------


def _flip_byte(p):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _shard(ckpt):
    return next(ckpt.glob("*.distcp"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda c: _flip_byte(_shard(c)),
            r"__0_0\.distcp: sha256 .* differs from manifest\.json \(corrupt\)",
        ),
        (
            lambda c: _shard(c).write_bytes(_shard(c).read_bytes()[:-100]),
            r"__0_0\.distcp: \d+ bytes, manifest",
        ),
        (lambda c: _shard(c).unlink(), r"__0_0\.distcp: missing"),
        (lambda c: (c / "stray.bin").write_bytes(b"x"), r"stray\.bin: not listed in manifest\.json"),
        (lambda c: (c / "trainer_state.json").write_text("{not json"), r"trainer_state\.json: "),
        (lambda c: (c / "manifest.json").write_text("garbage"), r"manifest\.json: corrupt manifest"),
        (lambda c: (c / "manifest.json").unlink(), r"no manifest\.json"),
    ],
    ids=["flipped-byte", "truncated", "missing", "extra", "garbage-state", "garbage-manifest", "no-manifest"],
)
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage, message):
    m, opts = _model_and_optims(0)
    path = save_checkpoint(tmp_path, 1, m, opts, extra={"config": {}})
    load_checkpoint(path, m, opts)  # intact: loads
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, m, opts)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("{}", "no 'step'"),
        ("[1, 2]", "a JSON list"),
        ('{"step": -1}', "no 'world"),
    ],
)
def test_bad_trainer_state_is_a_clear_error_even_with_a_matching_manifest(tmp_path, capsys, text, message):
    m, opts = _model_and_optims(0)
    path = save_checkpoint(tmp_path, 1, m, opts, extra={"config": {}})
    (path / "trainer_state.json").write_text(text)
    write_manifest(path, {})  # re-sealed: only the trainer state's own checks can catch it
    with pytest.raises(CheckpointError, match=rf"trainer_state\.json: corrupt trainer state \({message}"):
        read_trainer_state(path)
    assert main(["eval", "--checkpoint", str(path)]) == 1
    err = capsys.readouterr().err
    assert "gem-train: error:" in err and "trainer_state.json" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------------------
# There is always a complete checkpoint
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_complete_checkpoint_exists_at_every_moment_of_every_save(tmp_path, monkeypatch, keep_last):
    """Check, before every rename and delete a save makes, that the newest listed checkpoint verifies: a
    crash at any of those moments leaves a complete checkpoint. Steps 1, 2, 2 (the same step saved twice, as
    on SIGTERM right after a periodic save), 3."""
    m, opts = _model_and_optims(0)
    save_checkpoint(tmp_path, 1, m, opts, extra={}, keep_last=keep_last)
    moments = []
    real_rename, real_rmtree = ckpt_atomic.rename_durably, shutil.rmtree

    def check(what):
        latest = latest_checkpoint(tmp_path)
        assert latest is not None, f"no complete checkpoint before {what}"
        verify_checkpoint(latest)
        moments.append((what, latest.name))

    monkeypatch.setattr(
        ckpt_atomic, "rename_durably", lambda a, b: (check(f"rename {a.name} -> {b.name}"), real_rename(a, b))
    )
    monkeypatch.setattr(
        shutil, "rmtree", lambda p, **k: (check(f"rmtree {Path(p).name}"), real_rmtree(p, **k))
    )
    for step in (2, 2, 3):
        _train_step(m, opts)
        save_checkpoint(tmp_path, step, m, opts, extra={}, keep_last=keep_last)
        check("end of save")
    assert any(name.startswith(".replaced-") for _, name in moments)  # the re-save window was exercised
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_{s:08d}" for s in range(4 - keep_last, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in list_checkpoints(tmp_path)]


def test_crash_between_the_renames_of_a_resave_leaves_the_old_copy_loadable(tmp_path, monkeypatch):
    m, opts = _model_and_optims(0)
    save_checkpoint(tmp_path, 5, m, opts, extra={"config": {"v": "old"}}, keep_last=1)
    want = [p.detach().clone() for p in m.parameters()]
    real_rename = ckpt_atomic.rename_durably

    def crash_on_install(a, b):
        if a.name.startswith(".tmp-"):
            raise OSError("killed (simulated) between moving the old copy aside and the new one in")
        real_rename(a, b)

    monkeypatch.setattr(ckpt_atomic, "rename_durably", crash_on_install)
    with pytest.raises(CheckpointError, match=r"sealing checkpoint .*step_00000005 failed: OSError: killed"):
        save_checkpoint(tmp_path, 5, m, opts, extra={"config": {"v": "new"}}, keep_last=1)
    monkeypatch.undo()
    assert not (tmp_path / "step_00000005").exists()
    found = latest_checkpoint(tmp_path)
    assert found.name == ".replaced-step_00000005" and read_trainer_state(found)["config"] == {"v": "old"}
    m2, opts2 = _model_and_optims(1)
    assert load_checkpoint(found, m2, opts2)["step"] == 5
    assert all(torch.equal(a, b) for a, b in zip(want, m2.parameters()))
    # The next save of that step completes the replacement and removes the old copy and the leftovers.
    save_checkpoint(tmp_path, 5, m, opts, extra={"config": {"v": "new"}}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]
    assert read_trainer_state(latest_checkpoint(tmp_path))["config"] == {"v": "new"}


def test_a_background_seal_keeps_hashing_off_the_step_and_the_old_checkpoint_until_it_is_done(
    tmp_path, monkeypatch
):
    """With background=True the save returns once the files are written; hashing, manifest and rename run
    in a thread (held here until released). Meanwhile a training step runs, the new checkpoint is not
    listed and the old one is the latest; after wait_for_checkpoints() the new one is in place and verifies,
    and keep_last pruned the old one. A failed seal is raised by the next wait."""
    m, opts = _model_and_optims(0)
    save_checkpoint(tmp_path, 1, m, opts, extra={}, keep_last=1)
    release, hashing = threading.Event(), threading.Event()
    real_hash = ckpt_save.hash_files

    def held_hash(directory, names):
        hashing.set()
        assert release.wait(60)
        return real_hash(directory, names)

    monkeypatch.setattr(ckpt_save, "hash_files", held_hash)
    _train_step(m, opts)
    want = [p.detach().clone() for p in m.parameters()]
    save_checkpoint(tmp_path, 2, m, opts, extra={}, keep_last=1, background=True)
    assert hashing.wait(60) and ckpt_mod.checkpoint_pending()
    _train_step(m, opts)  # training goes on while the seal waits
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert (tmp_path / ".tmp-step_00000002").is_dir()
    release.set()
    ckpt_mod.wait_for_checkpoints()
    assert not ckpt_mod.checkpoint_pending()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]
    verify_checkpoint(tmp_path / "step_00000002")
    m2, opts2 = _model_and_optims(1)
    load_checkpoint(tmp_path / "step_00000002", m2, opts2)
    assert all(torch.equal(a, b) for a, b in zip(want, m2.parameters()))  # the state at save time

    def failing_hash(directory, names):
        raise OSError("read error (simulated)")

    monkeypatch.setattr(ckpt_save, "hash_files", failing_hash)
    save_checkpoint(tmp_path, 3, m, opts, extra={}, keep_last=1, background=True)
    with pytest.raises(
        CheckpointError, match=r"sealing checkpoint \S*step_00000003 failed: OSError: read error"
    ):
        ckpt_mod.wait_for_checkpoints()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]
    ckpt_mod.wait_for_checkpoints()  # the failure is reported once
