"""Candidate x history-aggregate crosses: what the user did on earlier events like the candidate, as numbers.

A practitioner's GBDT gets "the user's like rate on the candidate's category, and how many events it rests
on" as a feature; GEM otherwise has to learn that aggregate through embeddings and attention in one pass.
:func:`history_cross_stats` computes it directly, for every example of a jagged batch at once, from the first
sequence's history (strictly earlier events by the data's contract) and the candidate's ids:

- groups: the whole history (the user's overall rate), the events of the candidate's very item
  (``GemConfig.cross_item_feature``), and, with ``GemConfig.cross_attribute_feature``, the events whose
  per-event side features (``JaggedSequence.event_features``, ``[total, F]``) share the candidate's attribute
  ids (a multi-hot sparse feature of ``F`` ids; an event counts once per shared id, as the GBDT's feature);
- per group ``g`` with event weights ``w`` (1 for the whole history, the match for the others): the count
  ``n_g = sum w`` (as ``log1p``), the smoothed like rate ``(sum w * like + m p) / (n_g + m)`` and the smoothed
  mean action level ``(sum w * level + m q) / (n_g + m)``, ``m = CROSS_SMOOTHING``. An event is a like when
  its action id is ``>= GemConfig.cross_like_action`` (MovieLens: a rating >= 4, the label's rule; the
  synthetic data: a click or deeper); its level is ``action / (num_actions - 1)`` (MovieLens: the rating /
  5). The whole history shrinks towards ``p = q = 0.5``, every match group towards the user's own rates.

With ``GemConfig.cross_recency_events = r > 0`` every group is counted a second time with each event weighted
by ``exp(-k / r)``, ``k`` its rank from the end of its history (the newest event 0): the same three statistics
of what the user did lately (a practitioner's exponentially decayed counts), and for each match group, in both
weightings, its share of the history ``n_g / n_all`` (0 for an empty history): "how much of what this user
did (lately) was like the candidate", which a product of the log-counts does not give the interaction layers.

The inputs are the history's action ids, item ids and side features and the candidate's ids only: never a
label of the batch, nothing of another example. The statistics are constants of the data (no gradient);
:class:`HistoryCrosses` projects them to one more non-sequence token (``Linear(3 G, d)``), so the
interaction layers' factorization machine crosses them with the candidate's, the user's and the other tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gem_model.batch import GemBatch
from gem_model.config import GemConfig
from gem_model.layers import init_linear

__all__ = ["CROSS_SMOOTHING", "HistoryCrosses", "history_cross_stats", "n_cross_stats"]

CROSS_SMOOTHING = 2.0  # m: pseudo-events of the prior in every smoothed rate
_COUNT_SCALE = 1.0 / 4.0  # log1p(count) / 4: ~1 for ~50 events, the same order as the centred rates


def n_cross_stats(config: GemConfig) -> int:
    """Width of :func:`history_cross_stats`' output for ``config`` (3 per group, and with recency 3 more per
    group and 2 shares per match group; 0 when off)."""
    if config.cross_item_feature is None:
        return 0
    groups = 2 + int(config.cross_attribute_feature is not None)
    return 3 * groups + (3 * groups + 2 * (groups - 1) if config.cross_recency_events > 0 else 0)


def history_cross_stats(
    item_ids: Tensor,
    action_ids: Tensor,
    offsets: Tensor,
    candidate_items: Tensor,
    *,
    like_action: int,
    num_actions: int,
    event_features: Tensor | None = None,
    candidate_attributes: Tensor | None = None,
    recency_events: float = 0.0,
) -> Tensor:
    """``[B, 3 G]`` float32 statistics (see the module docstring), groups in the order whole history,
    item, attribute; per group ``(log1p(n) / 4, like rate - 0.5, level - 0.5)``. With ``recency_events``
    ``> 0``: ``[B, 3 G + 3 G + 2 (G - 1)]``, the decayed groups' statistics after the plain ones, then the
    match groups' shares, plain then decayed.

    ``item_ids``, ``action_ids`` ``[total]`` int64, ``offsets`` ``[B+1]`` int64, ``candidate_items`` ``[B]``
    int64; ``event_features`` ``[total, F]`` and ``candidate_attributes`` ``[B, F]`` float (a multi-hot row of
    the candidate's attribute ids), both or neither. An empty history gives the priors (counts 0).
    """
    if (event_features is None) != (candidate_attributes is None):
        raise ValueError("history_cross_stats: give event_features and candidate_attributes together")
    b, total = candidate_items.shape[0], item_ids.shape[0]
    lengths = offsets[1:] - offsets[:-1]
    owner = torch.repeat_interleave(torch.arange(b, device=offsets.device), lengths, output_size=total)
    like = (action_ids >= like_action).to(torch.float32)
    level = action_ids.to(torch.float32) / max(num_actions - 1, 1)
    weights = [torch.ones_like(like), (item_ids == candidate_items[owner]).to(torch.float32)]
    if event_features is not None and candidate_attributes is not None:
        shared = (event_features.to(torch.float32) * candidate_attributes.to(torch.float32)[owner]).sum(-1)
        weights.append(shared)
    w = torch.stack(weights, dim=1)  # [total, G]
    groups = w.shape[1]
    if recency_events > 0:
        # Rank from the end of the event's own history: the newest event 0.
        rank = (offsets[1:][owner] - 1 - torch.arange(total, device=offsets.device)).to(torch.float32)
        w = torch.cat([w, w * torch.exp(-rank / recency_events)[:, None]], dim=1)  # [total, 2 G]
    per_event = torch.cat([w, w * like[:, None], w * level[:, None]], dim=1)  # [total, 3 G']
    sums = per_event.new_zeros(b, per_event.shape[1]).index_add(0, owner, per_event)
    n, likes, levels = sums.chunk(3, dim=1)  # each [B, G']
    parts = [_group_stats(n[:, g : g + groups], likes[:, g : g + groups], levels[:, g : g + groups])
             for g in range(0, n.shape[1], groups)]  # fmt: skip
    if recency_events > 0:
        for g in range(0, n.shape[1], groups):  # each match group's share of the history, plain then decayed
            # An empty history has n_g = 0 too, so its shares are 0.
            parts.append(n[:, g + 1 : g + groups] / n[:, g : g + 1].clamp_min(1e-12))
    return torch.cat(parts, dim=1)


def _group_stats(n: Tensor, likes: Tensor, levels: Tensor) -> Tensor:
    """``[B, 3 G]`` group-major ``(log1p(n) / 4, rate - 0.5, level - 0.5)`` from per-group sums ``[B, G]``
    whose first column is the whole history (the match groups shrink towards its rates)."""
    m = CROSS_SMOOTHING
    rate_all = (likes[:, :1] + m * 0.5) / (n[:, :1] + m)
    level_all = (levels[:, :1] + m * 0.5) / (n[:, :1] + m)
    rate = torch.cat([rate_all, (likes[:, 1:] + m * rate_all) / (n[:, 1:] + m)], dim=1)
    mean_level = torch.cat([level_all, (levels[:, 1:] + m * level_all) / (n[:, 1:] + m)], dim=1)
    stats = torch.stack([torch.log1p(n) * _COUNT_SCALE, rate - 0.5, mean_level - 0.5], dim=2)
    return stats.flatten(1)  # [B, G * 3]: group-major


def _candidate_ids(batch: GemBatch, name: str) -> Tensor:
    ids = batch.sparse[name].values()
    if ids.shape[0] != batch.batch_size:
        raise ValueError(f"GemModel: the cross item feature {name!r} must hold exactly one id per example")
    return ids


def _multi_hot(batch: GemBatch, name: str, width: int) -> Tensor:
    """``[B, width]`` float32 presence rows of sparse feature ``name`` (a repeated id counts once)."""
    jt = batch.sparse[name]
    ids, lengths = jt.values(), jt.lengths()
    rows = torch.repeat_interleave(
        torch.arange(batch.batch_size, device=ids.device), lengths, output_size=ids.shape[0]
    )
    hot = torch.zeros(batch.batch_size, width, dtype=torch.float32, device=ids.device)
    return hot.index_put((rows, ids), torch.ones_like(ids, dtype=torch.float32))


class HistoryCrosses(nn.Module):
    """:func:`history_cross_stats` of a batch, projected to one token ``[B, 1, d]`` (``Linear(3 G, d)``).

    Built only when ``config.cross_item_feature`` is set (so models without it keep their state dict).
    """

    def __init__(self, config: GemConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        if config.cross_item_feature is None:
            raise ValueError("HistoryCrosses needs GemConfig.cross_item_feature")
        self.item_feature = config.cross_item_feature
        self.attribute_feature = config.cross_attribute_feature
        seq = config.features.sequences[0]
        self.sequence, self.num_actions = seq.name, seq.num_actions
        self.num_event_features = seq.num_event_features
        self.like_action = config.cross_like_action
        self.recency_events = float(config.cross_recency_events)
        self.proj = nn.Linear(n_cross_stats(config), config.d_model, device=device)

    def reset_parameters(self) -> None:
        # Statistics of order 1: the default fan-in init makes a token of the other tokens' scale.
        init_linear(self.proj, std=1.0 / math.sqrt(self.proj.in_features))

    def stats(self, batch: GemBatch) -> Tensor:
        """``[B, n_cross_stats(config)]`` float32: the batch's statistics (no gradient: data only)."""
        seq = batch.sequences[self.sequence]
        attributes = None
        if self.attribute_feature is not None:
            if seq.event_features is None:
                raise ValueError(
                    f"sequence {self.sequence!r}: the cross attribute feature needs its event features"
                )
            attributes = _multi_hot(batch, self.attribute_feature, self.num_event_features)
        return history_cross_stats(
            seq.item_ids, seq.action_ids, seq.offsets, _candidate_ids(batch, self.item_feature),
            like_action=self.like_action, num_actions=self.num_actions,
            event_features=seq.event_features if attributes is not None else None,
            candidate_attributes=attributes, recency_events=self.recency_events,
        )  # fmt: skip

    def forward(self, batch: GemBatch) -> Tensor:
        stats = self.stats(batch).to(self.proj.weight.dtype)
        return self.proj(stats)[:, None, :]
