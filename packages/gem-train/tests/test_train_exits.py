"""Every error exits (issue 34): a bad row, a missing file or any exception in a DataLoader worker ends the
run promptly with the same one-line error as without workers, exit status 1, no traceback, no worker left
behind and no empty run directory; abandoned readers shut their workers down; a multi-rank program ends
without interpreter finalization. The two-rank versions: ``test_train_quiet_exits.py``.

Each test that could hang has a timeout that fails it: the hang this fixes was a process waiting forever for
its loader workers at exit.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_train_parquet import _toml_section, section, source, write_table

from gem_train.cli import main
from gem_train.data.loader import BatchStream, make_eval_loader, make_train_loader
from gem_train.data.parquet.errors import ParquetDataError
from gem_train.data.workers import LoaderWorkerError
from gem_train.loop.run_dir import RunDir, discard_if_unused

BAD_ROW = 3  # in the first batch of every layout below: the run fails at its start (before its run directory)
LATE_BAD_ROW = 200  # after the 8 batches of 16 measured before training: the run fails in its 13th step
RUN_ARGS = [
    "data.batch_size=16", "data.eval_batch_size=32", "model.overrides.n_layers=1",
    'model.overrides.attention="full"', "train.steps=20", "train.log_every=100", "train.progress_bar=false",
]  # fmt: skip


def bad_table(root: Path, bad_row: int = BAD_ROW) -> tuple[Path, str]:
    """A 300-row training file (row groups of 25) whose row ``bad_row`` has a negative user id; its config;
    the one-line error."""
    n = 300
    user = pa.array([-1 if i == bad_row else 1 for i in range(n)], pa.int64())
    write_table(root / "train" / "a.parquet", n, row_group=25, user=user)
    write_table(root / "test" / "t.parquet", 40)
    cfg = root / "run.toml"
    cfg.write_text('[data]\nsource = "parquet"\n' + _toml_section(section(root, shuffle="none")))
    error = (
        f"gem-train: error: file {root / 'train' / 'a.parquet'}, row group {bad_row // 25}, "
        f"row {bad_row % 25}: sparse feature 'user': id -1 out of range [0, 50)"
    )
    return cfg, error


def processes_mentioning(marker: str) -> list[int]:
    """Live processes (other than this one) whose command line contains ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(pid))
    return found


# ----------------------------------------------------------------------------------------------------------
# A bad row, with and without loader workers
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_row_ends_the_run_with_the_same_one_line_error_with_or_without_workers(
    tmp_path, capsys, workers
):
    cfg, error = bad_table(tmp_path / "data", LATE_BAD_ROW)
    runs = tmp_path / "runs"
    args = [*RUN_ARGS, f"data.num_workers={workers}", f"run.out_dir={runs}", "train.valid_every=0"]
    code = main(["train", "--config", str(cfg), *args])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.startswith("gem-train: error")] == [error], err[-3000:]
    assert "Traceback" not in err
    assert multiprocessing.active_children() == []  # the loader's workers were shut down
    # The run failed before writing anything (it validates only at its end): its directory is gone again, and
    # said so.
    assert list(runs.iterdir()) == [] and "removed the run directory" in err


@pytest.mark.timeout(300)
def test_the_program_exits_promptly_after_a_bad_row_in_a_loader_worker(tmp_path):
    """The user's case: ``gem-train train`` with 2 loader workers printed a DataLoader traceback and then
    waited for its workers forever. Now: exit status 1, the one line, and no process left."""
    cfg, error = bad_table(tmp_path / "data")
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "gem_train.cli", "train", "--config", str(cfg), *RUN_ARGS,
           "data.num_workers=2", f"run.out_dir={runs}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.rstrip().splitlines()[-1] == error, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert processes_mentioning(str(runs)) == []  # the workers (forks of the program) are gone too
    # The row is read among the first training batches, measured before the run directory is made.
    assert not runs.exists() or list(runs.iterdir()) == []


# ----------------------------------------------------------------------------------------------------------
# Any exception in a worker, missing files, abandoned readers
# ----------------------------------------------------------------------------------------------------------


class Broken:
    """A batch source (``BatchSource``) whose batch ``bad`` raises ``exc``."""

    def __init__(self, exc: BaseException, bad: int = 5) -> None:
        from gem_train.config import SyntheticConfig
        from gem_train.data.synthetic import SyntheticAds

        self.inner = SyntheticAds(SyntheticConfig(num_users=50, num_items=40, max_len=6), 0)
        self.spec, self.exc, self.bad = self.inner.spec, exc, bad

    def get(self, split, index, batch_size):
        if index == self.bad:
            raise self.exc
        return self.inner.get(split, index, batch_size)

    def num_batches(self, split, batch_size):
        return self.inner.num_batches(split, batch_size)


class Unpicklable(Exception):
    def __init__(self, what: str, handle: object) -> None:
        super().__init__(what)
        self.handle = handle


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "exc, expected",
    [
        (KeyError("no such user"), KeyError),
        (FileNotFoundError(2, "No such file or directory", "/data/gone.parquet"), FileNotFoundError),
        (Unpicklable("cannot travel", lambda: None), LoaderWorkerError),
    ],
    ids=["KeyError", "FileNotFoundError", "unpicklable"],
)
def test_any_worker_exception_is_the_original_error_at_its_batch_and_the_workers_stop(exc, expected):
    batches = {}
    for workers in (0, 2):
        it = iter(make_train_loader(Broken(exc), 8, num_workers=workers))
        got = []
        with pytest.raises(expected if workers else type(exc)) as raised:
            for lb in it:
                got.append(lb.index)
        assert multiprocessing.active_children() == []
        batches[workers] = got
        if workers == 0 or expected is not LoaderWorkerError:
            assert str(raised.value) == str(exc)
            if isinstance(exc, FileNotFoundError):
                assert raised.value.filename == "/data/gone.parquet"
        else:  # sent by name: the type and the message
            assert str(raised.value) == f"{__name__}.Unpicklable: cannot travel"
        if workers:
            assert "raised in a DataLoader worker process" in "".join(raised.value.__notes__)
    assert batches[0] == batches[2] == [0, 1, 2, 3, 4]  # raised where it would have been, in order


@pytest.mark.timeout(120)
def test_a_file_gone_after_the_start_is_the_same_error_with_workers(tmp_path):
    write_table(tmp_path / "train" / "a.parquet", 100, row_group=25)
    write_table(tmp_path / "test" / "t.parquet", 40)
    errors = []
    for workers in (0, 2):
        src = source(tmp_path, shuffle="none")
        (tmp_path / "test" / "t.parquet").rename(tmp_path / "moved.parquet")
        try:
            with pytest.raises((ParquetDataError, FileNotFoundError)) as raised:
                list(make_eval_loader(src, 16, num_workers=workers))
        finally:
            (tmp_path / "moved.parquet").rename(tmp_path / "test" / "t.parquet")
        errors.append((type(raised.value), str(raised.value)))
        assert multiprocessing.active_children() == []
    assert errors[0] == errors[1] and "t.parquet" in errors[0][1]


@pytest.mark.timeout(120)
def test_closing_or_leaving_a_loader_shuts_its_workers_down(table_dir):
    loader = make_train_loader(source(table_dir), 16, num_workers=2)
    it = iter(loader)
    next(it)
    assert len(multiprocessing.active_children()) == 2
    it.close()
    assert multiprocessing.active_children() == []
    with pytest.raises(StopIteration):
        next(it)
    with make_eval_loader(source(table_dir), 16, num_workers=2) as held_out:
        it = iter(held_out)
        next(it)
        assert len(multiprocessing.active_children()) == 2
    assert multiprocessing.active_children() == []
    it = iter(make_train_loader(source(table_dir), 16, num_workers=2))
    next(it)
    del it  # dropped
    assert multiprocessing.active_children() == []


@pytest.fixture
def table_dir(tmp_path):
    write_table(tmp_path / "train" / "a.parquet", 230, seed=1)
    write_table(tmp_path / "test" / "t.parquet", 61, seed=3, first_id=10_000)
    return tmp_path


@pytest.mark.timeout(180)
def test_a_script_that_abandons_a_reader_still_exits(table_dir):
    """Reading a split through the public API and stopping early: the process still ends (its workers used
    to keep it from exiting), at once and with status 0."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_train_parquet import source
from gem_train.data.loader import make_eval_loader, make_train_loader

train = iter(make_train_loader(source({str(table_dir)!r}), 16, num_workers=2))
test = iter(make_eval_loader(source({str(table_dir)!r}), 16, num_workers=2))
print(next(train).batch.batch_size, next(test).batch.batch_size, flush=True)
"""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["16", "16"]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    print(f"abandoned-reader script: {time.monotonic() - start:.1f} s")


def test_a_failed_start_removes_only_an_unused_new_run_directory(tmp_path):
    run = RunDir(tmp_path / "r").make()
    run.config.write_text("[run]\n")
    (run.tensorboard / "events.out.tfevents.1").write_bytes(b"header only")
    assert discard_if_unused(run) and not run.root.exists()
    # The start's health notes alone (also said on stderr) do not make a run used.
    run = RunDir(tmp_path / "health").make()
    run.metrics.write_text('{"step": 0, "split": "health", "check": "small_table", "message": "..."}\n')
    assert discard_if_unused(run) and not run.root.exists()
    for written in ("metrics", "checkpoint", "eval"):
        run = RunDir(tmp_path / written).make()
        if written == "metrics":
            run.metrics.write_text('{"step": 1}\n')
        elif written == "checkpoint":
            (run.checkpoints / ".tmp-step_00000002").mkdir()  # even a partial one is kept
        else:
            run.eval_summary.write_text("{}")
        assert not discard_if_unused(run) and run.root.exists()


@pytest.mark.timeout(300)
def test_a_resumed_run_that_fails_keeps_its_directory(tmp_path, capsys, small_overrides):
    runs = tmp_path / "runs"
    assert main(["train", *small_overrides, "train.steps=2", f"run.out_dir={runs}"]) == 0
    (run,) = runs.iterdir()
    ckpt = next((run / "checkpoints").glob("step_*"))
    capsys.readouterr()

    def boom(self, split, index, batch_size):
        raise FileNotFoundError(2, "No such file or directory", "/data/gone")

    from gem_train.data.synthetic import SyntheticAds

    original = SyntheticAds.get
    SyntheticAds.get = boom  # type: ignore[method-assign]
    try:
        code = main(["train", "--resume", str(ckpt), "train.steps=4"])
    finally:
        SyntheticAds.get = original  # type: ignore[method-assign]
    err = capsys.readouterr().err
    assert code == 1 and "gem-train: error: [Errno 2] No such file or directory: '/data/gone'" in err
    assert run.exists() and ckpt.exists() and "removed the run directory" not in err


# ----------------------------------------------------------------------------------------------------------
# The command line: fast help, launch --help, files only where asked, the multi-rank exit
# ----------------------------------------------------------------------------------------------------------


def test_help_of_every_command_loads_neither_torch_nor_the_config_schema():
    """Building the parser and printing every command's help imports no torch (a check of sys.modules, not
    a clock: the time is in BENCHMARKS.md)."""
    script = """
import contextlib, io, sys
from gem_train.cli.main import main
commands = [[], ["train"], ["eval"], ["bench"], ["baseline"], ["config"], ["data"], ["launch"],
            ["data", "movielens-100k"], ["data", "synthetic"], ["data", "inspect"], ["data", "export"],
            ["predict"]]
for argv in commands:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    assert "usage: gem-train" in out.getvalue(), argv
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "gem_parallel", "numpy", "torchrec")
               or m.startswith("gem_train.config."))
print("HEAVY", heavy)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HEAVY []" in done.stdout, done.stdout[-2000:]


def test_launch_help_prints_help_and_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        main(["launch", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gem-train launch") and "torchrun --help" in out
    with pytest.raises(SystemExit) as e:
        main(["launch", "--standalone", "-h", "train"])  # help before the command: launch's
    assert e.value.code == 0 and "usage: gem-train launch" in capsys.readouterr().out
    assert main(["launch"]) == 2  # no command: a usage error, as before
    assert "usage: gem-train launch" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_data_inspect_writes_a_png_only_when_asked(table_dir, tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "inspect.toml"
    cfg.write_text('[data]\nsource = "parquet"\n' + _toml_section(section(table_dir)))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["data", "inspect", "--config", str(cfg)]) == 0
    assert list(cwd.iterdir()) == [] and "histogram" not in capsys.readouterr().out
    assert main(["data", "inspect", "--config", str(cfg), "--png", "h.png"]) == 0
    assert [p.name for p in cwd.iterdir()] == ["h.png"]


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_the_program_skips_interpreter_finalization_only_in_a_multi_rank_run(world_size):
    """``console_main`` ends a worker of a multi-rank run (WORLD_SIZE > 1) with ``os._exit`` after flushing,
    so nothing runs at interpreter exit (where torch's gloo race aborts finished runs: an atexit hook here
    stands for it); a single process ends as usual. Output is flushed first and the status is kept."""
    script = """
import atexit, sys
atexit.register(lambda: print("FINALIZED", flush=True))
sys.argv = ["gem-train", "launch", "--help"]
print("before", end="")  # unflushed
from gem_train.cli import console_main
console_main()
"""
    env = {**os.environ, "WORLD_SIZE": world_size}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("beforeusage: gem-train launch")
    assert ("FINALIZED" in done.stdout) == (world_size == "1")
    script = script.replace('"launch", "--help"', '"train", "--resume"')  # a usage error: status 2
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "expected one argument" in done.stderr
    assert ("FINALIZED" in done.stdout) == (world_size == "1")


def test_batch_stream_alone_is_unchanged_in_the_main_process():
    """Without workers the stream is not wrapped: its exceptions propagate as they are."""
    stream = BatchStream(Broken(ValueError("x"), bad=0), "train", 4)
    with pytest.raises(ValueError, match=r"^x$"):
        next(iter(stream))
