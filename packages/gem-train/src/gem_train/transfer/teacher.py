"""The teacher's predictions for a student: stored (a ``gem-train predict`` output, joined by key: the
production path, ExFM's data-augmentation service) or live (a teacher checkpoint run on each batch).

:class:`TeacherTable` loads the shards the manifest lists and checks, before training starts, that they fit
the student: the same data (:func:`gem_train.transfer.rows.fingerprint`), the same key columns, every
student task predicted, finite logits, no duplicate key, representations where asked. A batch row without a
teacher row is a :class:`~gem_train.transfer.errors.TransferDataError` naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from gem_train.config import TrainConfig
from gem_train.data.loader import BatchSource
from gem_train.transfer.errors import TransferDataError
from gem_train.transfer.prediction_files import read_manifest
from gem_train.transfer.rows import SPLIT_COLUMN, fingerprint, join_columns

__all__ = ["KeyIndex", "LiveTeacher", "TeacherTable"]

_SPLIT_CODES = {"train": 0, "valid": 1, "test": 2}


def _show(key: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v.item() if isinstance(v, np.generic) else v!r}" for k, v in key.items())


class KeyIndex:
    """Rows of a table by their key (one or more int or string columns): vectorized lookups."""

    def __init__(self, columns: dict[str, np.ndarray], where: str) -> None:
        self.names = list(columns)
        self._vocab: dict[str, np.ndarray] = {}
        for name, values in columns.items():
            if values.dtype == object and name != SPLIT_COLUMN:
                self._vocab[name] = np.unique(values)
        rec = self._records(columns)
        self.order = np.argsort(rec, kind="stable")
        self.sorted = rec[self.order]
        dup = np.flatnonzero(self.sorted[1:] == self.sorted[:-1])
        if len(dup):
            row = int(self.order[dup[0]])
            first = {k: columns[k][row] for k in self.names}
            raise TransferDataError(f"{where}: duplicate key ({_show(first)}): keys must identify one row")

    def _codes(self, name: str, values: np.ndarray) -> np.ndarray:
        if name == SPLIT_COLUMN:
            return np.array([_SPLIT_CODES.get(str(v), -1) for v in values], np.int64)
        if name in self._vocab:
            vocab = self._vocab[name]
            pos = np.minimum(np.searchsorted(vocab, values), max(len(vocab) - 1, 0))
            found = len(vocab) > 0 and (vocab[pos] == values)
            return np.where(found, pos, -1).astype(np.int64)
        if values.dtype == object:  # strings where the table has ints: nothing matches
            return np.full(len(values), -1, np.int64)
        return values.astype(np.int64)

    def _records(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        codes = np.stack([self._codes(k, np.asarray(columns[k])) for k in self.names], axis=1)
        return np.ascontiguousarray(codes).view(np.dtype((np.void, 8 * len(self.names)))).ravel()

    def find(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        """``[n]`` int64 row of each key (-1: not in the table)."""
        q = self._records(columns)
        if not len(self.sorted):
            return np.full(len(q), -1, np.int64)
        pos = np.minimum(np.searchsorted(self.sorted, q), len(self.sorted) - 1)
        return np.where(self.sorted[pos] == q, self.order[pos], -1).astype(np.int64)


class TeacherTable:
    """A ``predict`` output loaded for a student (see the module docstring).

    Args:
        out: the predict output directory.
        cfg, source: the student's config and (plain) data source.
        splits: the splits to load (those the student reads teacher data from).
        embeddings: load the representations too (their per-dimension mean and std over the teacher's
            training-split rows standardise them).
    """

    def __init__(
        self,
        out: str | Path,
        cfg: TrainConfig,
        source: BatchSource,
        splits: tuple[str, ...],
        embeddings: bool,
    ) -> None:
        self.out = Path(out)
        m = self.manifest = read_manifest(self.out, splits)
        where = f"teacher predictions {self.out}"
        mine, theirs = fingerprint(cfg, source), m["data"]
        diff = [f"{k}: {theirs.get(k)!r} (teacher) vs {v!r} (student)" for k, v in mine.items()
                if theirs.get(k) != v]  # fmt: skip
        if diff:
            raise TransferDataError(
                f"{where} were made on other data, so their keys name other rows: {'; '.join(diff)}"
            )
        if m["key_columns"] != join_columns(source):
            raise TransferDataError(
                f"{where} are keyed by {m['key_columns']}, this data by {join_columns(source)}"
            )
        self.tasks = tuple(source.spec.tasks)
        missing = [t for t in self.tasks if t not in m["tasks"]]
        if missing:
            raise TransferDataError(
                f"{where} are of another task set: the teacher predicts {m['tasks']}, the student needs "
                f"{list(self.tasks)} (no {missing})"
            )
        if embeddings and not m.get("embedding"):
            raise TransferDataError(
                f"{where} hold no representations: run gem-train predict with --embeddings"
            )
        self.embedding_dim = int(m["embedding"]["dim"]) if embeddings else 0
        keys: dict[str, list[np.ndarray]] = {k: [] for k in m["key_columns"]}
        logits, embs = [], []
        for split in splits:
            if split not in m["splits"]:
                raise TransferDataError(f"{where} have no {split} split (predict it: --split {split} or all)")
            for shard in m["splits"][split]["shards"]:
                path = self.out / shard["file"]
                cols = list(keys) + [f"{t}_logit" for t in self.tasks] + (["embedding"] if embeddings else [])
                table = pq.read_table(path, columns=cols)
                for k in keys:
                    keys[k].append(table.column(k).to_numpy(zero_copy_only=False))
                lg = np.stack([table.column(f"{t}_logit").to_numpy() for t in self.tasks], 1).astype(
                    np.float32
                )
                bad = ~np.isfinite(lg).all(axis=1)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    key = {k: keys[k][-1][i] for k in keys}
                    raise TransferDataError(
                        f"{path}: {int(bad.sum())} row(s) with a NaN or infinite teacher logit, e.g. "
                        f"{_show(key)}"
                    )
                logits.append(lg)
                if embeddings:
                    col = table.column("embedding").combine_chunks()
                    embs.append(col.flatten().to_numpy().astype(np.float32).reshape(len(lg), -1))
        flat = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in keys.items()}
        self.index = KeyIndex(flat, where)
        self.logits = np.concatenate(logits) if logits else np.zeros((0, len(self.tasks)), np.float32)
        self.embeddings: np.ndarray | None = None
        if embeddings:
            stats = m["splits"].get("train") or next(iter(m["splits"].values()))
            mean = np.asarray(stats["embedding_mean"], np.float32)
            std = np.maximum(np.asarray(stats["embedding_std"], np.float32), 1e-6)
            self.embeddings = (np.concatenate(embs) - mean) / std
            if not np.isfinite(self.embeddings).all():
                raise TransferDataError(f"{where}: NaN or infinite representations")

    def rows(self, keys: dict[str, np.ndarray], what: str) -> np.ndarray:
        """The table rows of ``keys`` (join columns -> ``[n]``); a missing one is a TransferDataError."""
        rows = self.index.find(keys)
        if (rows < 0).any():
            i = int(np.flatnonzero(rows < 0)[0])
            key = {k: keys[k][i] for k in keys}
            raise TransferDataError(
                f"teacher predictions {self.out} have no row for {int((rows < 0).sum())} of {len(rows)} rows "
                f"of {what}, e.g. {_show(key)}: predict every row the student reads (the same data, "
                "--split all, --train-batches covering its steps)"
            )
        return rows


class LiveTeacher:
    """A teacher checkpoint run on each training batch (experiments; labels only): its logits of the
    student's tasks. It reads the student's raw batches, so it must have been trained on the same features
    and tasks (the checkpoint is loaded into a model of this data's spec: a mismatch is an error)."""

    def __init__(self, checkpoint: str | Path, spec: Any, device: torch.device) -> None:
        from gem_train.checkpoint import CheckpointError, load_checkpoint, read_trainer_state
        from gem_train.config import config_from_dict
        from gem_train.loop.build import build_model_for, resolve_autocast
        from gem_train.loop.distributed import DistInfo
        from gem_train.loop.run_dir import resolve_checkpoint

        ckpt = self.checkpoint = resolve_checkpoint(Path(checkpoint))
        tcfg = config_from_dict(TrainConfig, read_trainer_state(ckpt)["config"])
        self.device, self.tasks = device, tuple(spec.tasks)
        self.autocast = resolve_autocast(tcfg.train.autocast, device)
        with torch.random.fork_rng(devices=[]):  # building a model seeds the global RNG: keep the student's
            prepared = build_model_for(tcfg, spec, DistInfo(0, 1, 0, device), training=False)
        self.model = prepared.module.eval()
        try:
            load_checkpoint(ckpt, prepared.built.model, None, restore_rng=False)
        except CheckpointError as e:
            raise TransferDataError(
                f"teacher checkpoint {ckpt} does not fit this data's features or tasks ({self.tasks}): {e}"
            ) from None

    def logits(self, batch: Any) -> torch.Tensor:
        """``[B, T]`` float32 teacher logits of ``batch`` (a raw batch of the student's data), on the host."""
        from gem_train.transfer.predict import launch_forward

        logits, _ = launch_forward(self.model, batch, self.tasks, self.device, self.autocast).wait()
        return logits.clone()  # a normal tensor (inference-mode tensors cannot be saved for backward)
