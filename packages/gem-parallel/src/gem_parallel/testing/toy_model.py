"""A small model with every structure gem-parallel acts on, to test a parallel set-up on any model.

gem-parallel's own tests and benchmarks run on it (never on gem-model), and a user can check a mesh, a
``ParallelConfig`` or a sharding plan with it before bringing their own model (as TorchRec's test models
serve its tests). What :func:`gem_parallel.parallelize` needs of a model, and this one has:

- ``layers``: an ``nn.ModuleDict`` of blocks, the units of FSDP2, activation checkpointing and per-layer
  compile. Each :class:`ToyBlock` mixes a dense token tensor ``x [B, n_tokens, d]`` with a jagged sequence
  ``s [total, d]`` (one row per event of every sample's history; dynamic ``total``).
- expert ensembles: each block's ``mixer`` is a :class:`ToyEnsemble`, a gated ensemble in which every sample
  goes through every expert, with the public structure :mod:`gem_parallel.expert` recognises (an
  ``experts`` ModuleList, ``gate_weights(x)`` and ``expert_sum(x, weights, experts)``).
- ``embeddings``: a :class:`ToyEmbeddings` holding a TorchRec ``EmbeddingBagCollection`` (pooled id features)
  and ``EmbeddingCollection`` (sequence features: the jagged ones), what :mod:`gem_parallel.sparse` shards.
- ``sparse_parameters()`` / ``dense_parameters()``: the tables, and everything else.

Shapes are tiny by default (a step costs milliseconds on a CPU); every width is a :class:`ToyConfig` field.

Example::

    config = ToyConfig()
    model = ToyModel(config, seed=0)
    batch = toy_batch(config, batch_size=8, seed=1)          # ragged: empty and length-1 sequences too
    loss = toy_loss(model(batch), batch)                     # logits [B] fp32, mean BCE
    model = parallelize(model, dims, mesh, ParallelConfig(expert_parallel=True))
"""

from __future__ import annotations

# First: the torchrec/fbgemm stack check (a clear error on a mismatched stack), then torchrec.
import gem_parallel._stack  # noqa: F401

# isort: split

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "ToyBatch",
    "ToyBlock",
    "ToyConfig",
    "ToyEmbeddings",
    "ToyEnsemble",
    "ToyModel",
    "select_samples",
    "toy_batch",
    "toy_loss",
]


@dataclass(frozen=True)
class ToyConfig:
    """The toy model's shapes.

    Args:
        n_dense: dense (float) features per sample.
        bag_features: pooled id features as ``(name, table rows)``; table ``t_<name>``, sum pooling.
        sequence_features: jagged id features as ``(name, table rows)``; table ``t_<name>``. The first one
            is the sequence the blocks run over; the others are mean-pooled into tokens.
        max_ids: ids per sample of a pooled feature, drawn in ``0..max_ids`` by :func:`toy_batch`.
        max_len: events per sample of a sequence feature, drawn in ``0..max_len``.
        embedding_dim: width of every table.
        d_model: width of the tokens and of the sequence.
        n_layers: blocks in ``layers``.
        n_experts: experts per ensemble (one block, one ensemble); 1 leaves out the gate.
        expert_hidden / ffn_hidden: hidden widths of an expert MLP and of the sequence SwiGLU.
    """

    n_dense: int = 4
    bag_features: tuple[tuple[str, int], ...] = (("user", 50), ("ad", 40))
    sequence_features: tuple[tuple[str, int], ...] = (("history", 60),)
    max_ids: int = 2
    max_len: int = 12
    embedding_dim: int = 16
    d_model: int = 32
    n_layers: int = 2
    n_experts: int = 2
    expert_hidden: int = 64
    ffn_hidden: int = 64

    def __post_init__(self) -> None:
        if not self.sequence_features:
            raise ValueError("ToyConfig: needs at least one sequence feature (the blocks run over it)")
        names = [n for n, _ in self.bag_features + self.sequence_features]
        if len(set(names)) != len(names):
            raise ValueError(f"ToyConfig: feature names must be distinct, got {names}")
        for field in ("n_dense", "embedding_dim", "d_model", "n_layers", "n_experts", "expert_hidden"):
            if getattr(self, field) < 1:
                raise ValueError(f"ToyConfig.{field} must be >= 1, got {getattr(self, field)}")

    @property
    def n_tokens(self) -> int:
        """Tokens of ``x``: one dense token, one per pooled feature, one per extra sequence feature."""
        return 1 + len(self.bag_features) + (len(self.sequence_features) - 1)


@dataclass
class ToyBatch:
    """One batch of ``B`` samples.

    Attributes:
        dense: ``[B, n_dense]`` float32.
        bags: KJT of the pooled features (keys in ``config.bag_features`` order, stride ``B``).
        sequences: KJT of the sequence features (keys in ``config.sequence_features`` order, stride ``B``).
        labels: ``[B]`` float32, 0 or 1.
    """

    dense: Tensor
    bags: KeyedJaggedTensor
    sequences: KeyedJaggedTensor
    labels: Tensor

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])

    def select(self, indices: Iterable[int]) -> ToyBatch:
        """The samples ``indices`` (in that order) as a batch, e.g. one rank's slice of a global batch."""
        idx = list(indices)
        rows = torch.tensor(idx, dtype=torch.long, device=self.dense.device)
        return ToyBatch(
            self.dense[rows], select_samples(self.bags, idx), select_samples(self.sequences, idx),
            self.labels[rows],
        )  # fmt: skip

    def to(self, device: torch.device | str) -> ToyBatch:
        dev = torch.device(device)
        return ToyBatch(self.dense.to(dev), self.bags.to(dev), self.sequences.to(dev), self.labels.to(dev))


def select_samples(kjt: KeyedJaggedTensor, indices: list[int]) -> KeyedJaggedTensor:
    """The samples ``indices`` of every key of ``kjt`` (stride ``len(indices)``)."""
    values, lengths = [], []
    for key in kjt.keys():  # noqa: SIM118 (a KeyedJaggedTensor, not a dict)
        jt = kjt[key]
        offsets = jt.offsets().tolist()
        values += [jt.values()[offsets[i] : offsets[i + 1]] for i in indices]
        lengths.append(jt.lengths()[indices])
    return KeyedJaggedTensor(
        keys=kjt.keys(), values=torch.cat(values) if values else kjt.values()[:0], lengths=torch.cat(lengths)
    )


def _random_kjt(
    features: tuple[tuple[str, int], ...], batch_size: int, max_len: int, g: torch.Generator
) -> KeyedJaggedTensor:
    """Random ids with lengths in ``0..max_len``; the first sample of the first key is empty and the last
    sample of the last key has one id (ragged edge cases in every batch of 2 or more)."""
    lengths = torch.randint(0, max_len + 1, (len(features), batch_size), generator=g)
    if batch_size > 1:
        lengths[0, 0] = 0
        lengths[-1, -1] = 1
    values = torch.cat(
        [
            torch.randint(0, rows, (int(lengths[i].sum()),), generator=g)
            for i, (_, rows) in enumerate(features)
        ]
    )
    return KeyedJaggedTensor(keys=[n for n, _ in features], values=values, lengths=lengths.reshape(-1))


def toy_batch(config: ToyConfig, batch_size: int, seed: int = 0) -> ToyBatch:
    """A random batch, a function of ``seed``: dense N(0, 1) features, ragged ids, balanced labels."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch_size, config.n_dense, generator=g)
    bags = _random_kjt(config.bag_features, batch_size, config.max_ids, g)
    sequences = _random_kjt(config.sequence_features, batch_size, config.max_len, g)
    labels = torch.randint(0, 2, (batch_size,), generator=g).float()
    return ToyBatch(dense, bags, sequences, labels)


def toy_loss(logits: Tensor, batch: ToyBatch) -> Tensor:
    """Mean binary cross-entropy of ``logits [B]`` against ``batch.labels`` (fp32)."""
    return F.binary_cross_entropy_with_logits(logits.float(), batch.labels)


class ToyEmbeddings(nn.Module):
    """The tables: ``bags`` (EmbeddingBagCollection, sum-pooled) and ``sequences`` (EmbeddingCollection)."""

    def __init__(
        self,
        bag_features: tuple[tuple[str, int], ...],
        sequence_features: tuple[tuple[str, int], ...],
        dim: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.bag_names = [n for n, _ in bag_features]
        self.sequence_names = [n for n, _ in sequence_features]
        dev = torch.device(device) if device is not None else None
        self.bags = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=r, feature_names=[n],
                                       pooling=PoolingType.SUM) for n, r in bag_features],
            device=dev,
        )  # fmt: skip
        self.sequences = EmbeddingCollection(
            tables=[EmbeddingConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=r, feature_names=[n])
                    for n, r in sequence_features],
            device=dev,
        )  # fmt: skip

    def forward(
        self, bags: KeyedJaggedTensor, sequences: KeyedJaggedTensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Pooled ``[B, n_bags, dim]`` (by feature name: a sharded collection orders its keys by shard) and,
        per sequence feature, its rows ``[total, dim]``."""
        by_name = self.bags(bags).to_dict()
        pooled = torch.stack([by_name[n] for n in self.bag_names], dim=1)
        jts = self.sequences(sequences)
        return pooled, {n: jts[n].values() for n in self.sequence_names}


class ToyExpert(nn.Module):
    """An MLP over the tokens, ``[B, n, d] -> [B, n, d]``, with a learned mix of the tokens."""

    def __init__(self, n_tokens: int, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.token_mix = nn.Parameter(torch.eye(n_tokens) + 0.1 * torch.randn(n_tokens, n_tokens))

    def forward(self, x: Tensor) -> Tensor:
        return torch.einsum("mn,bnd->bmd", self.token_mix, self.down(F.silu(self.up(x))))


class ToyEnsemble(nn.Module):
    """A gated ensemble, ``[B, n, d] -> [B, n, d]``: ``sum_e softmax(gate(mean token))[:, e] * expert_e(x)``.

    The public structure :mod:`gem_parallel.expert` shards over the ``ep`` axis: ``experts`` (ModuleList),
    :meth:`gate_weights` and :meth:`expert_sum`. One expert: no gate, ``forward`` is that expert.
    """

    def __init__(self, n_experts: int, n_tokens: int, d: int, hidden: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([ToyExpert(n_tokens, d, hidden) for _ in range(n_experts)])
        self.gate = nn.Linear(d, n_experts) if n_experts > 1 else None

    def gate_weights(self, x: Tensor) -> Tensor | None:
        """``[B, n, d] -> [B, n_experts]`` float32 (softmax over experts); None with one expert."""
        if self.gate is None:
            return None
        return torch.softmax(self.gate(x.mean(dim=1)).float(), dim=-1)

    def expert_sum(
        self, x: Tensor, weights: Tensor, experts: Iterable[tuple[int, nn.Module]] | None = None
    ) -> Tensor:
        """``sum_e weights[:, e] * expert_e(x)`` over ``(e, expert)`` pairs (default: all, in order); ``e`` is
        the index in the whole ensemble, so a subset gives a partial sum."""
        out: Tensor | None = None
        for e, expert in enumerate(self.experts) if experts is None else experts:
            y = expert(x) * weights[:, e, None, None].to(x.dtype)
            out = y if out is None else out + y
        if out is None:
            raise ValueError("ToyEnsemble.expert_sum: no experts to sum")
        return out

    def forward(self, x: Tensor) -> Tensor:
        weights = self.gate_weights(x)
        if weights is None:
            out: Tensor = self.experts[0](x)
            return out
        return self.expert_sum(x, weights)


class SwiGLU(nn.Module):
    """``w2(silu(a) * b)`` with ``[a, b] = w13(x)``: ``[..., d] -> [..., d]``."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(d, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


def segment_mean(s: Tensor, segments: Tensor, lengths: Tensor) -> Tensor:
    """Per-sample mean of jagged rows: ``s [total, d]``, ``segments [total]`` (each row's sample),
    ``lengths [B]`` -> ``[B, d]`` (zeros for an empty sample)."""
    sums = s.new_zeros(lengths.shape[0], s.shape[1]).index_add(0, segments, s)
    return sums / lengths.clamp(min=1).to(s.dtype)[:, None]


class ToyBlock(nn.Module):
    """One layer: the expert ensemble over the tokens (which also read the sequence's per-sample mean), and a
    SwiGLU over the jagged sequence (which also reads the tokens' per-sample mean)."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        d = config.d_model
        self.x_norm = nn.LayerNorm(d)
        self.mixer = ToyEnsemble(config.n_experts, config.n_tokens, d, config.expert_hidden)
        self.s_norm = nn.LayerNorm(d)
        self.ffn = SwiGLU(d, config.ffn_hidden)

    def forward(self, x: Tensor, s: Tensor, segments: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """``x [B, n, d]``, ``s [total, d]``, ``segments [total]``, ``lengths [B]`` -> new ``x``, ``s``."""
        x = x + self.mixer(self.x_norm(x + segment_mean(s, segments, lengths)[:, None, :]))
        s = s + self.ffn(self.s_norm(s)) + x.mean(dim=1)[segments]
        return x, s


class ToyModel(nn.Module):
    """Dense features, pooled and jagged embeddings, ``n_layers`` :class:`ToyBlock` s, a logit per sample.

    Submodules: ``embeddings``, ``dense_in`` / ``bag_in`` / ``seq_in`` (input projections), ``layers``
    (ModuleDict ``"0".."L-1"``), ``head_norm``, ``head``. ``forward(batch) -> logits [B]`` float32.
    Parameters are drawn from ``seed`` (the tables from N(0, 1/dim)): equal seeds, equal models.
    """

    def __init__(self, config: ToyConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        config = config or ToyConfig()
        self.config = config
        d = config.d_model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embeddings = ToyEmbeddings(
                config.bag_features, config.sequence_features, config.embedding_dim
            )
            for p in self.embeddings.parameters():
                nn.init.normal_(p, std=config.embedding_dim**-0.5)
            self.dense_in = nn.Linear(config.n_dense, d)
            self.bag_in = nn.Linear(config.embedding_dim, d)
            self.seq_in = nn.Linear(config.embedding_dim, d)
            self.layers = nn.ModuleDict({str(i): ToyBlock(config) for i in range(config.n_layers)})
            self.head_norm = nn.LayerNorm(d)
            self.head = nn.Linear((config.n_tokens + 1) * d, 1)

    def sparse_parameters(self) -> Iterator[nn.Parameter]:
        """The embedding tables."""
        return self.embeddings.parameters()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter outside the embedding tables."""
        sparse = {id(p) for p in self.embeddings.parameters()}
        return (p for p in self.parameters() if id(p) not in sparse)

    def forward(self, batch: ToyBatch) -> Tensor:
        pooled, rows = self.embeddings(batch.bags, batch.sequences)
        first, *others = self.config.sequence_features
        lengths = batch.sequences[first[0]].lengths()
        segments = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths)
        s = self.seq_in(rows[first[0]])  # the jagged sequence [total, d]
        tokens = [self.dense_in(batch.dense)[:, None], self.bag_in(pooled)]
        for name, _ in others:
            other = batch.sequences[name].lengths()
            seg = torch.repeat_interleave(torch.arange(other.shape[0], device=other.device), other)
            tokens.append(self.seq_in(segment_mean(rows[name], seg, other))[:, None])
        x = torch.cat(tokens, dim=1)  # [B, n_tokens, d]
        for layer in self.layers.values():
            x, s = layer(x, s, segments, lengths)
        z = torch.cat([x, segment_mean(s, segments, lengths)[:, None]], dim=1)
        return self.head(self.head_norm(z).flatten(1)).squeeze(-1).float()
