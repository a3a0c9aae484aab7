"""Typed model configuration and the named sizes ``tiny``, ``small``, ``base`` and ``large``.

A :class:`GemConfig` holds the features and every architecture choice; it knows nothing of parallelism or
precision (gem-parallel and gem-precision apply those from outside). Change a field with
``dataclasses.replace(get_config("tiny"), features=my_spec)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gem_model.features import FeatureSpec, SequenceFeature, SparseFeature

__all__ = ["ATTENTION_KINDS", "CONFIG_NAMES", "AttentionKind", "GemConfig", "get_config"]

AttentionKind = Literal["full", "window", "block"]
ATTENTION_KINDS: tuple[str, ...] = ("full", "window", "block")


@dataclass(frozen=True)
class GemConfig:
    """Architecture and features of a :class:`~gem_model.GemModel`.

    Token widths:
        d_model: width of every token (non-sequence tokens, summary tokens and sequence events).
        embedding_dim: width of the embedding-table rows; projected to ``d_model`` when different.
        n_dense_tokens: tokens made from the dense features (one linear map ``n_dense -> n * d_model``).

    Layer stack (``n_layers`` layers, each an interaction half and a sequence half):
        n_heads, head_dim: heads of every attention (PMA, PFFN cross-attention, self-attention).
        n_sum_tokens: non-sequence summary tokens ``X_sum`` (InterFormer CLS tokens).
        n_pma_tokens: learned seed queries pooling the history (PMA).
        n_recent: most recent history events copied into the sequence summary.
        pma_kind: "softmax" (jagged flash attention) or "gdpa" (activation attention) for PMA.
        gdpa_activation: activation of the GDPA attentions ("silu" or "gelu").
        wukong_rank: k of the low-rank factorization machine ``X (X^T Y)``, ``Y`` in R^{n x k}.
        wukong_hidden: hidden width of the factorization-machine block's MLP.
        wukong_fm_tokens: tokens the FM block emits (the linear compression block emits the rest);
            None = half of the non-sequence tokens.
        n_experts: Wukong experts per layer; > 1 makes a gated ensemble (DHEN / mixture of Wukong experts).
        attention: self-attention kind over the history, one for all layers or one per layer:
            "full" (jagged attention), "window" (sliding window of ``window`` events), "block"
            (``block_size``-event block-diagonal attention).
        causal: whether an event attends only to older events (and itself) in self-attention.
        qk_norm: RMS-normalise queries and keys per head before the attention scores.
        ffn_hidden: hidden width of the sequence half's SwiGLU feed-forward (0 = no FFN).
        fused_ffn: run the SwiGLU through :func:`gem_kernels.swiglu_ffn`: on CUDA its backward's first GEMM
            and the activation's backward are one Triton kernel (``dh`` kept in fp32, never written: 3-4 GiB
            less peak memory on base-h200 and large-h200); on the CPU it is the plain composition. Same
            parameters. Off by default: on an H100 the bf16 step ran 0.989x (base-h200) and 0.949x
            (large-h200) of the composition's (gem-train BENCHMARKS.md, issue 37 item 2).
        rotary_base: RoPE base. Rotary positions are temporal (ROTE):
            ``rotary_position_scale * log1p((request_time - timestamp) / time_scale_s)``.
        head_hidden: hidden widths of each task's MLP head.
        norm_eps: epsilon of every LayerNorm / RMSNorm.
        dropout: dropout probability on the output of every residual branch of the sequence half
            (context cross-attention, self-attention, SwiGLU) and on the heads' hidden layers (0: off).
        embedding_dropout: dropout probability on the input tokens (non-sequence tokens and history
            events, after their embeddings are combined) (0: off).

    Target-aware attention (:mod:`gem_model.target`; off by default, and then the model, its parameters
    and its checkpoint keys are what they were without these fields):
        target_item_feature: the sparse feature holding the candidate item's id in the first sequence's
            item vocabulary (e.g. "ad_id"); None: off. When set, the candidate is also embedded with that
            sequence's item table (shared rows: the candidate and the history items live in one space),
            its embedding queries the history (DIN / HSTU style: every earlier event, a learned "no
            event" token for an empty history), and the readout adds one token to the heads' input.
        history_action_weight: weight of the autoregressive auxiliary objective (HSTU's training): the
            same target-aware attention, queried by each history event's item, predicts that event's
            action (cross-entropy over ``num_actions``) from the events strictly earlier in time; added
            to the loss by :func:`gem_model.multitask_loss` (0: off; needs ``target_item_feature``).

    Candidate x history-aggregate crosses (:mod:`gem_model.crosses`; off by default, and then the model and
    its checkpoint keys are what they were without these fields):
        cross_item_feature: the sparse feature holding the candidate item's id in the first sequence's item
            vocabulary (e.g. "ad_id"); None: off. When set, the counts and smoothed like rates and action
            levels of the user's earlier events (all of them, those of the candidate's item and, with
            ``cross_attribute_feature``, those sharing its attribute ids) make one more non-sequence token.
        cross_attribute_feature: a sparse feature of the candidate whose ids index the columns of the first
            sequence's event features (``num_embeddings == num_event_features``; MovieLens: "ad_genres"
            against the history's genre rows); None: no attribute group. Needs ``cross_item_feature``.
        cross_like_action: an earlier event is a "like" when its action id is ``>=`` this (MovieLens: 4, a
            rating of 4 or 5, the label's rule; synthetic data: 1, a click or deeper).
        cross_recency_events: ``r > 0``: every group is also counted with its events weighted by
            ``exp(-k / r)`` (``k`` the event's rank from the newest), and each match group's share of the
            history is added, plain and decayed; 0: off (the statistics as before).
    """

    features: FeatureSpec
    d_model: int = 64
    embedding_dim: int = 64
    n_dense_tokens: int = 1
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int = 32
    n_sum_tokens: int = 4
    n_pma_tokens: int = 2
    n_recent: int = 2
    pma_kind: Literal["softmax", "gdpa"] = "softmax"
    gdpa_activation: Literal["silu", "gelu"] = "silu"
    wukong_rank: int = 8
    wukong_hidden: int = 128
    wukong_fm_tokens: int | None = None
    n_experts: int = 1
    attention: AttentionKind | tuple[AttentionKind, ...] = "full"
    window: int = 128
    block_size: int = 64
    causal: bool = True
    qk_norm: bool = True
    ffn_hidden: int = 128
    fused_ffn: bool = False
    rotary_base: float = 10000.0
    rotary_position_scale: float = 16.0
    time_scale_s: float = 60.0
    head_hidden: tuple[int, ...] = (128, 64)
    norm_eps: float = 1e-5
    dropout: float = 0.0
    embedding_dropout: float = 0.0
    target_item_feature: str | None = None
    history_action_weight: float = 0.0
    cross_item_feature: str | None = None
    cross_attribute_feature: str | None = None
    cross_like_action: int = 1
    cross_recency_events: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.features, FeatureSpec):
            raise TypeError(f"GemConfig.features must be a FeatureSpec, got {type(self.features).__name__}")
        positive = (
            "d_model", "embedding_dim", "n_layers", "n_heads", "head_dim", "n_sum_tokens",
            "n_pma_tokens", "wukong_rank", "wukong_hidden", "n_experts", "window", "block_size",
        )  # fmt: skip
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GemConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("n_recent", "ffn_hidden", "n_dense_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"GemConfig.{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.features.n_dense == 0 and self.n_dense_tokens:
            object.__setattr__(self, "n_dense_tokens", 0)
        if self.n_tokens < 1:
            raise ValueError("GemConfig: no non-sequence tokens (need dense features or sparse features)")
        if self.pma_kind not in ("softmax", "gdpa"):
            raise ValueError(f"GemConfig.pma_kind must be 'softmax' or 'gdpa', got {self.pma_kind!r}")
        if self.gdpa_activation not in ("silu", "gelu"):
            raise ValueError(
                f"GemConfig.gdpa_activation must be 'silu' or 'gelu', got {self.gdpa_activation!r}"
            )
        kinds = (self.attention,) if isinstance(self.attention, str) else tuple(self.attention)
        if isinstance(self.attention, str):
            pass
        elif len(kinds) != self.n_layers:
            raise ValueError(
                f"GemConfig.attention: give one kind or one per layer ({self.n_layers}), got {len(kinds)}"
            )
        else:
            object.__setattr__(self, "attention", kinds)
        bad = [k for k in kinds if k not in ATTENTION_KINDS]
        if bad:
            raise ValueError(f"GemConfig.attention: unknown kinds {bad}; choose from {ATTENTION_KINDS}")
        for name in ("dropout", "embedding_dropout"):
            p = getattr(self, name)
            if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ValueError(f"GemConfig.{name} must lie in [0, 1), got {p!r}")
        fm = self.wukong_fm_tokens
        if fm is not None and not (1 <= fm <= self.n_tokens):
            raise ValueError(f"GemConfig.wukong_fm_tokens must lie in [1, {self.n_tokens}], got {fm}")
        self._check_target()
        self._check_crosses()
        object.__setattr__(self, "head_hidden", tuple(self.head_hidden))
        if any(h < 1 for h in self.head_hidden):
            raise ValueError(f"GemConfig.head_hidden must hold positive ints, got {self.head_hidden}")

    def _check_item_feature(self, field: str, name: str) -> None:
        """``name`` is a sparse feature of one id per example in the first sequence's item vocabulary."""
        by_name = {f.name: f for f in self.features.sparse}
        if name not in by_name:
            raise ValueError(
                f"GemConfig.{field} {name!r} is not a sparse feature of the spec "
                f"({', '.join(by_name) or 'none'})"
            )
        feature, seq = by_name[name], self.features.sequences[0]
        if feature.max_ids != 1 or feature.num_embeddings != seq.num_items:
            raise ValueError(
                f"GemConfig.{field} {name!r} must be one id per example in the item vocabulary "
                f"of sequence {seq.name!r} ({seq.num_items} ids), got max_ids {feature.max_ids} and "
                f"{feature.num_embeddings} ids"
            )

    def _check_crosses(self) -> None:
        like, seq = self.cross_like_action, self.features.sequences[0]
        if not isinstance(like, int) or isinstance(like, bool) or not 1 <= like < max(seq.num_actions, 2):
            raise ValueError(
                f"GemConfig.cross_like_action must be an int in [1, {seq.num_actions - 1}] (an action id of "
                f"sequence {seq.name!r}, so both likes and others can occur), got {like!r}"
            )
        r = self.cross_recency_events
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < float("inf"):
            raise ValueError(f"GemConfig.cross_recency_events must be a finite number >= 0, got {r!r}")
        attr = self.cross_attribute_feature
        if self.cross_item_feature is None:
            if attr is not None:
                raise ValueError("GemConfig.cross_attribute_feature needs cross_item_feature")
            if r:
                raise ValueError("GemConfig.cross_recency_events needs cross_item_feature")
            return
        self._check_item_feature("cross_item_feature", self.cross_item_feature)
        if attr is None:
            return
        by_name = {f.name: f for f in self.features.sparse}
        if attr not in by_name:
            raise ValueError(
                f"GemConfig.cross_attribute_feature {attr!r} is not a sparse feature of the spec "
                f"({', '.join(by_name) or 'none'})"
            )
        if seq.num_event_features == 0 or by_name[attr].num_embeddings != seq.num_event_features:
            raise ValueError(
                f"GemConfig.cross_attribute_feature {attr!r} must have one id per event-feature column of "
                f"sequence {seq.name!r} ({seq.num_event_features} columns), got "
                f"{by_name[attr].num_embeddings} ids"
            )

    def _check_target(self) -> None:
        name, w = self.target_item_feature, self.history_action_weight
        if not isinstance(w, (int, float)) or not 0.0 <= w < float("inf"):
            raise ValueError(f"GemConfig.history_action_weight must be a finite number >= 0, got {w!r}")
        if name is None:
            if w:
                raise ValueError(
                    "GemConfig.history_action_weight needs target_item_feature (the auxiliary objective "
                    "reads the history through the target-aware attention)"
                )
            return
        self._check_item_feature("target_item_feature", name)

    @property
    def has_target(self) -> bool:
        """Whether the target-aware attention is on (``target_item_feature`` set)."""
        return self.target_item_feature is not None

    @property
    def has_crosses(self) -> bool:
        """Whether the candidate x history-aggregate crosses are on (``cross_item_feature`` set)."""
        return self.cross_item_feature is not None

    @property
    def n_tokens(self) -> int:
        """Non-sequence tokens carried through the layers: dense tokens + one per sparse feature (+ the
        crosses' token)."""
        return self.n_dense_tokens + len(self.features.sparse) + int(self.has_crosses)

    @property
    def n_seq_summary_tokens(self) -> int:
        """Sequence summary tokens ``S_sum``: PMA outputs + recent events."""
        return self.n_pma_tokens + self.n_recent

    @property
    def n_context_tokens(self) -> int:
        """Keys of the PFFN cross-attention: ``[X_sum || S_sum]``."""
        return self.n_sum_tokens + self.n_seq_summary_tokens

    @property
    def fm_tokens(self) -> int:
        """Tokens emitted by the Wukong factorization-machine block."""
        return self.wukong_fm_tokens if self.wukong_fm_tokens is not None else max(1, self.n_tokens // 2)

    @property
    def attn_dim(self) -> int:
        """Inner width of every attention: ``n_heads * head_dim``."""
        return self.n_heads * self.head_dim

    def attention_kind(self, layer: int) -> str:
        """Self-attention kind of layer ``layer`` (0-based)."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range for {self.n_layers} layers")
        return self.attention if isinstance(self.attention, str) else self.attention[layer]


def _ads_features(
    n_dense: int, vocab: int, item_vocab: int, seq_lens: tuple[int, ...], n_user: int = 3, n_ad: int = 3
) -> FeatureSpec:
    """An ads-like spec: user and candidate-ad attributes plus behaviour sequences."""
    sparse = [SparseFeature("user_id", vocab)]
    sparse += [
        SparseFeature(f"user_attr_{i}", max(10, vocab // 100), max_ids=1 + i % 3) for i in range(n_user - 1)
    ]
    sparse += [SparseFeature("ad_id", vocab)]
    sparse += [
        SparseFeature(f"ad_attr_{i}", max(10, vocab // 1000), max_ids=1 + i % 2) for i in range(n_ad - 1)
    ]
    names = ["history", "ads_history", "organic_history"]
    seqs = [SequenceFeature(names[i], item_vocab, 8, n) for i, n in enumerate(seq_lens)]
    return FeatureSpec(n_dense=n_dense, sparse=tuple(sparse), sequences=tuple(seqs))


def _tiny() -> GemConfig:
    # Trains on a laptop CPU in well under a minute.
    return GemConfig(
        features=_ads_features(n_dense=8, vocab=1000, item_vocab=500, seq_lens=(48,), n_user=2, n_ad=2),
        d_model=32, embedding_dim=32, n_layers=2, n_heads=2, head_dim=16, n_sum_tokens=2,
        wukong_rank=4, wukong_hidden=64, n_experts=2, attention=("full", "window"), window=16,
        block_size=16, ffn_hidden=64, head_hidden=(32,),
    )  # fmt: skip


def _small() -> GemConfig:
    return GemConfig(
        features=_ads_features(n_dense=16, vocab=100_000, item_vocab=100_000, seq_lens=(256, 128)),
        d_model=128, embedding_dim=64, n_layers=4, n_heads=4, head_dim=32, wukong_rank=8,
        wukong_hidden=256, n_experts=2, attention=("full", "window", "block", "window"), window=64,
        ffn_hidden=256, head_hidden=(128, 64),
    )  # fmt: skip


def _base() -> GemConfig:
    # Fills one H200 at a batch of a few hundred users with histories of ~1k events.
    return GemConfig(
        features=_ads_features(
            n_dense=32, vocab=1_000_000, item_vocab=1_000_000, seq_lens=(2048,), n_user=6, n_ad=6
        ),
        d_model=512, embedding_dim=128, n_dense_tokens=4, n_layers=6, n_heads=4, head_dim=128,
        n_sum_tokens=8, n_pma_tokens=4, n_recent=4, wukong_rank=16, wukong_hidden=1024, n_experts=4,
        attention=("full", "window", "block", "window", "block", "window"), window=256,
        ffn_hidden=2048, head_hidden=(512, 256),
    )  # fmt: skip


def _large() -> GemConfig:
    # Needs several GPUs: ~100M-row tables and a deep, wide trunk.
    return GemConfig(
        features=_ads_features(
            n_dense=64, vocab=50_000_000, item_vocab=100_000_000, seq_lens=(4096, 1024), n_user=12, n_ad=12
        ),
        d_model=1024, embedding_dim=256, n_dense_tokens=8, n_layers=12, n_heads=8, head_dim=128,
        n_sum_tokens=16, n_pma_tokens=8, n_recent=8, wukong_rank=32, wukong_hidden=4096, n_experts=8,
        attention=("full", "window", "block", "window") * 3, window=512,
        ffn_hidden=4096, head_hidden=(1024, 512, 256),
    )  # fmt: skip


_CONFIGS = {"tiny": _tiny, "small": _small, "base": _base, "large": _large}
CONFIG_NAMES: tuple[str, ...] = tuple(_CONFIGS)


def get_config(name: str) -> GemConfig:
    """Returns the named config (``tiny``, ``small``, ``base`` or ``large``).

    Raises:
        KeyError: for an unknown name, listing the known ones.
    """
    try:
        return _CONFIGS[name]()
    except KeyError:
        raise KeyError(f"unknown GEM config {name!r}; known configs: {', '.join(CONFIG_NAMES)}") from None
