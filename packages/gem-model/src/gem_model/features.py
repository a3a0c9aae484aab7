"""Feature specifications: what a batch carries and what the embedding tables look like.

A :class:`FeatureSpec` is the single source of truth shared by data generators, the batch validator and the
model's embedding collections. Specs are frozen dataclasses so they can sit inside a frozen config.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FeatureSpec", "SequenceFeature", "SparseFeature"]


def _check_name(kind: str, name: str) -> None:
    # Names become TorchRec table/feature names and KJT keys; "." is reserved for our own
    # "<sequence>.<field>" keys, so forbid it here to keep keys unambiguous.
    if not isinstance(name, str) or not name or "." in name or name.strip() != name:
        raise ValueError(
            f"{kind} name must be a non-empty string without '.' or surrounding spaces, got {name!r}"
        )


@dataclass(frozen=True)
class SparseFeature:
    """A pooled categorical feature (a user or candidate-ad attribute).

    Args:
        name: key of the feature in the batch's KeyedJaggedTensor.
        num_embeddings: vocabulary size; ids lie in ``[0, num_embeddings)``.
        max_ids: most ids per sample (multi-hot up to this many; 1 = single-valued).
    """

    name: str
    num_embeddings: int
    max_ids: int = 1

    def __post_init__(self) -> None:
        _check_name("SparseFeature", self.name)
        if self.num_embeddings < 1:
            raise ValueError(
                f"SparseFeature {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}"
            )
        if self.max_ids < 1:
            raise ValueError(f"SparseFeature {self.name!r}: max_ids must be >= 1, got {self.max_ids}")


@dataclass(frozen=True)
class SequenceFeature:
    """One user-behaviour sequence (item ids, action types and timestamps, oldest event first).

    Args:
        name: key of the sequence in ``GemBatch.sequences``.
        num_items: item-id vocabulary size.
        num_actions: action-type vocabulary size (e.g. click/view/buy, or a rating 1..5).
        max_len: longest history the model accepts; data generators keep the most recent events.
        num_event_features: F, the width of the optional per-event dense side features
            (``JaggedSequence.event_features`` ``[total, F]`` float32; 0 = none). The model adds
            ``Linear(F, E, bias=False)(event_features)`` to each event's item + action embedding. A
            multi-hot row (e.g. the event item's genres) times that weight is exactly a sum-pooled
            embedding bag of the active ids, computed as a small dense matmul that needs no sharding.
    """

    name: str
    num_items: int
    num_actions: int
    max_len: int
    num_event_features: int = 0

    def __post_init__(self) -> None:
        _check_name("SequenceFeature", self.name)
        for field in ("num_items", "num_actions", "max_len"):
            if getattr(self, field) < 1:
                raise ValueError(
                    f"SequenceFeature {self.name!r}: {field} must be >= 1, got {getattr(self, field)}"
                )
        if not isinstance(self.num_event_features, int) or self.num_event_features < 0:
            raise ValueError(
                f"SequenceFeature {self.name!r}: num_event_features must be an int >= 0, "
                f"got {self.num_event_features!r}"
            )


@dataclass(frozen=True)
class FeatureSpec:
    """All input features of a model and its prediction tasks.

    Args:
        n_dense: number of dense (float) features per sample.
        sparse: pooled categorical features, in KJT key order.
        sequences: behaviour sequences (at least one).
        tasks: binary prediction tasks, in the column order of ``GemBatch.labels``.
    """

    n_dense: int
    sparse: tuple[SparseFeature, ...]
    sequences: tuple[SequenceFeature, ...]
    tasks: tuple[str, ...] = ("ctr", "cvr")

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the spec stays hashable.
        object.__setattr__(self, "sparse", tuple(self.sparse))
        object.__setattr__(self, "sequences", tuple(self.sequences))
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if self.n_dense < 0:
            raise ValueError(f"FeatureSpec: n_dense must be >= 0, got {self.n_dense}")
        if not self.sequences:
            raise ValueError("FeatureSpec: at least one SequenceFeature is required")
        if not self.tasks:
            raise ValueError("FeatureSpec: at least one task is required")
        for kind, names in (
            ("sparse feature", [f.name for f in self.sparse]),
            ("sequence", [s.name for s in self.sequences]),
            ("task", list(self.tasks)),
        ):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"FeatureSpec: duplicate {kind} names {dup}")
        for f in self.sparse:
            if not isinstance(f, SparseFeature):
                raise TypeError(f"FeatureSpec.sparse must hold SparseFeature, got {type(f).__name__}")
        for s in self.sequences:
            if not isinstance(s, SequenceFeature):
                raise TypeError(f"FeatureSpec.sequences must hold SequenceFeature, got {type(s).__name__}")

    @property
    def sparse_names(self) -> list[str]:
        """KJT keys of the pooled features, in order."""
        return [f.name for f in self.sparse]

    @property
    def sequence_names(self) -> list[str]:
        """Keys of ``GemBatch.sequences``, in order."""
        return [s.name for s in self.sequences]

    @property
    def max_history_len(self) -> int:
        """Longest merged history: the sum of every sequence's ``max_len``."""
        return sum(s.max_len for s in self.sequences)
