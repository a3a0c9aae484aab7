"""The typed training batch: dense features, a KeyedJaggedTensor of pooled ids, jagged behaviour sequences.

Jagged convention (shared with gem_kernels): flat ``values`` of ``total`` rows, ``offsets`` ``[B+1]`` int64
with ``offsets[0] == 0`` and sample ``b`` owning rows ``offsets[b]:offsets[b+1]``, plus a host ``max_len`` so
that no kernel needs a device sync to learn shapes.

The KeyedJaggedTensor of pooled ids carries its per-key id counts on the host (``length_per_key`` and
``offset_per_key``, computed when the batch is built, usually on the CPU, and kept by ``to`` and
``pin_memory``), so TorchRec's ``to_dict``/``split`` inside the step never calls ``.tolist()`` on device
lengths: no host sync, and no graph break under ``torch.compile``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model.features import FeatureSpec

__all__ = ["GemBatch", "JaggedSequence", "cache_host_lengths"]


def cache_host_lengths(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """Computes and caches ``kjt``'s ``length_per_key`` and ``offset_per_key`` (host lists); returns ``kjt``.

    Reads the lengths (a device sync if they are on a GPU: call it where the batch is built). Leaves a KJT
    whose lengths do not match its keys and stride alone, for :meth:`GemBatch.validate` to report.
    """
    lengths = kjt.lengths()
    if not kjt.variable_stride_per_key() and lengths.numel() == len(kjt.keys()) * kjt.stride():
        kjt.length_per_key()
        kjt.offset_per_key()
    return kjt


def _err(field: str, msg: str) -> ValueError:
    return ValueError(f"GemBatch.{field}: {msg}")


def _check_offsets(field: str, offsets: Tensor, batch_size: int, total: int) -> Tensor:
    """Checks a ``[B+1]`` int64 offsets tensor; returns the lengths ``[B]``."""
    if not isinstance(offsets, Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise _err(field, f"must be a 1-D int64 tensor, got {getattr(offsets, 'dtype', type(offsets))}")
    if offsets.numel() != batch_size + 1:
        raise _err(field, f"must have B+1 = {batch_size + 1} entries, got {offsets.numel()}")
    if int(offsets[0]) != 0:
        raise _err(field, f"offsets[0] must be 0, got {int(offsets[0])}")
    lengths = offsets[1:] - offsets[:-1]
    if batch_size and bool((lengths < 0).any()):
        raise _err(field, "offsets must be non-decreasing")
    if int(offsets[-1]) != total:
        raise _err(field, f"offsets[-1] = {int(offsets[-1])} but the values hold {total} rows")
    return lengths


def _check_event_features(field: str, features: Tensor | None, total: int, n_features: int) -> None:
    """Checks a sequence's ``[total, F]`` float32 finite event features (None iff ``F == 0``)."""
    if n_features == 0:
        if features is not None:
            raise _err(field, "must be None: the spec's num_event_features is 0")
        return
    if not isinstance(features, Tensor) or tuple(features.shape) != (total, n_features):
        got = list(features.shape) if isinstance(features, Tensor) else type(features).__name__
        raise _err(field, f"expected shape [{total}, {n_features}] (total, num_event_features), got {got}")
    if features.dtype != torch.float32:
        raise _err(field, f"must be float32, got {features.dtype}")
    if not bool(torch.isfinite(features).all()):
        raise _err(field, "holds NaN or inf")


@dataclass
class JaggedSequence:
    """One behaviour sequence for a batch of B users, oldest event first.

    Attributes:
        offsets: ``[B+1]`` int64; user ``b`` owns rows ``offsets[b]:offsets[b+1]``.
        max_len: host int, >= the longest sequence in this batch.
        item_ids: ``[total]`` int64 item ids.
        action_ids: ``[total]`` int64 action-type ids.
        timestamps: ``[total]`` int64 seconds, non-decreasing within a sequence.
        event_features: ``[total, F]`` float32 dense side features of each event (row ``i`` belongs to
            event ``i``), ``F = SequenceFeature.num_event_features``; None when F == 0. E.g. the multi-hot
            genre vector of each history item: the model projects it with a bias-free Linear, which is the
            sum-pooled embedding bag of the active columns as one dense matmul (no sharded table).
    """

    offsets: Tensor
    max_len: int
    item_ids: Tensor
    action_ids: Tensor
    timestamps: Tensor
    event_features: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> Tensor:
        """``[B]`` int64 sequence lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def total(self) -> int:
        """Number of events in the batch (from the values' shape: a host int, no sync; symbolic when
        compiled, so no specialisation on it)."""
        return self.item_ids.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedSequence:
        return JaggedSequence(
            offsets=self.offsets.to(device, non_blocking=non_blocking),
            max_len=self.max_len,
            item_ids=self.item_ids.to(device, non_blocking=non_blocking),
            action_ids=self.action_ids.to(device, non_blocking=non_blocking),
            timestamps=self.timestamps.to(device, non_blocking=non_blocking),
            event_features=None
            if self.event_features is None
            else self.event_features.to(device, non_blocking=non_blocking),
        )

    def select(self, indices: Tensor) -> JaggedSequence:
        """The sequences of users ``indices`` (``[n]`` int64), in that order; ``max_len`` is kept."""
        lengths = self.lengths[indices]
        starts = self.offsets[:-1][indices]
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        rows = torch.repeat_interleave(starts - offsets[:-1], lengths) + torch.arange(
            int(offsets[-1]), device=lengths.device
        )
        return JaggedSequence(
            offsets,
            self.max_len,
            self.item_ids[rows],
            self.action_ids[rows],
            self.timestamps[rows],
            None if self.event_features is None else self.event_features[rows],
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Marks every tensor as used on ``stream`` (for batches copied on a side stream)."""
        for t in (self.offsets, self.item_ids, self.action_ids, self.timestamps, self.event_features):
            if t is not None:
                t.record_stream(stream)

    def pin_memory(self) -> JaggedSequence:
        return JaggedSequence(
            offsets=self.offsets.pin_memory(),
            max_len=self.max_len,
            item_ids=self.item_ids.pin_memory(),
            action_ids=self.action_ids.pin_memory(),
            timestamps=self.timestamps.pin_memory(),
            event_features=None if self.event_features is None else self.event_features.pin_memory(),
        )


@dataclass
class GemBatch:
    """A batch of B impressions.

    Attributes:
        dense: ``[B, n_dense]`` float32 dense features.
        sparse: KeyedJaggedTensor of int64 ids, keys ``spec.sparse_names`` in that order, stride B.
        sequences: name -> :class:`JaggedSequence`, keys ``spec.sequence_names``.
        request_time: ``[B]`` int64 seconds of the candidate impression (>= every timestamp of that user).
        labels: ``[B, T]`` float32 in {0, 1}, columns in ``spec.tasks`` order.
        label_mask: ``[B, T]`` bool, False where a label is missing.
    """

    dense: Tensor
    sparse: KeyedJaggedTensor
    sequences: dict[str, JaggedSequence]
    request_time: Tensor
    labels: Tensor
    label_mask: Tensor

    def __post_init__(self) -> None:
        # Host lengths of the pooled-id KJT, once, where the batch is built (see the module doc). Inside a
        # compiled region the KJT already has them (or the compiler traces what it needs).
        if isinstance(self.sparse, KeyedJaggedTensor) and not torch.compiler.is_compiling():
            cache_host_lengths(self.sparse)

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> GemBatch:
        """Copies every tensor to ``device`` (host ints such as ``max_len`` stay on the host)."""
        return GemBatch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(torch.device(device), non_blocking=non_blocking),
            sequences={k: s.to(device, non_blocking=non_blocking) for k, s in self.sequences.items()},
            request_time=self.request_time.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            label_mask=self.label_mask.to(device, non_blocking=non_blocking),
        )

    def select(self, indices: Tensor | list[int]) -> GemBatch:
        """The sub-batch of samples ``indices`` (in that order), e.g. to split a batch or test isolation."""
        idx = torch.as_tensor(indices, dtype=torch.int64, device=self.dense.device)
        keys, values, lengths = self.sparse.keys(), [], []
        for key in keys:
            jt = self.sparse[key]
            sub = JaggedSequence(jt.offsets(), 0, jt.values(), jt.values(), jt.values()).select(idx)
            values.append(sub.item_ids)
            lengths.append(sub.lengths)
        sparse = KeyedJaggedTensor(
            keys=keys,
            values=torch.cat(values) if values else self.sparse.values()[:0],
            lengths=torch.cat(lengths) if lengths else self.sparse.lengths()[:0],
            stride=idx.numel(),
        )
        return GemBatch(
            dense=self.dense[idx],
            sparse=sparse,
            sequences={k: s.select(idx) for k, s in self.sequences.items()},
            request_time=self.request_time[idx],
            labels=self.labels[idx],
            label_mask=self.label_mask[idx],
        )

    def is_pinned(self) -> bool:
        """Whether the batch is in page-locked host memory (checked on the dense features)."""
        return bool(self.dense.is_pinned())

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Marks every tensor as used on ``stream``, so the caching allocator does not reuse the memory of a
        batch copied on a side stream before ``stream``'s work on it is done."""
        for t in (self.dense, self.request_time, self.labels, self.label_mask):
            t.record_stream(stream)
        self.sparse.record_stream(stream)
        for seq in self.sequences.values():
            seq.record_stream(stream)

    def pin_memory(self) -> GemBatch:
        """Returns a copy in page-locked host memory (for ``to(cuda, non_blocking=True)``)."""
        return GemBatch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            sequences={k: s.pin_memory() for k, s in self.sequences.items()},
            request_time=self.request_time.pin_memory(),
            labels=self.labels.pin_memory(),
            label_mask=self.label_mask.pin_memory(),
        )

    def validate(self, spec: FeatureSpec) -> None:
        """Checks shapes, dtypes, keys, offsets and id ranges against ``spec``.

        Raises ``ValueError`` naming the offending field. Reads tensor values, so it syncs with the device:
        call it on data-loader output or in tests, not inside the training step.
        """
        if not isinstance(self.dense, Tensor) or self.dense.dim() != 2:
            raise _err(
                "dense", f"must be a 2-D tensor [B, n_dense], got {getattr(self.dense, 'shape', None)}"
            )
        b = self.dense.shape[0]
        if self.dense.shape[1] != spec.n_dense:
            raise _err("dense", f"expected {spec.n_dense} columns (spec.n_dense), got {self.dense.shape[1]}")
        if self.dense.dtype != torch.float32:
            raise _err("dense", f"must be float32, got {self.dense.dtype}")
        if not bool(torch.isfinite(self.dense).all()):
            raise _err("dense", "holds NaN or inf")

        self._validate_sparse(spec, b)
        self._validate_sequences(spec, b)

        t = len(spec.tasks)
        for name, tensor, dtype, shape in (
            ("request_time", self.request_time, torch.int64, (b,)),
            ("labels", self.labels, torch.float32, (b, t)),
            ("label_mask", self.label_mask, torch.bool, (b, t)),
        ):
            if not isinstance(tensor, Tensor) or tuple(tensor.shape) != shape:
                raise _err(name, f"expected shape {list(shape)}, got {list(getattr(tensor, 'shape', []))}")
            if tensor.dtype != dtype:
                raise _err(name, f"must be {dtype}, got {tensor.dtype}")
        if not bool(((self.labels == 0) | (self.labels == 1)).all()):
            raise _err("labels", "values must be 0 or 1")
        for s in spec.sequences:
            seq = self.sequences[s.name]
            if seq.timestamps.numel():
                owner = torch.repeat_interleave(torch.arange(b, device=seq.offsets.device), seq.lengths)
                if bool((seq.timestamps > self.request_time[owner]).any()):
                    raise _err(f"sequences[{s.name!r}].timestamps", "an event is later than its request_time")

    def _validate_sparse(self, spec: FeatureSpec, b: int) -> None:
        if not isinstance(self.sparse, KeyedJaggedTensor):
            raise _err("sparse", f"must be a KeyedJaggedTensor, got {type(self.sparse).__name__}")
        keys = list(self.sparse.keys())
        if keys != spec.sparse_names:
            raise _err(
                "sparse", f"keys {keys} differ from spec.sparse names {spec.sparse_names} (same order)"
            )
        if keys and self.sparse.stride() != b:
            raise _err("sparse", f"stride {self.sparse.stride()} differs from the batch size {b}")
        if keys and self.sparse.values().dtype != torch.int64:
            raise _err("sparse", f"ids must be int64, got {self.sparse.values().dtype}")
        for f in spec.sparse:
            jt = self.sparse[f.name]
            lengths, ids = jt.lengths(), jt.values()
            if bool((lengths < 0).any()) or bool((lengths > f.max_ids).any()):
                raise _err(f"sparse[{f.name!r}]", f"ids per sample must lie in [0, {f.max_ids}] (max_ids)")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= f.num_embeddings):
                raise _err(f"sparse[{f.name!r}]", f"ids must lie in [0, {f.num_embeddings}) (num_embeddings)")

    def _validate_sequences(self, spec: FeatureSpec, b: int) -> None:
        if not isinstance(self.sequences, dict) or set(self.sequences) != set(spec.sequence_names):
            got = (
                sorted(self.sequences) if isinstance(self.sequences, dict) else type(self.sequences).__name__
            )
            raise _err("sequences", f"keys {got} differ from spec.sequences {spec.sequence_names}")
        for s in spec.sequences:
            seq, field = self.sequences[s.name], f"sequences[{s.name!r}]"
            total = seq.item_ids.numel() if isinstance(seq.item_ids, Tensor) else -1
            for name in ("item_ids", "action_ids", "timestamps"):
                t = getattr(seq, name)
                if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.int64 or t.numel() != total:
                    raise _err(f"{field}.{name}", f"must be a 1-D int64 tensor of {total} rows (as item_ids)")
            _check_event_features(f"{field}.event_features", seq.event_features, total, s.num_event_features)
            lengths = _check_offsets(f"{field}.offsets", seq.offsets, b, total)
            longest = int(lengths.max()) if b else 0
            if not isinstance(seq.max_len, int) or seq.max_len < longest:
                raise _err(f"{field}.max_len", f"must be a host int >= the longest sequence {longest}")
            if longest > s.max_len:
                raise _err(f"{field}.offsets", f"a sequence of {longest} events exceeds max_len {s.max_len}")
            if total:
                if int(seq.item_ids.min()) < 0 or int(seq.item_ids.max()) >= s.num_items:
                    raise _err(f"{field}.item_ids", f"ids must lie in [0, {s.num_items}) (num_items)")
                if int(seq.action_ids.min()) < 0 or int(seq.action_ids.max()) >= s.num_actions:
                    raise _err(f"{field}.action_ids", f"ids must lie in [0, {s.num_actions}) (num_actions)")
                # Non-decreasing within each sequence: only steps that start a new sequence may go down.
                step_down = seq.timestamps[1:] < seq.timestamps[:-1]
                starts = torch.zeros(total, dtype=torch.bool, device=step_down.device)
                starts[seq.offsets[1:-1][seq.offsets[1:-1] < total]] = True
                if bool((step_down & ~starts[1:]).any()):
                    raise _err(
                        f"{field}.timestamps", "must be non-decreasing within a sequence (oldest first)"
                    )
