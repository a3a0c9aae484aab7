"""The student's data: the dataset's batches with the teacher's data joined in (:func:`transfer_source`).

- **Soft labels** (``distill.mode`` / ``adapter``, training runs only): every training batch becomes a
  :class:`~gem_train.transfer.batch.DistillBatch` carrying the teacher's logits of its rows, read from a
  ``predict`` output by key or computed live from ``distill.teacher_checkpoint``, and with
  ``distill.adapter_age`` the teacher's age in days.
- **Stored representations** (``distill.embeddings``, every split, evaluation included): the teacher's
  representation of the row, standardised per dimension by the teacher's training-split statistics, is
  appended to the dense features (so the student's ``FeatureSpec.n_dense`` grows by its width);
  ``distill.embedding_history`` appends the mean representation of the row's history events too. These are
  stored features like any column: evaluating the student needs the files, never the teacher.

Without ``[distill]`` the dataset is returned as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from gem_model import GemBatch
from gem_train.config import ConfigError, TrainConfig
from gem_train.data.identity import data_identity
from gem_train.data.loader import BatchSource, LoadedBatch
from gem_train.transfer.batch import with_teacher
from gem_train.transfer.errors import TransferDataError
from gem_train.transfer.rows import batch_keys, dataset_kind, history_events
from gem_train.transfer.teacher import LiveTeacher, TeacherTable

__all__ = ["DistillSource", "transfer_source"]

_DAY = 86_400.0


def transfer_source(cfg: TrainConfig, source: BatchSource, device: torch.device, *, training: bool) -> Any:
    """``source`` with the teacher's data joined in as ``cfg.distill`` asks (``source`` itself without)."""
    if not cfg.distill.active:
        return source
    return DistillSource(cfg, source, device, training=training)


class _JoinedStream(IterableDataset):
    """A source's own stream (Parquet) with the teacher's data joined into each batch, in the worker."""

    def __init__(self, stream: IterableDataset, source: DistillSource, split: str, batch_size: int) -> None:
        super().__init__()
        self.stream, self.source, self.split, self.batch_size = stream, source, split, batch_size

    def __iter__(self) -> Any:
        for lb in self.stream:
            yield self.source.join(self.split, lb, self.batch_size)


class DistillSource:
    """A :class:`~gem_train.data.loader.BatchSource` that joins the teacher's data into ``inner``'s batches
    (see the module docstring); everything else is ``inner``'s."""

    def __init__(self, cfg: TrainConfig, inner: BatchSource, device: torch.device, *, training: bool) -> None:
        d = cfg.distill
        self.inner, self.cfg, self.training = inner, cfg, training
        self.tasks = tuple(inner.spec.tasks)
        unknown = [t for t in d.tasks if t not in self.tasks]
        if unknown:
            raise ConfigError(
                f"distill.tasks: {unknown} are not tasks of this dataset ({', '.join(self.tasks)})"
            )
        if d.embedding_history and dataset_kind(inner) != "movielens-100k":
            raise ConfigError(
                "distill.embedding_history needs history events that are examples with stored "
                "representations (data.source = 'movielens-100k')"
            )
        self.labels = training and d.needs_teacher_labels
        if self.labels and cfg.parallel.balancer != "none":
            raise ConfigError(
                f"parallel.balancer = {cfg.parallel.balancer!r} rebuilds the training batches without the "
                "teacher's labels: use 'none' with distill.mode / distill.adapter"
            )
        stored = d.embeddings or d.embedding_history
        splits = [
            s for s in ("train", "valid", "test") if inner.num_batches(s, cfg.data.eval_batch_size) != 0
        ]
        want: tuple[str, ...] = tuple(splits) if stored else ("train",)
        if not training and not d.embedding_history:
            want = tuple(s for s in want if s != "train")  # evaluation reads valid/test rows only
        self.table = None
        if d.teacher and (self.labels or stored):
            self.table = TeacherTable(d.teacher, cfg, inner, want, embeddings=stored)
        self.live = None
        if d.teacher_checkpoint and self.labels:
            # Loader worker processes cannot use CUDA: the teacher runs on the CPU there.
            teacher_device = device if cfg.data.num_workers == 0 else torch.device("cpu")
            self.live = LiveTeacher(d.teacher_checkpoint, inner.spec, teacher_device)
        width = self.table.embedding_dim if self.table is not None else 0
        extra = width * (int(d.embeddings) + int(d.embedding_history))
        self.spec = dataclasses.replace(inner.spec, n_dense=inner.spec.n_dense + extra)
        if hasattr(inner, "make_stream"):
            self.make_stream = self._make_stream
        if self.labels:
            self._check_coverage()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def data_identity(self) -> dict[str, Any]:
        """``inner``'s data identity (:mod:`gem_train.data.identity`) plus the teacher's: the sha256 of the
        predictions' manifest (it lists every shard with its size, the teacher checkpoint and its step) or of
        the live teacher checkpoint's manifest, so that a resume refuses other teacher data under the same
        ``distill.teacher`` path."""
        identity = dict(data_identity(self.inner))
        d, manifest = self.cfg.distill, None
        if self.table is not None:
            manifest = self.table.out / "manifest.json"
        elif self.live is not None:
            manifest = self.live.checkpoint / "manifest.json"
        if manifest is not None:
            key = "distill.teacher" if d.teacher else "distill.teacher_checkpoint"
            digest = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None
            identity["teacher"] = {"key": key, "manifest_sha256": digest}
        return identity

    # -- BatchSource -----------------------------------------------------------------------------------------

    def num_batches(self, split: Any, batch_size: int) -> int | None:
        return self.inner.num_batches(split, batch_size)

    def get(self, split: Any, index: int, batch_size: int) -> LoadedBatch:
        return self.join(split, self.inner.get(split, index, batch_size), batch_size)

    def _make_stream(self, split: Any, batch_size: int, **kwargs: Any) -> IterableDataset:
        stream = self.inner.make_stream(split, batch_size, **kwargs)  # type: ignore[attr-defined]
        return _JoinedStream(stream, self, split, batch_size)

    # -- the join -------------------------------------------------------------------------------------------

    def join(self, split: str, lb: LoadedBatch, batch_size: int) -> LoadedBatch:
        """``lb`` (batch ``lb.index`` of ``split``, as the loader reads it) with the teacher's data of its
        rows joined in (in place; returned)."""
        d = self.cfg.distill
        raw: GemBatch = lb.batch
        what = f"{split} batch {lb.index}"
        keys = batch_keys(self.inner, split, lb, batch_size) if self.table is not None else {}
        batch = self.join_features(split, raw, keys, what)
        if self.labels and split == "train":
            if self.live is not None:
                logits = self.live.logits(raw)
            else:
                assert self.table is not None
                logits = torch.from_numpy(self.table.logits[self.table.rows(keys, what)])
            age = None
            if d.adapter_age:
                age = (raw.request_time.to(torch.float64) - d.teacher_trained_until).div(_DAY).float()
            batch = with_teacher(batch, logits, age)
        lb.batch = batch
        return lb

    def join_features(self, split: str, raw: GemBatch, keys: dict[str, np.ndarray], what: str) -> GemBatch:
        """``raw`` with the stored representations of its rows (join columns ``keys``) appended to its
        dense features, as ``distill.embeddings`` / ``embedding_history`` ask (``raw`` itself otherwise)."""
        d = self.cfg.distill
        extra = []
        if d.embeddings:
            assert self.table is not None and self.table.embeddings is not None
            extra.append(torch.from_numpy(self.table.embeddings[self.table.rows(keys, what)]))
        if d.embedding_history:
            extra.append(self._history_mean(keys["event"], what))
        if not extra:
            return raw
        return dataclasses.replace(raw, dense=torch.cat([raw.dense, *extra], dim=1))

    def _history_mean(self, events: np.ndarray, what: str) -> torch.Tensor:
        """``[B, D]`` the mean stored representation of each row's history events (0 for no history)."""
        assert self.table is not None and self.table.embeddings is not None
        offsets, history = history_events(self.inner, events)
        b = len(offsets) - 1
        rows = self.table.rows({"event": history}, f"the history events of {what}")
        emb = torch.from_numpy(self.table.embeddings[rows])
        lengths = torch.from_numpy(np.diff(offsets))
        owner = torch.repeat_interleave(torch.arange(b), lengths)
        sums = torch.zeros(b, emb.shape[1]).index_add_(0, owner, emb)
        return sums / lengths.clamp(min=1).to(torch.float32)[:, None]

    def _check_coverage(self) -> None:
        """Fail before training when the stored teacher predictions miss a training row the student will
        read (synthetic: the rows of its steps; MovieLens: every training event). A Parquet stream is
        checked batch by batch as it is read."""
        if self.table is None:
            return
        cfg, kind = self.cfg, dataset_kind(self.inner)
        if kind == "synthetic":
            bs = cfg.data.batch_size
            per_epoch = self.inner.num_batches("train", bs)
            world = int(torch.distributed.get_world_size()) if torch.distributed.is_initialized() else 1
            need = cfg.train.steps * world * bs if per_epoch is None else per_epoch * bs
            have = int(self.table.manifest["splits"]["train"]["rows"])
            if have < need:
                raise TransferDataError(
                    f"teacher predictions {self.table.out} cover {have:,} training rows; the student reads "
                    f"{need:,} (train.steps x data.batch_size x ranks): predict with --train-batches "
                    f"{-(-need // bs)}"
                )
            rows = np.arange(need, dtype=np.int64)
            self.table.rows({"split": np.full(need, "train", dtype=object), "row": rows}, "the training rows")
        elif kind == "movielens-100k":
            ml: Any = self.inner
            self.table.rows({"event": ml.train_rows.astype(np.int64)}, "the training events")
