"""The GEM model: embeddings, a stack of interleaved interaction/sequence layers, multi-task heads.

Layer ``l`` (InterFormer / Kunlun style; both halves read the layer's input, so they may run in parallel):

- interaction half: ``X_sum = Gating(TokenMix(X))``; ``S_sum = Gating([PMA(S) || recent_k(S)])``;
  ``X' = WukongEnsemble([X || S_sum])`` (low-rank FM block + linear compression block, residual, LN).
- sequence half: ``S += GDPA(S -> [X_sum || S_sum])`` (context cross-attention, InterFormer's PFFN);
  ``S += SelfAttention(S)`` (full / window / block, rotary temporal positions, QK-norm);
  ``S += SwiGLU(S)``. Pre-RMSNorm residual blocks.

Heads read ``[X_sum || S_sum]`` of the final ``X`` and ``S``. Several sequences are merged per user by
concatenation (InterFormer merges sequences too); every event keeps its own temporal position.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import gem_kernels
from gem_model.attention import ContextCrossAttention, PoolingAttention, SequenceSelfAttention
from gem_model.batch import GemBatch
from gem_model.config import GemConfig
from gem_model.crosses import HistoryCrosses
from gem_model.embeddings import GemEmbeddings
from gem_model.interaction import NonSequenceSummary, SequenceSummary, WukongEnsemble, WukongLayer
from gem_model.layers import RMSNorm, SwiGLU, init_linear, init_unless_meta
from gem_model.rowwise import rowwise
from gem_model.target import TargetAttention, first_of_timestamp, history_action_loss

__all__ = ["AUX_LOSS_PREFIX", "N_TIME_FEATURES", "GemLayer", "GemModel", "multitask_loss"]

# Output keys of auxiliary losses (already weighted scalars, training only): multitask_loss adds them.
AUX_LOSS_PREFIX = "aux/"

N_TIME_FEATURES = 16  # sin/cos of the log time gap at 8 frequencies


def _dropout(p: float) -> nn.Module:
    # Identity at p = 0: no RNG draws and no extra op, so a model without dropout computes what it did
    # before the knob existed.
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _pma(config: GemConfig, device: torch.device | str | None) -> PoolingAttention:
    return PoolingAttention(
        config.d_model, config.n_heads, config.head_dim, config.n_pma_tokens, kind=config.pma_kind,
        activation=config.gdpa_activation, max_history_len=config.features.max_history_len,
        qk_norm=config.qk_norm, norm_eps=config.norm_eps, device=device,
    )  # fmt: skip


def _summaries(
    config: GemConfig, device: torch.device | str | None
) -> tuple[NonSequenceSummary, SequenceSummary]:
    x_summary = NonSequenceSummary(config.n_tokens, config.n_sum_tokens, config.d_model, device=device)
    s_summary = SequenceSummary(
        _pma(config, device), config.n_recent, config.d_model, config.norm_eps, device
    )
    return x_summary, s_summary


class InputEncoder(nn.Module):
    """Turns embeddings and raw features into the first non-sequence tokens and the merged history.

    Returns ``x`` ``[B, n_tokens, d]``, history ``s`` ``[total, d]``, its ``offsets`` ``[B+1]``, host
    ``max_len``, and rotary ``positions`` ``[total]`` float32.
    """

    time_freqs: Tensor  # a buffer [N_TIME_FEATURES // 2] float32

    def __init__(self, config: GemConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        d, e = config.d_model, config.embedding_dim
        self.config = config
        n_dense = config.features.n_dense
        self.dense = (
            nn.Linear(n_dense, config.n_dense_tokens * d, device=device) if config.n_dense_tokens else None
        )
        self.sparse_proj = nn.Linear(e, d, bias=False, device=device) if e != d else None
        self.seq_proj = nn.Linear(e, d, bias=False, device=device) if e != d else None
        self.time_proj = nn.Linear(N_TIME_FEATURES, d, device=device)
        # Per-event dense side features [total, F] -> [total, E], added to item + action: for a multi-hot
        # row this is the sum-pooled embedding bag of its active ids (a dense matmul, not a sharded
        # table). Only sequences with F > 0 get one, so specs without event features keep their state
        # dict (and checkpoints) unchanged.
        self.event_proj = nn.ModuleDict(
            {
                s.name: nn.Linear(s.num_event_features, e, bias=False, device=device)
                for s in config.features.sequences
                if s.num_event_features
            }
        )
        # Candidate x history-aggregate crosses (GemConfig.cross_item_feature): one more token, last.
        self.crosses = HistoryCrosses(config, device=device) if config.has_crosses else None
        n_seq = len(config.features.sequences)
        self.seq_type = nn.Parameter(torch.empty(n_seq, d, device=device)) if n_seq > 1 else None
        self.token_norm = nn.LayerNorm(d, eps=config.norm_eps, device=device)
        self.dropout = _dropout(config.embedding_dropout)
        freqs = 2.0 ** torch.arange(N_TIME_FEATURES // 2, dtype=torch.float32) / 8.0
        self.register_buffer(
            "time_freqs", freqs.to(device) if device is not None else freqs, persistent=False
        )
        init_unless_meta(self, self.time_freqs)

    def reset_parameters(self) -> None:
        for linear in (self.dense, self.sparse_proj, self.seq_proj, self.time_proj):
            if linear is not None:
                init_linear(linear)
        for proj in self.event_proj.values():
            # std 1/sqrt(E) per weight, as an embedding row (GemEmbeddings): a genre column then
            # contributes what one id of a sum-pooled bag would.
            init_linear(cast(nn.Linear, proj), std=1.0 / math.sqrt(self.config.embedding_dim))
        if self.crosses is not None:
            self.crosses.reset_parameters()
        if self.seq_type is not None:
            nn.init.trunc_normal_(self.seq_type, std=0.02)
        self.token_norm.reset_parameters()
        freqs = (
            2.0 ** torch.arange(N_TIME_FEATURES // 2, dtype=torch.float32, device=self.time_freqs.device)
            / 8.0
        )
        self.time_freqs.copy_(freqs)

    def tokens(self, batch: GemBatch, pooled: Tensor | None) -> Tensor:
        b, d = batch.batch_size, self.config.d_model
        parts = []
        if self.dense is not None:
            parts.append(self.dense(batch.dense).view(b, self.config.n_dense_tokens, d))
        if pooled is not None:
            parts.append(self.sparse_proj(pooled) if self.sparse_proj is not None else pooled)
        if self.crosses is not None:
            parts.append(self.crosses(batch))
        dtype = parts[0].dtype
        return self.dropout(self.token_norm(torch.cat([p.to(dtype) for p in parts], dim=1)))

    def history(
        self, batch: GemBatch, embedded: dict[str, tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor, int, Tensor]:
        """The merged history of every sequence: ``(tokens [total, d], offsets [B+1], max_len,
        positions [total])``, dropout applied to the tokens."""
        tok, offsets, max_len, pos, _ = self.history_and_first(batch, embedded)
        return tok, offsets, max_len, pos

    def history_and_first(
        self, batch: GemBatch, embedded: dict[str, tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor, int, Tensor, tuple[Tensor, Tensor]]:
        """:meth:`history`, plus the first sequence's own ``(tokens [n, d], positions [n])`` (its offsets and
        max_len are the batch's), dropout applied: the target-aware attention reads that sequence alone."""
        cfg = self.config
        merged: tuple[Tensor, Tensor, Tensor, int] | None = None
        first: tuple[Tensor, Tensor] | None = None
        for i, s in enumerate(cfg.features.sequences):
            seq = batch.sequences[s.name]
            tok, pos = self._sequence_tokens(batch, embedded, i)
            if merged is None:
                merged = (tok, pos, seq.offsets, seq.max_len)
                first = (tok, pos)
                continue
            m_tok, m_pos, m_off, m_len = merged
            dtype = torch.promote_types(m_tok.dtype, tok.dtype)
            c_tok, c_off = gem_kernels.jagged_concat(m_tok.to(dtype), m_off, tok.to(dtype), seq.offsets)
            c_pos, _ = gem_kernels.jagged_concat(m_pos[:, None], m_off, pos[:, None], seq.offsets)
            merged = (c_tok, c_pos[:, 0], c_off, m_len + seq.max_len)
        if merged is None or first is None:
            raise ValueError("GemModel needs at least one sequence feature")
        tok, pos, offsets, max_len = merged
        out = self.dropout(tok)
        if len(cfg.features.sequences) == 1:
            return out, offsets, max_len, pos, (out, pos)
        return out, offsets, max_len, pos, (self.dropout(first[0]), first[1])

    def _sequence_tokens(
        self, batch: GemBatch, embedded: dict[str, tuple[Tensor, Tensor]], i: int
    ) -> tuple[Tensor, Tensor]:
        """Sequence ``i``'s event tokens ``[n, d]`` and temporal rotary positions ``[n]`` float32."""
        cfg = self.config
        s = cfg.features.sequences[i]
        seq = batch.sequences[s.name]
        item, action = embedded[s.name]
        tok = item + action
        if s.num_event_features:
            if seq.event_features is None:
                raise ValueError(
                    f"sequence {s.name!r}: the spec has {s.num_event_features} event features "
                    "but the batch carries none"
                )
            proj = cast(nn.Linear, self.event_proj[s.name])
            tok = tok + proj(seq.event_features.to(proj.weight.dtype)).to(tok.dtype)
        tok = self.seq_proj(tok) if self.seq_proj is not None else tok
        owner = torch.repeat_interleave(
            torch.arange(batch.batch_size, device=seq.offsets.device),
            seq.lengths,
            output_size=seq.item_ids.numel(),
        )
        gap = (batch.request_time[owner] - seq.timestamps).clamp(min=0).to(torch.float32)
        log_gap = torch.log1p(gap / cfg.time_scale_s)  # [total]: 0 for "now", ~13 for a year at 60 s
        angles = log_gap[:, None] * self.time_freqs
        time_tok = self.time_proj(torch.cat([angles.sin(), angles.cos()], dim=-1))
        dtype = torch.promote_types(tok.dtype, time_tok.dtype)
        tok = tok.to(dtype) + time_tok.to(dtype)
        if self.seq_type is not None:
            tok = tok + self.seq_type[i].to(tok.dtype)
        return tok, cfg.rotary_position_scale * log_gap


class GemLayer(nn.Module):
    """One interleaved layer: interaction half over ``X``, sequence half over ``S`` (see module doc)."""

    def __init__(self, config: GemConfig, index: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        d, eps = config.d_model, config.norm_eps
        n_in = config.n_tokens + config.n_seq_summary_tokens
        self.x_summary, self.s_summary = _summaries(config, device)

        def expert() -> WukongLayer:
            return WukongLayer(
                n_in,
                config.n_tokens,
                config.fm_tokens,
                d,
                config.wukong_rank,
                config.wukong_hidden,
                eps,
                device,
            )

        self.mixer = WukongEnsemble(config.n_experts, expert, d, device=device)
        self.cross_norm = RMSNorm(d, eps=eps, device=device)
        self.cross = ContextCrossAttention(
            d, config.n_heads, config.head_dim, config.n_context_tokens, activation=config.gdpa_activation,
            qk_norm=config.qk_norm, norm_eps=eps, device=device,
        )  # fmt: skip
        self.attn_norm = RMSNorm(d, eps=eps, device=device)
        self.attn = SequenceSelfAttention(
            d, config.n_heads, config.head_dim, kind=config.attention_kind(index), window=config.window,
            block_size=config.block_size, causal=config.causal, qk_norm=config.qk_norm,
            rotary_base=config.rotary_base, norm_eps=eps, device=device,
        )  # fmt: skip
        self.ffn_norm = RMSNorm(d, eps=eps, device=device) if config.ffn_hidden else None
        self.ffn = (
            SwiGLU(d, config.ffn_hidden, device=device, fused=config.fused_ffn) if config.ffn_hidden else None
        )
        self.dropout = _dropout(config.dropout)  # on each residual branch's output

    def reset_parameters(self) -> None:
        for m in (self.x_summary, self.s_summary, self.mixer, self.cross, self.attn, self.ffn):
            if m is not None:
                m.reset_parameters()
        for norm in (self.cross_norm, self.attn_norm, self.ffn_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(
        self, x: Tensor, s: Tensor, offsets: Tensor, max_len: int, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """x ``[B, n, d]``, s ``[total, d]`` -> the same shapes."""
        x_sum = self.x_summary(x)
        s_sum = self.s_summary(s, offsets, max_len)
        dtype = torch.promote_types(x.dtype, s_sum.dtype)
        x_next = self.mixer(torch.cat([x.to(dtype), s_sum.to(dtype)], dim=1))
        context = torch.cat([x_sum.to(dtype), s_sum.to(dtype)], dim=1)
        s = s + self.dropout(self.cross(self.cross_norm(s), offsets, max_len, context))
        s = s + self.dropout(self.attn(self.attn_norm(s), offsets, max_len, positions))
        if self.ffn is not None:  # the block is position-wise: chunked in CPU inference (gem_model.rowwise)
            (s,) = rowwise(self._ffn_block, s)
        return x_next, s

    def _ffn_block(self, s: Tensor) -> tuple[Tensor]:
        """``s + FFN(norm(s))`` (dropout on the branch) for rows ``s`` ``[n, d]``."""
        assert self.ffn is not None and self.ffn_norm is not None  # both or neither (config.ffn_hidden)
        return (s + self.dropout(self.ffn(self.ffn_norm(s))),)


class TaskHead(nn.Module):
    """MLP ``[B, in] -> [B]`` logits (fp32) for one task."""

    def __init__(
        self,
        d_in: int,
        hidden: tuple[int, ...],
        eps: float,
        device: torch.device | str | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in, eps=eps, device=device)
        self.dropout = _dropout(dropout)
        dims = (d_in, *hidden)
        self.hidden = nn.ModuleList(nn.Linear(a, b, device=device) for a, b in itertools.pairwise(dims))
        self.out = nn.Linear(dims[-1], 1, device=device)

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        for linear in self.hidden:
            init_linear(cast(nn.Linear, linear))  # a ModuleList yields Modules: these are the Linears above
        # Small output weights: initial predictions near 0.5 whatever the input scale.
        init_linear(self.out, std=0.01)

    def forward(self, z: Tensor) -> Tensor:
        z = self.norm(z)
        for linear in self.hidden:
            z = self.dropout(F.silu(linear(z)))
        # A tensor of its own, never a view of the [B, 1] output (bit-identical values): FSDP2 warns when a
        # wrapped model returns a view, since an in-place op on one would skip its pre-backward hook.
        return self.out(z).squeeze(-1).to(torch.float32, copy=True)


class GemModel(nn.Module):
    """The GEM-style ranking model.

    Submodules: ``embeddings`` (TorchRec collections: the sparse parameters), ``input``, ``layers``
    (a ModuleDict ``"0".."L-1"``), ``final_x`` / ``final_s`` (final summaries) and ``heads`` (one per
    task). Build on ``device="meta"`` to allocate nothing, then ``to_empty(device=...)`` and
    :meth:`init_weights`.
    """

    def __init__(self, config: GemConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.embeddings = GemEmbeddings(config, device=device)
        self.input = InputEncoder(config, device=device)
        self.layers = nn.ModuleDict(
            {str(i): GemLayer(config, i, device=device) for i in range(config.n_layers)}
        )
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, device=device)
        self.final_x, self.final_s = _summaries(config, device)
        d_head = (config.n_sum_tokens + config.n_seq_summary_tokens) * config.d_model
        # Target-aware attention (GemConfig.target_item_feature): one more token into the heads.
        self.target: TargetAttention | None = None
        if config.has_target:
            self.target = TargetAttention(
                config.d_model, config.embedding_dim, config.n_heads, config.head_dim,
                num_actions=config.features.sequences[0].num_actions if config.history_action_weight else 0,
                qk_norm=config.qk_norm, rotary_base=config.rotary_base, norm_eps=config.norm_eps,
                dropout=config.dropout, device=device,
            )  # fmt: skip
            d_head += config.d_model
        self.heads = nn.ModuleDict(
            {
                t: TaskHead(
                    d_head, config.head_hidden, config.norm_eps, device=device, dropout=config.dropout
                )
                for t in config.features.tasks
            }
        )
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialises every parameter and buffer (after ``to_empty`` of a meta-built model)."""
        self.embeddings.reset_parameters()
        self.input.reset_parameters()
        for layer in self.layers.values():
            cast(GemLayer, layer).reset_parameters()
        self.final_norm.reset_parameters()
        self.final_x.reset_parameters()
        self.final_s.reset_parameters()
        for head in self.heads.values():
            cast(TaskHead, head).reset_parameters()
        if self.target is not None:
            self.target.reset_parameters()

    def sparse_parameters(self) -> Iterator[nn.Parameter]:
        """Embedding-table parameters (for a row-wise sparse optimizer)."""
        return self.embeddings.parameters()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter outside the embedding tables."""
        sparse = {id(p) for p in self.embeddings.parameters()}
        return (p for p in self.parameters() if id(p) not in sparse)

    def no_weight_decay_parameters(self) -> Iterator[nn.Parameter]:
        """Dense parameters that weight decay should leave alone: biases and norm gains (every 1-D
        parameter) and learned tokens that play the part of embedding rows (PMA seeds, sequence-type
        tokens). Decaying them pulls gains and offsets towards 0 instead of limiting the capacity."""
        sparse = {id(p) for p in self.embeddings.parameters()}
        for name, p in self.named_parameters():
            if id(p) in sparse:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() < 2 or leaf in ("seeds", "seq_type", "none_token"):
                yield p

    def forward(self, batch: GemBatch) -> dict[str, Tensor]:
        """Returns task name -> logits ``[B]`` float32; in training with ``history_action_weight > 0`` also
        ``"aux/history_action"``: the weighted auxiliary loss (a float32 scalar, see :mod:`gem_model.target`),
        which :func:`multitask_loss` adds."""
        pooled, embedded, candidate = self.embeddings(batch)
        x = self.input.tokens(batch, pooled)
        s, offsets, max_len, positions, first = self.input.history_and_first(batch, embedded)
        extra: list[Tensor] = []
        out: dict[str, Tensor] = {}
        if self.target is not None:
            if candidate is None or candidate.shape[0] != batch.batch_size:
                raise ValueError(
                    f"GemModel: the target item feature {self.config.target_item_feature!r} must hold "
                    "exactly one id per example"
                )
            seq_cfg = self.config.features.sequences[0]
            seq = batch.sequences[seq_cfg.name]
            aux = self.training and self.config.history_action_weight > 0
            token, logits = self.target(
                first[0], seq.offsets, seq.max_len, first[1], embedded[seq_cfg.name][0], candidate,
                history_logits=aux,
            )  # fmt: skip
            extra.append(token[:, None, :])
            if logits is not None:
                supervised = first_of_timestamp(seq.timestamps, seq.offsets)
                loss = history_action_loss(logits, seq.action_ids, supervised)
                out[AUX_LOSS_PREFIX + "history_action"] = self.config.history_action_weight * loss
        for layer in self.layers.values():
            x, s = layer(x, s, offsets, max_len, positions)
        s_sum = self.final_s(self.final_norm(s), offsets, max_len)
        x_sum = self.final_x(x)
        dtype = torch.promote_types(x_sum.dtype, s_sum.dtype)
        z = torch.cat([x_sum.to(dtype), s_sum.to(dtype), *(t.to(dtype) for t in extra)], dim=1).flatten(1)
        return {**{task: head(z) for task, head in self.heads.items()}, **out}


def multitask_loss(logits: dict[str, Tensor], batch: GemBatch) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean over tasks of the masked binary cross-entropy (fp32), plus every auxiliary loss.

    Each task's loss averages over its labelled samples (a task with no label in the batch contributes
    0 and is left out of the mean). Entries whose key starts with ``"aux/"`` are auxiliary losses the model
    computed and weighted itself (scalars, e.g. ``"aux/history_action"``): they are added to the total as
    they are. Returns the total and the per-task (and auxiliary) losses, detached.
    """
    aux = {k: v for k, v in logits.items() if k.startswith(AUX_LOSS_PREFIX)}
    logits = {k: v for k, v in logits.items() if not k.startswith(AUX_LOSS_PREFIX)}
    if batch.labels.shape[1] != len(logits):
        raise ValueError(
            f"multitask_loss: {len(logits)} tasks of logits but labels have {batch.labels.shape[1]}"
        )
    per_task: dict[str, Tensor] = {}
    total = torch.zeros((), dtype=torch.float32, device=batch.labels.device)
    n_tasks = torch.zeros((), dtype=torch.float32, device=batch.labels.device)
    # Column t of labels/label_mask belongs to the t-th task (spec.tasks order = the heads' order).
    for t, (name, logit) in enumerate(logits.items()):
        mask = batch.label_mask[:, t].to(torch.float32)
        bce = F.binary_cross_entropy_with_logits(logit.float(), batch.labels[:, t].float(), reduction="none")
        count = mask.sum()
        loss = (bce * mask).sum() / count.clamp(min=1.0)
        per_task[name] = loss.detach()
        total = total + loss
        n_tasks = n_tasks + (count > 0).to(torch.float32)
    total = total / n_tasks.clamp(min=1.0)
    for name, loss in aux.items():
        per_task[name] = loss.detach()
        total = total + loss.float()
    return total, per_task
