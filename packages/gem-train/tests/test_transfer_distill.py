"""Distillation into a student (issue 36): the loss against a hand-written reference, the auxiliary heads
and adapters beside an unchanged serving path, the student evaluated without its teacher, the live teacher
equal to the stored one, and bad teacher inputs as one-line errors."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem_model import GemBatch
from gem_train.cli import main
from gem_train.config import ConfigError, DistillConfig
from gem_train.transfer.batch import DistillBatch, with_teacher
from gem_train.transfer.losses import distill_loss
from gem_train.transfer.predict import run_predict
from gem_train.transfer.student import Adapter, attach_student

sys.path.insert(0, str(Path(__file__).parent))
from transfer_fixtures import small_config, train_checkpoint

# ----------------------------------------------------------------------------------------------------------
# The loss against a hand-written reference (float64, explicit loops), forward and backward
# ----------------------------------------------------------------------------------------------------------


def _bce(x: float, p: float) -> float:
    """BCE of logit ``x`` against target probability ``p``, written out."""
    return -(p * math.log(1 / (1 + math.exp(-x))) + (1 - p) * math.log(1 - 1 / (1 + math.exp(-x))))


def _reference(logits, labels, mask, teacher, cfg, tasks):
    """The docstring formula of gem_train.transfer.losses, one scalar at a time."""
    sig = lambda x: 1 / (1 + math.exp(-x))
    b = labels.shape[0]
    serving = []
    for j, t in enumerate(tasks):
        rows = [i for i in range(b) if mask[i, j]]
        if rows:
            serving.append(sum(_bce(logits[t][i], labels[i, j]) for i in rows) / len(rows))
    total = sum(serving) / len(serving)
    distilled = cfg.tasks or tasks
    soft, adapt, n_adapt = [], 0.0, 0
    for t in distilled:
        j = tasks.index(t)
        if cfg.adapter != "none":
            rows = [i for i in range(b) if mask[i, j]]
            if rows:
                adapt += sum(_bce(logits[f"adapter:{t}"][i], labels[i, j]) for i in rows) / len(rows)
                n_adapt += 1
            target = [sig(logits[f"adapter:{t}"][i]) for i in range(b)]
        else:
            target = [sig(teacher[i, j]) for i in range(b)]
        head = logits[f"aux:{t}"] if cfg.mode == "aux" else logits[t]
        if cfg.mode != "none":
            soft.append(sum(_bce(head[i], target[i]) for i in range(b)) / b)
    if soft:
        total += cfg.weight * sum(soft) / len(soft)
    if n_adapt:
        total += adapt / n_adapt
    return total


@pytest.mark.parametrize(
    "cfg",
    [
        DistillConfig(mode="serving", weight=0.7),
        DistillConfig(mode="aux", weight=1.3),
        DistillConfig(mode="aux", adapter="linear"),
        DistillConfig(mode="serving", adapter="mlp", tasks=["cvr"], weight=0.5),
        DistillConfig(mode="aux", adapter="mlp", tasks=["ctr"]),
    ],
    ids=["serving", "aux", "aux+adapter", "serving+adapter cvr only", "aux+adapter ctr only"],
)
def test_distill_loss_equals_the_reference_and_its_gradients(cfg):
    tasks = ("ctr", "cvr")
    g = torch.Generator().manual_seed(0)
    b = 7
    labels = torch.randint(0, 2, (b, 2), generator=g).float()
    mask = torch.ones(b, 2, dtype=torch.bool)
    mask[:, 1] = torch.tensor([1, 0, 0, 1, 0, 1, 0], dtype=torch.bool)  # conversions only after clicks
    teacher = torch.randn(b, 2, generator=g) * 2
    names = [*tasks, *(f"aux:{t}" for t in tasks), *(f"adapter:{t}" for t in tasks)]
    logits = {k: (torch.randn(b, generator=g) * 2).requires_grad_() for k in names}
    batch = DistillBatch(
        dense=torch.zeros(b, 1), sparse=None, sequences={}, request_time=torch.zeros(b, dtype=torch.int64),
        labels=labels, label_mask=mask, teacher_logits=teacher,
    )  # type: ignore[arg-type]  # fmt: skip
    loss, per_task = distill_loss(logits, batch, cfg, tasks)
    as_lists = {k: v.detach().double().tolist() for k, v in logits.items()}
    ref = _reference(as_lists, labels.numpy(), mask.numpy(), teacher.double().numpy(), cfg, tasks)
    # fp32 loss of O(1) terms: a few ulps of the sums.
    assert loss.item() == pytest.approx(ref, rel=1e-6)
    assert set(per_task) == set(tasks)  # the logged losses are the serving heads' true-label BCE

    # Backward against autograd of the float64 reference written with torch ops (the same formula).
    loss.backward()
    ref_logits = {k: v.detach().double().requires_grad_() for k, v in logits.items()}
    ref_cfg = cfg

    def bce(x, p):
        return torch.nn.functional.binary_cross_entropy_with_logits(x, p, reduction="none")

    y, m = labels.double(), mask.double()
    total = torch.stack([(bce(ref_logits[t], y[:, j]) * m[:, j]).sum() / m[:, j].sum()
                         for j, t in enumerate(tasks)]).mean()  # fmt: skip
    soft, adapt = [], []
    for t in ref_cfg.tasks or tasks:
        j = tasks.index(t)
        if ref_cfg.adapter != "none":
            c = ref_logits[f"adapter:{t}"]
            adapt.append((bce(c, y[:, j]) * m[:, j]).sum() / m[:, j].sum())
            target = torch.sigmoid(c).detach()  # the adapter's output is a label: no gradient through it
        else:
            target = torch.sigmoid(teacher[:, j].double())
        head = ref_logits[f"aux:{t}"] if ref_cfg.mode == "aux" else ref_logits[t]
        soft.append(bce(head, target).mean())
    total = total + ref_cfg.weight * torch.stack(soft).mean() + (torch.stack(adapt).mean() if adapt else 0)
    total.backward()
    for k in names:
        got = logits[k].grad if logits[k].grad is not None else torch.zeros(b)
        want = ref_logits[k].grad if ref_logits[k].grad is not None else torch.zeros(b, dtype=torch.float64)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7, msg=k)
    unused = [k for k in names if logits[k].grad is None]
    if cfg.mode == "serving":
        assert all(k.startswith("aux:") for k in unused if not k.startswith("adapter:"))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("age", [False, True])
def test_adapters_start_as_the_identity(kind, age):
    a = Adapter(kind, age, hidden=8)
    t = torch.randn(9) * 3
    out = a(t, torch.rand(9) * 50 if age else None)
    torch.testing.assert_close(out, t)


# ----------------------------------------------------------------------------------------------------------
# The student's modules beside an unchanged serving path
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gem", "mlp"])
def test_student_heads_leave_the_serving_path_and_its_names_unchanged(tmp_path, arch):
    from gem_train.loop.build import build_model_for, build_source
    from gem_train.loop.distributed import DistInfo
    from gem_train.transfer.representation import RepresentationCapture

    cfg = small_config(tmp_path, f"model.arch={arch}", "distill.mode=aux", "distill.adapter=linear",
                       "distill.teacher=unused")  # fmt: skip
    src = build_source(cfg)
    plain_cfg = small_config(tmp_path, f"model.arch={arch}")
    d = DistInfo(0, 1, 0, torch.device("cpu"))
    plain = build_model_for(plain_cfg, src.spec, d, training=False).built.model
    student = build_model_for(cfg, src.spec, d, training=False).built.model
    assert isinstance(student, type(plain)) and type(student) is not type(plain)
    serving_keys = [k for k in student.state_dict() if not k.startswith("distill.")]
    assert serving_keys == list(plain.state_dict())  # the plain model's names, in order
    assert all(torch.equal(student.state_dict()[k], v) for k, v in plain.state_dict().items())  # same init
    lb = src.get("train", 0, 16)
    batch = with_teacher(lb.batch, torch.randn(16, 2))
    student.eval()
    plain.eval()
    with torch.no_grad():
        a, b = student(batch), plain(lb.batch)
    assert list(a) == ["ctr", "cvr"] and all(torch.equal(a[t], b[t]) for t in a)  # eval: serving only
    student.train()
    probe = copy.deepcopy(plain).train()
    cap = RepresentationCapture(probe)
    cap.enabled = True
    out = student(batch)
    probe(lb.batch)
    rep = cap.take()
    assert set(out) == {"ctr", "cvr", "aux:ctr", "aux:cvr", "adapter:ctr", "adapter:cvr"}
    for t in ("ctr", "cvr"):  # the auxiliary heads read the serving heads' input
        torch.testing.assert_close(out[f"aux:{t}"], student.distill.aux[t](rep))
        torch.testing.assert_close(out[f"adapter:{t}"], batch.teacher_logits[:, ("ctr", "cvr").index(t)])
    out["aux:ctr"].sum().backward()  # the auxiliary head trains the trunk too
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in student.named_parameters()
               if not n.startswith("distill."))  # fmt: skip


def test_attach_without_heads_changes_nothing(tmp_path):
    from gem_train.loop.build import build_source
    from gem_train.loop.model import build_model

    cfg = small_config(tmp_path)
    model = build_model(cfg.model, build_source(cfg).spec, torch.device("cpu"), 0).model
    cls = type(model)
    assert attach_student(model, DistillConfig(), ("ctr", "cvr")) is model and type(model) is cls
    assert not hasattr(model, "distill")


# ----------------------------------------------------------------------------------------------------------
# End to end: a student trained on a teacher's predictions evaluates without the teacher
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    ckpt = train_checkpoint(root, steps=2)
    out = root / "preds"
    run_predict(small_config(root), ckpt, out, embeddings=True, train_batches=4, progress=False)
    return ckpt, out


def _student(tmp_path, teacher_out, *extra):
    return small_config(tmp_path, "train.steps=3", f"distill.teacher={teacher_out}", *extra)


def _eval_lines(capsys):
    out = capsys.readouterr().out
    return [ln for ln in out.splitlines() if "NE" in ln]


@pytest.mark.parametrize(
    "extra",
    [
        ("distill.mode=aux", "distill.adapter=mlp", "distill.adapter_age=true",
         "distill.teacher_trained_until=1767225600"),
        ("model.arch=mlp", "distill.mode=serving", "distill.embeddings=true"),
    ],
    ids=["gem aux+adapter(age)", "mlp serving+embeddings"],
)  # fmt: skip
def test_student_trains_and_evaluates_without_the_teacher(teacher, tmp_path, capsys, extra):
    from gem_train.loop.trainer import Trainer

    out = _copy(teacher[1], tmp_path / "teacher")  # this test deletes files of it
    cfg = _student(tmp_path / "runs", out, *extra)
    res = Trainer(cfg).fit()
    assert res.status == "completed" and all(math.isfinite(x) for x in res.losses)
    ckpt = str(res.last_checkpoint)
    assert main(["eval", "--checkpoint", ckpt]) == 0
    with_teacher_files = _eval_lines(capsys)
    embeddings = "distill.embeddings=true" in extra
    if embeddings:  # the student scores data too: its stored features are joined into predict's batches
        scored = run_predict(cfg, ckpt, tmp_path / "student-preds", ("test",), progress=False)
        assert scored.rows == {"test": 75}
    # Soft labels are gone: only the stored representations (features) stay needed.
    for p in out.glob("train-*.parquet"):
        p.unlink()
    if not embeddings:
        for p in list(out.iterdir()):
            p.unlink()
        out.rmdir()
    assert main(["eval", "--checkpoint", ckpt]) == 0
    assert _eval_lines(capsys) == with_teacher_files
    if not embeddings:  # the serving model alone: [distill] off, its keys ignored
        assert main(["eval", "--checkpoint", ckpt, "distill.mode=none", "distill.adapter=none",
                     "distill.adapter_age=false"]) == 0  # fmt: skip
        assert _eval_lines(capsys) == with_teacher_files


def test_live_teacher_equals_the_stored_predictions(teacher, tmp_path):
    from gem_train.loop.build import build_source
    from gem_train.transfer.source import DistillSource

    ckpt, out = teacher
    stored_cfg = _student(tmp_path, out, "distill.mode=serving")
    live_cfg = small_config(tmp_path, "train.steps=3", "distill.mode=serving",
                            f"distill.teacher_checkpoint={ckpt}")  # fmt: skip
    stored = DistillSource(stored_cfg, build_source(stored_cfg), torch.device("cpu"), training=True)
    live = DistillSource(live_cfg, build_source(live_cfg), torch.device("cpu"), training=True)
    for j in range(3):
        a, b = stored.get("train", j, 16).batch, live.get("train", j, 16).batch
        assert isinstance(a, DistillBatch) and isinstance(b, DistillBatch)
        torch.testing.assert_close(a.teacher_logits, b.teacher_logits, rtol=1e-4, atol=1e-5)
        assert not isinstance(stored.get("test", 0, 32).batch, DistillBatch)  # soft labels: training only


# ----------------------------------------------------------------------------------------------------------
# Bad teacher inputs: one-line errors before training
# ----------------------------------------------------------------------------------------------------------


def _copy(out: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(out, dst)
    return dst


def _rewrite_shard(out: Path, name: str, fn) -> None:
    path = out / name
    table = pq.read_table(path)
    pq.write_table(fn(table).replace_schema_metadata(table.schema.metadata), path)
    m = json.loads((out / "manifest.json").read_text())
    for split in m["splits"].values():
        for s in split["shards"]:
            if s["file"] == name:
                s["bytes"] = path.stat().st_size
    (out / "manifest.json").write_text(json.dumps(m))


def _nan_logit(table: pa.Table) -> pa.Table:
    lg = table.column("ctr_logit").to_numpy().copy()
    lg[5] = np.nan
    return table.set_column(table.schema.get_field_index("ctr_logit"), "ctr_logit", pa.array(lg))


def _drop_rows(table: pa.Table) -> pa.Table:
    return table.slice(0, 20)


def _tasks_ctr_only(out: Path) -> None:
    m = json.loads((out / "manifest.json").read_text())
    m["tasks"] = ["ctr"]
    (out / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "damage, extra, message",
    [
        (lambda o: _rewrite_shard(o, "train-00000.parquet", _drop_rows), (), "have no row for"),
        (None, ("data.synthetic.window=1",), "were made on other data"),
        (None, ("data.batch_size=8",), "were made on other data"),
        (lambda o: _rewrite_shard(o, "train-00000.parquet", _nan_logit), (), "NaN or infinite teacher logit"),
        (_tasks_ctr_only, (), "of another task set"),
        (None, ("train.steps=9",), "cover 64 training rows; the student reads 144"),
        (lambda o: (o / "manifest.json").unlink(), (), "not a finished `gem-train predict` output"),
    ],
    ids=["missing keys", "key mismatch: other window", "key mismatch: other batch size", "NaN", "task set",
         "too few rows", "unfinished"],
)  # fmt: skip
def test_bad_teacher_inputs_are_one_line_errors(teacher, tmp_path, capsys, damage, extra, message):
    _, out = teacher
    bad = _copy(out, tmp_path / "bad")
    if damage is not None:
        damage(bad)
    args = ["train", "--config", "tiny-cpu", *_student_args(tmp_path, bad), "distill.mode=aux", *extra]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err  # one line: "gem-train: error: ..."
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())  # no run directory


def test_resume_refuses_other_teacher_predictions_unless_allowed(teacher, tmp_path, capsys):
    """The student's data identity holds the teacher's (the predictions' manifest digest): predictions
    rewritten under the same ``distill.teacher`` path are another run's data (issue 34's resume check)."""
    out = _copy(teacher[1], tmp_path / "teacher")
    args = ["train", "--config", "tiny-cpu", *_student_args(tmp_path, out), "distill.mode=aux"]
    assert main(args) == 0
    (run,) = (tmp_path / "runs").iterdir()
    capsys.readouterr()
    m = json.loads((out / "manifest.json").read_text())
    m["step"] = int(m["step"]) + 1  # as if another teacher checkpoint had made them
    (out / "manifest.json").write_text(json.dumps(m))
    assert main(["train", "--resume", str(run), "train.steps=4"]) == 2
    err = capsys.readouterr().err
    assert "distill.teacher: the teacher's data" in err and "--allow-change distill.teacher" in err, err
    assert main(["train", "--resume", str(run), "--allow-change", "distill.teacher", "train.steps=4"]) == 0


def _student_args(tmp_path: Path, teacher_out: Path) -> list[str]:
    from transfer_fixtures import SMALL

    return [*SMALL, f"run.out_dir={tmp_path / 'runs'}", "train.steps=3", f"distill.teacher={teacher_out}"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("distill.adapter=linear", "distill.teacher=x"), "needs distill.mode"),
        (("distill.embeddings=true",), "set distill.teacher"),
        (("distill.mode=aux",), "soft labels need a teacher"),
        (("distill.mode=aux", "distill.teacher=x", "distill.teacher_checkpoint=y"), "not both"),
        (("distill.mode=aux", "distill.adapter=mlp", "distill.adapter_age=true", "distill.teacher=x"),
         "teacher_trained_until"),
        (("distill.weight=-1",), "distill.weight"),
    ],
)  # fmt: skip
def test_distill_config_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        small_config(tmp_path, *overrides)


def test_unknown_distilled_task_is_a_config_error(teacher, tmp_path):
    from gem_train.loop.build import build_run

    _, out = teacher
    with pytest.raises(ConfigError, match=r"distill\.tasks"):
        build_run(_student(tmp_path, out, "distill.mode=aux", 'distill.tasks=["ctr", "purchase"]'))


def test_distill_batch_moves_pins_and_selects_its_teacher_fields():
    from gem_train.loop.build import build_source

    b = 6
    src = build_source(small_config(Path("/tmp")))
    lb = src.get("train", 0, b)
    db = with_teacher(lb.batch, torch.arange(2 * b, dtype=torch.float32).view(b, 2), torch.arange(b) * 1.0)
    sub = db.select([4, 1])
    assert isinstance(sub, DistillBatch) and sub.teacher_logits.tolist() == [[8.0, 9.0], [2.0, 3.0]]
    assert sub.teacher_age.tolist() == [4.0, 1.0]
    moved = db.to("cpu")
    assert isinstance(moved, DistillBatch) and torch.equal(moved.teacher_logits, db.teacher_logits)
    assert isinstance(db, GemBatch)


@pytest.mark.distributed
def test_torchrun_two_ranks_train_a_distilled_student_that_evaluates_in_one_process(
    teacher, tmp_path, capsys
):
    """FSDP2 (GEM) with the auxiliary heads and adapters inside the sharded model; each rank joins its own
    batches' teacher rows; the checkpoint evaluates in one process."""
    import os
    import subprocess

    from transfer_fixtures import SMALL

    _, out = teacher
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "gem_train.cli", "train", *SMALL, f"run.out_dir={runs}", "train.steps=2",
        f"distill.teacher={out}", "distill.mode=aux", "distill.adapter=linear", "distill.embeddings=true",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    ckpt = next(runs.glob("*/checkpoints/step_00000002"))
    assert main(["eval", "--checkpoint", str(ckpt)]) == 0
    assert len(_eval_lines(capsys)) == 2
