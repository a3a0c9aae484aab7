"""Bucketed jagged sizes: a batch padded to one of a few static shapes, so that a CUDA graph per shape can
replay the whole training step (:mod:`gem_train.loop.cuda_graph`).

Every batch has different jagged sizes: the events of each sequence feature (``total``), the ids of each
pooled sparse feature. A :class:`BucketLadder` fixes a small set of *capacities*: the batch is padded to
``batch_capacity`` examples (``pad_examples`` more than the batch size), each sequence feature to the
smallest of its capacities that holds the batch's events (a geometric ladder, ``growth`` apart), each sparse
feature to ``batch_capacity * max_ids`` ids (the most a batch can hold), and every sequence's ``max_len`` to
the feature's ``max_len`` (a host int the kernels' grids depend on).

Padding is exact: the added rows belong to *dummy examples* (``label_mask`` all False, labels 0, dense
features 0, ``request_time`` 0) and the added events and ids to those dummies only (item, action and id 0,
timestamp 0, event features 0; at most ``max_len`` events per dummy). The loss is the mean over labelled
examples (``gem_model.multitask_loss``), so dummies add exact zeros to it, their gradient is exactly zero,
and no real example attends to, pools or mixes with a dummy's tokens (every op of the model that crosses rows
stays within one example). The step on a padded batch is the step on the batch, up to the order of floating
point sums over more rows (``tests/test_train_buckets.py`` measures it).

Padding works on the host or on the device without reading device values: every size it needs is a host int
(tensor shapes, the KJT's cached per-key id counts), and the small index tensors it builds go to the device
through pinned memory without blocking.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model import FeatureSpec, GemBatch, JaggedSequence

__all__ = ["BucketLadder", "pad_batch", "padded_fraction", "sequence_totals"]


def _ladder(lo: int, hi: int, growth: float, align: int) -> tuple[int, ...]:
    """Capacities ``c_0 < c_1 < ...``, multiples of ``align``: ``c_0 >= lo``, each ``<= growth`` times the
    one before (rounded up), the last ``>= hi``."""
    caps = [align * math.ceil(max(lo, 1) / align)]
    while caps[-1] < hi:
        caps.append(max(caps[-1] + align, align * math.ceil(caps[-1] * growth / align)))
    return tuple(caps)


@dataclass(frozen=True)
class BucketLadder:
    """The static shapes of a run's padded batches.

    Attributes:
        batch_capacity: examples of every padded batch (the batch size plus ``pad_examples`` dummies).
        seq_capacities: per sequence feature, its event capacities (ascending).
        max_len: per sequence feature, the padded batches' ``max_len`` (the feature's ``max_len``).
        id_capacities: per pooled sparse feature, its id capacity (``batch_capacity * max_ids``).
    """

    batch_capacity: int
    seq_capacities: dict[str, tuple[int, ...]]
    max_len: dict[str, int]
    id_capacities: dict[str, int]

    @classmethod
    def for_spec(
        cls,
        spec: FeatureSpec,
        batch_size: int,
        totals: Iterable[dict[str, int]],
        *,
        growth: float = 1.08,
        pad_examples: int | None = None,
        align: int = 256,
    ) -> BucketLadder:
        """A ladder for batches of ``batch_size`` examples whose event counts look like ``totals`` (per
        sequence feature, e.g. of a few dozen batches of the training stream): capacities from the smallest
        seen (rounded down to ``align``) to the largest seen, ``growth`` apart. ``pad_examples`` (default:
        enough dummies to hold one step of the ladder at ``max_len`` events each) sets the dummy count.

        Batches with more events than the last capacity are not bucketed (:meth:`bucket` returns None):
        the caller runs them unpadded."""
        if growth <= 1.0:
            raise ValueError(f"BucketLadder: growth must be > 1, got {growth}")
        seen = list(totals)
        if not seen:
            raise ValueError("BucketLadder.for_spec needs the event counts of at least one batch")
        seq_caps, max_len = {}, {}
        for s in spec.sequences:
            counts = [t[s.name] for t in seen]
            lo = align * (min(counts) // align)
            seq_caps[s.name] = _ladder(lo, max(counts), growth, align)
            max_len[s.name] = s.max_len
        if pad_examples is None:
            # The most padding a batch can need: one step of the ladder (or one alignment unit).
            steps = [
                max((b - a for a, b in itertools.pairwise(c)), default=align) / max_len[n]
                for n, c in seq_caps.items()
            ]
            pad_examples = max(1, math.ceil(max(steps, default=1.0)))
        b_cap = batch_size + pad_examples
        ids = {f.name: b_cap * f.max_ids for f in spec.sparse}
        return cls(b_cap, seq_caps, max_len, ids)

    @classmethod
    def from_sample(
        cls, spec: FeatureSpec, batch_size: int, totals: Sequence[dict[str, int]], *, growth: float = 1.08
    ) -> BucketLadder:
        """:meth:`for_spec` over the range of a sample of batches widened to hold the batches the sample
        missed: from ``1 / growth`` of its smallest to ``growth**2`` times its largest event count."""
        lo = [{k: int(v / growth) for k, v in t.items()} for t in totals]
        hi = [{k: math.ceil(v * growth**2) for k, v in t.items()} for t in totals]
        return cls.for_spec(spec, batch_size, [*lo, *hi], growth=growth)

    def bucket(self, totals: dict[str, int], batch_size: int) -> tuple[int, ...] | None:
        """The capacities (one per sequence feature, in the ladder's order) that hold a batch of
        ``batch_size`` examples with ``totals`` events, or None if none does: more events than the last
        capacity, or more than its dummies can take (``max_len`` each), or more examples than the ladder."""
        dummies = self.batch_capacity - batch_size
        if dummies < 1:
            return None
        caps = []
        for name, ladder in self.seq_capacities.items():
            total = totals[name]
            cap = next((c for c in ladder if c >= total), None)
            # The padding must fit the dummies; a larger capacity may not fit either (more padding).
            if cap is None or cap - total > dummies * self.max_len[name]:
                return None
            caps.append(cap)
        return tuple(caps)


def _to(device: torch.device, values: Sequence[int] | Tensor, dtype: torch.dtype = torch.int64) -> Tensor:
    """A small host-made tensor on ``device`` without blocking (pinned staging on CUDA)."""
    t = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _spread(extra: int, slots: int, cap: int | None = None) -> list[int]:
    """``extra`` split over ``slots`` as evenly as possible (each at most ``cap``)."""
    base, rem = divmod(extra, slots)
    out = [base + (1 if i < rem else 0) for i in range(slots)]
    if cap is not None and out and out[0] > cap:
        raise ValueError(f"cannot spread {extra} padding rows over {slots} dummies of at most {cap}")
    return out


def _pad_rows(t: Tensor, n: int) -> Tensor:
    """``t`` with ``n`` zero rows appended (dim 0)."""
    return torch.cat([t, t.new_zeros((n, *t.shape[1:]))]) if n else t


def _pad_sequence(seq: JaggedSequence, dummies: int, capacity: int, max_len: int) -> JaggedSequence:
    total = seq.total
    extra = capacity - total
    lengths = _spread(extra, dummies, max_len)
    tail = _to(seq.offsets.device, [total + c for c in _cumsum(lengths)])
    return JaggedSequence(
        offsets=torch.cat([seq.offsets, tail]),
        max_len=max_len,
        item_ids=_pad_rows(seq.item_ids, extra),
        action_ids=_pad_rows(seq.action_ids, extra),
        timestamps=_pad_rows(seq.timestamps, extra),
        event_features=None if seq.event_features is None else _pad_rows(seq.event_features, extra),
    )


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def _pad_sparse(kjt: KeyedJaggedTensor, ladder: BucketLadder, b: int) -> KeyedJaggedTensor:
    dummies = ladder.batch_capacity - b
    keys = list(kjt.keys())
    per_key = kjt.length_per_key()  # host ints, cached where the batch was built
    lengths = kjt.lengths().view(len(keys), b) if keys else kjt.lengths()
    values, weights, parts, wparts, lens = kjt.values(), kjt.weights_or_none(), [], [], []
    start = 0
    for i, key in enumerate(keys):
        n = per_key[i]
        extra = ladder.id_capacities[key] - n
        if extra < 0:
            raise ValueError(f"pad_batch: {n} ids of {key!r} exceed the ladder's capacity")
        parts.append(_pad_rows(values[start : start + n], extra))
        if weights is not None:
            wparts.append(_pad_rows(weights[start : start + n], extra))
        lens.append(torch.cat([lengths[i], _to(lengths.device, _spread(extra, dummies), lengths.dtype)]))
        start += n
    caps = [ladder.id_capacities[k] for k in keys]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(parts) if parts else values,
        weights=torch.cat(wparts) if wparts else weights,
        lengths=torch.cat(lens) if lens else lengths,
        stride=ladder.batch_capacity,
        length_per_key=caps,
        offset_per_key=[0, *_cumsum(caps)],
    )


def pad_batch(batch: GemBatch, ladder: BucketLadder, bucket: tuple[int, ...]) -> GemBatch:
    """``batch`` padded to ``ladder``'s shapes with the sequence capacities ``bucket`` (from
    :meth:`BucketLadder.bucket`): see the module docstring. Same device as ``batch``; no host sync."""
    b = batch.batch_size
    dummies = ladder.batch_capacity - b
    if dummies < 1:
        raise ValueError(f"pad_batch: a batch of {b} examples leaves no dummy in {ladder.batch_capacity}")
    sequences = {
        name: _pad_sequence(batch.sequences[name], dummies, cap, ladder.max_len[name])
        for name, cap in zip(ladder.seq_capacities, bucket)
    }
    return GemBatch(
        dense=_pad_rows(batch.dense, dummies),
        sparse=_pad_sparse(batch.sparse, ladder, b),
        sequences=sequences,
        request_time=_pad_rows(batch.request_time, dummies),
        labels=_pad_rows(batch.labels, dummies),
        label_mask=_pad_rows(batch.label_mask, dummies),
    )


def sequence_totals(batch: GemBatch) -> dict[str, int]:
    """Events per sequence feature (host ints, from shapes)."""
    return {name: seq.total for name, seq in batch.sequences.items()}


def padded_fraction(ladder: BucketLadder, batches: Iterable[GemBatch]) -> dict[str, float]:
    """Over ``batches``: the share of padded events in the padded batches (per sequence feature and over
    all), the share of dummy examples, and the share of batches no bucket holds (run unpadded)."""
    real: dict[str, int] = {}
    padded: dict[str, int] = {}
    n = overflow = examples = 0
    for batch in batches:
        n += 1
        totals = sequence_totals(batch)
        bucket = ladder.bucket(totals, batch.batch_size)
        if bucket is None:
            overflow += 1
            continue
        examples += batch.batch_size
        for (name, total), cap in zip(totals.items(), bucket):
            real[name] = real.get(name, 0) + total
            padded[name] = padded.get(name, 0) + cap
    out = {f"padded_events_{k}": 1 - real[k] / padded[k] for k in real if padded[k]}
    all_real, all_padded = sum(real.values()), sum(padded.values())
    out["padded_events"] = 1 - all_real / all_padded if all_padded else 0.0
    bucketed = n - overflow
    out["dummy_examples"] = 1 - examples / (bucketed * ladder.batch_capacity) if bucketed else 0.0
    out["overflow_batches"] = overflow / n if n else 0.0
    return out
