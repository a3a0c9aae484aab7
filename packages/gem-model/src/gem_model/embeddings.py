"""Embedding tables as TorchRec collections, so gem-parallel can shard them.

- ``bags``: an EmbeddingBagCollection with one sum-pooled table per sparse feature (table ``t_<name>``,
  feature ``<name>``), fed the batch's KeyedJaggedTensor as it is.
- ``sequences``: an EmbeddingCollection with an item table and an action table per sequence (tables
  ``t_<seq>_item`` / ``t_<seq>_action``, features ``<seq>.item`` / ``<seq>.action``). With
  ``GemConfig.target_item_feature`` the first sequence's item table also serves the feature
  ``<seq>.candidate``: the candidate's item id, looked up in the same rows as the history's items (one table,
  two features: the table and its parameter names do not change).

Unsharded, both are plain PyTorch modules; gem-parallel swaps them for sharded ones without the model
noticing, because the model only calls them with KeyedJaggedTensors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model.batch import GemBatch
from gem_model.config import GemConfig

__all__ = ["GemEmbeddings", "candidate_feature_name", "sequence_feature_names"]


def sequence_feature_names(name: str) -> tuple[str, str]:
    """KJT keys of a sequence's item and action ids in the EmbeddingCollection."""
    return f"{name}.item", f"{name}.action"


def candidate_feature_name(name: str) -> str:
    """KJT key of the candidate's item id, looked up in sequence ``name``'s item table."""
    return f"{name}.candidate"


class GemEmbeddings(nn.Module):
    """All embedding tables of a :class:`GemModel` (the model's sparse parameters).

    Forward returns pooled attribute embeddings ``[B, n_sparse, E]`` (None without sparse features); per
    sequence, item and action embeddings ``[total, E]`` each (E = ``config.embedding_dim``; the collections
    return float32); and the candidate's item embedding ``[B, E]`` from the first sequence's item table
    (``GemConfig.target_item_feature``; None when off).
    """

    def __init__(self, config: GemConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        spec, dim = config.features, config.embedding_dim
        device = torch.device(device) if device is not None else None
        self.embedding_dim = dim
        self.sparse_names = spec.sparse_names
        self.bags = (
            EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=f"t_{f.name}",
                        embedding_dim=dim,
                        num_embeddings=f.num_embeddings,
                        feature_names=[f.name],
                        pooling=PoolingType.SUM,
                    )
                    for f in spec.sparse
                ],
                device=device,
            )
            if spec.sparse
            else None
        )
        # The candidate's item id (a sparse feature) is looked up in the first sequence's item table too.
        self.target_item_feature = config.target_item_feature
        self.candidate_key = (
            candidate_feature_name(spec.sequences[0].name) if config.target_item_feature else None
        )
        tables = []
        for i, s in enumerate(spec.sequences):
            item, action = sequence_feature_names(s.name)
            item_features = [item] if i or self.candidate_key is None else [item, self.candidate_key]
            for table, rows, features in (
                (f"t_{s.name}_item", s.num_items, item_features),
                (f"t_{s.name}_action", s.num_actions, [action]),
            ):
                tables.append(
                    EmbeddingConfig(
                        name=table, embedding_dim=dim, num_embeddings=rows, feature_names=features
                    )
                )
        self.sequences = EmbeddingCollection(tables=tables, device=device)
        self.sequence_names = spec.sequence_names

    def reset_parameters(self) -> None:
        # Rows of norm ~1 whatever the vocabulary size (TorchRec's default, U(+-1/sqrt(N)), shrinks rows
        # of large tables towards 0).
        std = 1.0 / math.sqrt(self.embedding_dim)
        for p in self.parameters():
            nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)

    def sequence_kjt(self, batch: GemBatch) -> KeyedJaggedTensor:
        """The item and action ids of every sequence as one KJT (keys ``<seq>.item``, ``<seq>.action``;
        then ``<first seq>.candidate``, one id per example, with ``target_item_feature``).

        Its ``length_per_key`` / ``offset_per_key`` come from the id tensors' shapes (host ints), so the
        EmbeddingCollection's ``to_dict`` reads no device lengths (no sync, no graph break when compiled).
        """
        keys, values, lengths, per_key = [], [], [], []
        for name in self.sequence_names:
            seq = batch.sequences[name]
            keys += list(sequence_feature_names(name))
            values += [seq.item_ids, seq.action_ids]
            lengths += [seq.lengths, seq.lengths]
            per_key += [seq.total, seq.total]
        if self.candidate_key is not None and self.target_item_feature is not None:
            # One id per example (GemConfig checks the feature's max_ids; GemBatch.validate the lengths).
            ids = batch.sparse[self.target_item_feature].values()
            b = batch.batch_size
            keys.append(self.candidate_key)
            values.append(ids)
            lengths.append(torch.ones(b, dtype=ids.dtype, device=ids.device))
            per_key.append(b)
        offset_per_key = [0]
        for n in per_key:
            offset_per_key.append(offset_per_key[-1] + n)
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat(values),
            lengths=torch.cat(lengths),
            stride=batch.batch_size,
            length_per_key=per_key,
            offset_per_key=offset_per_key,
        )

    def forward(
        self, batch: GemBatch
    ) -> tuple[Tensor | None, dict[str, tuple[Tensor, Tensor]], Tensor | None]:
        pooled = None
        if self.bags is not None:
            kt = self.bags(batch.sparse)
            if list(kt.keys()) == list(self.sparse_names):
                pooled = kt.values().view(batch.batch_size, len(self.sparse_names), self.embedding_dim)
            else:  # a sharded collection (TorchRec) orders its output keys by shard: reorder by name
                by_name = kt.to_dict()
                pooled = torch.stack([by_name[n] for n in self.sparse_names], dim=1)
        jts = self.sequences(self.sequence_kjt(batch))
        per_seq = {}
        for name in self.sequence_names:
            item, action = sequence_feature_names(name)
            per_seq[name] = (jts[item].values(), jts[action].values())
        candidate = jts[self.candidate_key].values() if self.candidate_key is not None else None
        return pooled, per_seq, candidate
