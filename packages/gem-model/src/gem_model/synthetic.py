"""Random, realistic-looking batches for tests and benchmarks.

Histories have heavy-tailed (log-normal) lengths with some empty and single-event users, ids are skewed
towards popular items (as real id traffic is), timestamps are spread over a year with most events recent,
and labels depend on the inputs (so a model can learn them) with a fraction missing.
"""

from __future__ import annotations

import math

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model.batch import GemBatch, JaggedSequence
from gem_model.features import FeatureSpec

__all__ = ["random_batch", "random_lengths"]

_EPOCH = 1_750_000_000  # a request time in 2025, seconds
_YEAR = 365 * 24 * 3600


def random_lengths(
    batch_size: int,
    max_len: int,
    *,
    generator: torch.Generator,
    median: float | None = None,
    sigma: float = 1.0,
    empty_fraction: float = 0.05,
) -> torch.Tensor:
    """Log-normal lengths ``[B]`` int64 in ``[0, max_len]`` with about ``empty_fraction`` zeros.

    ``median`` defaults to ``max_len / 4``; with ``sigma = 1`` about 8% of users then hit ``max_len``
    (the truncated tail), as real histories do.
    """
    median = max_len / 4 if median is None else median
    z = torch.randn(batch_size, generator=generator, dtype=torch.float64)
    lengths = torch.exp(math.log(max(median, 1.0)) + sigma * z).round().clamp(1, max_len).to(torch.int64)
    empty = torch.rand(batch_size, generator=generator) < empty_fraction
    return torch.where(empty, torch.zeros_like(lengths), lengths)


def _skewed_ids(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    # u**3 puts ~46% of the mass on the first 10% of ids: a cheap power-law-like popularity skew.
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return (u.pow(3) * vocab).to(torch.int64).clamp_(max=vocab - 1)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def random_batch(
    spec: FeatureSpec,
    batch_size: int,
    *,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
    length_median: float | None = None,
    length_sigma: float = 1.0,
    empty_fraction: float = 0.05,
    missing_label_rate: float = 0.1,
) -> GemBatch:
    """A random :class:`GemBatch` that satisfies ``batch.validate(spec)``.

    Args:
        spec: the features to generate.
        batch_size: B.
        generator: CPU random generator (takes precedence over ``seed``).
        seed: seed of a fresh generator when ``generator`` is None (None = seed 0, deterministic).
        device: where the batch lives (built on the CPU, then moved).
        length_median: median history length (default ``max_len / 4`` of each sequence).
        length_sigma: log-normal sigma of history lengths (the tail weight).
        empty_fraction: share of users with an empty history, per sequence.
        missing_label_rate: share of labels masked out, per task.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    g = generator if generator is not None else torch.Generator().manual_seed(0 if seed is None else seed)
    b = batch_size

    dense = torch.randn(b, spec.n_dense, generator=g)
    request_time = _EPOCH + torch.randint(0, 30 * 24 * 3600, (b,), generator=g)

    # Pooled features, key-major as a KJT wants: all of key 0's samples, then key 1's, ...
    values, lengths = [], []
    for f in spec.sparse:
        n = (
            torch.randint(1, f.max_ids + 1, (b,), generator=g)
            if f.max_ids > 1
            else torch.ones(b, dtype=torch.int64)
        )
        lengths.append(n)
        values.append(_skewed_ids(int(n.sum()), f.num_embeddings, g))
    sparse = KeyedJaggedTensor(
        keys=spec.sparse_names,
        values=torch.cat(values) if values else torch.zeros(0, dtype=torch.int64),
        lengths=torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64),
        stride=b,
    )

    sequences: dict[str, JaggedSequence] = {}
    for s in spec.sequences:
        n = random_lengths(b, s.max_len, generator=g, median=length_median, sigma=length_sigma,
                           empty_fraction=empty_fraction)  # fmt: skip
        total = int(n.sum())
        owner = torch.repeat_interleave(torch.arange(b), n)
        # Event ages log-uniform in [1 s, 1 year]: most events are recent, a long tail is old.
        age = torch.exp(torch.rand(total, generator=g, dtype=torch.float64) * math.log(_YEAR)).to(torch.int64)
        # Oldest first within each user: sort by (owner, -age) in one int64 key.
        order = torch.argsort(owner * (4 * _YEAR) + (2 * _YEAR - age), stable=True)
        timestamps = request_time[owner] - age[order]
        sequences[s.name] = JaggedSequence(
            offsets=_offsets(n),
            max_len=max(int(n.max()), 1),
            item_ids=_skewed_ids(total, s.num_items, g),
            action_ids=torch.randint(0, s.num_actions, (total,), generator=g),
            timestamps=timestamps,
            # Drawn only when F > 0, so specs without event features keep their random stream.
            event_features=torch.bernoulli(torch.full((total, s.num_event_features), 0.2), generator=g)
            if s.num_event_features
            else None,
        )

    # Labels the model can learn: a dense feature, a user x ad id match and the latest action all matter.
    logit = -1.0 + 1.5 * (dense[:, 0] if spec.n_dense else torch.zeros(b))
    if len(spec.sparse) >= 2:
        first, last = sparse[spec.sparse[0].name], sparse[spec.sparse[-1].name]
        match = (first.to_padded_dense(1)[:, 0] % 5) == (last.to_padded_dense(1)[:, 0] % 5)
        logit = logit + 2.0 * match.float()
    seq0 = sequences[spec.sequences[0].name]
    has = seq0.lengths > 0
    last_action = torch.zeros(b, dtype=torch.int64)
    last_action[has] = seq0.action_ids[seq0.offsets[1:][has] - 1]
    logit = logit + 1.0 * (last_action % 2 == 1).float()
    labels = torch.stack(
        [torch.bernoulli(torch.sigmoid(logit - 1.5 * t), generator=g) for t in range(len(spec.tasks))], dim=1
    )
    label_mask = torch.rand(b, len(spec.tasks), generator=g) >= missing_label_rate

    batch = GemBatch(dense, sparse, sequences, request_time, labels, label_mask)
    return batch if device is None else batch.to(device)
