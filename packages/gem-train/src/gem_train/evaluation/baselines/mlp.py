"""The baseline of the results table: a plain MLP (or logistic regression) over the same features as GEM.

Every sparse feature is one mean-pooled embedding (``nn.EmbeddingBag``); the history is a mean-pooled item
embedding plus a mean-pooled action embedding (no order, no attention, no time); dense features go in as they
are. The concatenation feeds an MLP with one logit per task (``dropout`` after each hidden layer). With
``hidden = []`` it is a logistic regression over the pooled embeddings and dense features.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor, nn

from gem_model import FeatureSpec, GemBatch
from gem_train.config import BaselineConfig

__all__ = ["BaselineMLP"]


class BaselineMLP(nn.Module):
    """``forward(batch) -> {task: logits [B] float32}``; tables in ``self.embeddings`` (row-wise Adagrad)."""

    def __init__(self, spec: FeatureSpec, cfg: BaselineConfig, device: torch.device | str | None = None):
        super().__init__()
        self.spec = spec
        d = cfg.embedding_dim
        tables = {f.name: nn.EmbeddingBag(f.num_embeddings, d, mode="mean") for f in spec.sparse}
        for s in spec.sequences:
            tables[f"{s.name}__items"] = nn.EmbeddingBag(s.num_items, d, mode="mean")
            tables[f"{s.name}__actions"] = nn.EmbeddingBag(s.num_actions, d, mode="mean")
        self.embeddings = nn.ModuleDict(tables)
        width = d * len(tables) + spec.n_dense + len(spec.sequences)  # + log history length per sequence
        layers: list[nn.Module] = []
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if cfg.dropout > 0:
                layers.append(nn.Dropout(cfg.dropout))
            width = h
        layers.append(nn.Linear(width, len(spec.tasks)))
        self.mlp = nn.Sequential(*layers)
        self.to(device)
        self.init_weights()

    def init_weights(self) -> None:
        for t in self.embeddings.values():
            nn.init.normal_(cast(nn.Embedding, t).weight, std=0.05)  # a ModuleDict yields Modules
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def sparse_parameters(self) -> Iterator[nn.Parameter]:
        return self.embeddings.parameters()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        return self.mlp.parameters()

    def forward(self, batch: GemBatch) -> dict[str, Tensor]:
        parts = []
        for f in self.spec.sparse:
            jt = batch.sparse[f.name]
            parts.append(self.embeddings[f.name](jt.values(), jt.offsets()[:-1]))
        for s in self.spec.sequences:
            seq = batch.sequences[s.name]
            off = seq.offsets
            # EmbeddingBag wants B offsets (starts), the last bag ending at the end of the input.
            parts.append(self.embeddings[f"{s.name}__items"](seq.item_ids, off[:-1]))
            parts.append(self.embeddings[f"{s.name}__actions"](seq.action_ids, off[:-1]))
            parts.append(torch.log1p(seq.lengths.float())[:, None] / 5.0)
        parts.append(batch.dense)
        logits = self.mlp(torch.cat(parts, dim=1)).float()
        return {t: logits[:, j] for j, t in enumerate(self.spec.tasks)}
