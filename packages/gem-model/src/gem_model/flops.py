"""Analytic model FLOPs (the MFU numerator), parameter counts and a printable summary.

Counting rules (those of ``torch.utils.flop_counter``, so the two can be compared):
- only matrix products count (linear layers, token-mixing einsums, attention scores and outputs);
  norms, activations, rotary rotations and embedding lookups do not;
- a matmul ``[m, k] x [k, n]`` costs ``2 m k n`` forward; its backward costs ``2 m k n`` per operand
  that needs a gradient (weights always; activations unless they come straight from the batch);
- attention counts valid (query, key) pairs only: ``2 * pairs * H * (D + Dv)`` forward and twice
  that backward (recomputation of the scores in the backward kernel is not counted);
- everything counts the real jagged lengths of the batch: padding costs nothing.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch

from gem_model.batch import GemBatch
from gem_model.config import GemConfig
from gem_model.crosses import n_cross_stats
from gem_model.model import N_TIME_FEATURES, GemModel

__all__ = ["attention_pairs", "flops", "flops_by_block", "model_summary", "parameter_counts"]


def _lengths(offsets: torch.Tensor) -> list[int]:
    o = offsets.detach().to("cpu", torch.int64)
    return (o[1:] - o[:-1]).tolist()


def _sum_min(n: int, cap: int) -> int:
    """``sum(min(i, cap) for i in range(n))`` in closed form: the keys on one side of a window."""
    if n <= cap:
        return n * (n - 1) // 2
    return cap * (cap - 1) // 2 + (n - cap) * cap


def attention_pairs(lengths: list[int], kind: str, *, causal: bool, window: int, block_size: int) -> int:
    """Valid (query, key) pairs of self-attention over sequences of the given lengths.

    ``kind``: "full", "window" (``window`` keys to the left, and to the right unless causal) or "block"
    (block-diagonal with blocks of ``block_size`` counted from each sequence's first event). Closed forms
    per sequence: this runs on the host every training step (for MFU), over hundreds of thousands of
    events, so it must not loop over tokens.
    """
    if kind not in ("full", "window", "block"):
        raise ValueError(f"unknown attention kind {kind!r}")

    def square(w: int) -> int:
        return w * (w + 1) // 2 if causal else w * w

    total = 0
    for n in lengths:
        if kind == "full":
            total += square(n)
        elif kind == "window":
            right = 0 if causal else window
            # query i sees min(i, left) keys before it, min(n - 1 - i, right) after it, and itself
            total += _sum_min(n, window) + _sum_min(n, right) + n
        else:
            full, rest = divmod(n, block_size)
            total += full * square(block_size) + square(rest)
    return total


class _Ledger:
    """Accumulates forward+backward FLOPs per named block."""

    def __init__(self) -> None:
        self.by_block: dict[str, int] = defaultdict(int)

    def mm(
        self, block: str, m: int, k: int, n: int, *, input_grad: bool = True, weight_grad: bool = True
    ) -> None:
        fwd = 2 * m * k * n
        self.by_block[block] += fwd * (1 + int(input_grad) + int(weight_grad))

    def attention(self, block: str, pairs: int, heads: int, d_qk: int, d_v: int) -> None:
        fwd = 2 * pairs * heads * (d_qk + d_v)
        self.by_block[block] += 3 * fwd  # backward: dV, dP, dQ, dK = twice the forward


def _summaries(led: _Ledger, cfg: GemConfig, block: str, b: int, total: int, lengths: list[int]) -> None:
    d, a = cfg.d_model, cfg.attn_dim
    # X_sum: token mix n -> n_sum, then gating.
    led.mm(f"{block}.x_summary", cfg.n_sum_tokens, cfg.n_tokens, b * d)
    led.mm(f"{block}.x_summary", b * cfg.n_sum_tokens, d, d)
    # S_sum: PMA (kv over the history, q of the seeds, attention, out) then gating.
    led.mm(f"{block}.pma", total, d, 2 * a)
    led.mm(f"{block}.pma", cfg.n_pma_tokens, d, a)
    led.attention(f"{block}.pma", cfg.n_pma_tokens * sum(lengths), cfg.n_heads, cfg.head_dim, cfg.head_dim)
    led.mm(f"{block}.pma", b * cfg.n_pma_tokens, a, d)
    led.mm(f"{block}.s_summary", b * cfg.n_seq_summary_tokens, d, d)


def _target(led: _Ledger, cfg: GemConfig, b: int, lengths: list[int]) -> None:
    """The target-aware attention of a training step (:mod:`gem_model.target`): with the auxiliary
    objective every history event queries too (causal over ``n + 1`` rows a user), else the candidate only."""
    d, e, a = cfg.d_model, cfg.embedding_dim, cfg.attn_dim
    n = sum(lengths)
    aux = cfg.history_action_weight > 0
    rows_q = n + b if aux else b
    pairs = sum((m + 1) * (m + 2) // 2 for m in lengths) if aux else n + b
    led.mm("target", rows_q, e, d)  # item embedding -> query token
    led.mm("target", rows_q, d, a)  # queries
    led.mm("target", n + b, d, 2 * a)  # keys and values of [NONE, events]
    led.attention("target", pairs, cfg.n_heads, cfg.head_dim, cfg.head_dim)
    led.mm("target", rows_q, a, d)  # output projection
    led.mm("target", rows_q, 3 * d, d)  # [r || q || r * q] -> g
    if aux:
        led.mm("target", n, d, cfg.features.sequences[0].num_actions)


def flops_by_block(config: GemConfig, batch: GemBatch) -> dict[str, int]:
    """Forward+backward FLOPs per block (keys like ``input``, ``layers.0.self_attention``, ``heads``).

    Reads the batch's offsets on the host (one sync).
    """
    cfg, led = config, _Ledger()
    b, d, e, a = batch.batch_size, cfg.d_model, cfg.embedding_dim, cfg.attn_dim
    per_seq = [_lengths(batch.sequences[s.name].offsets) for s in cfg.features.sequences]
    lengths = [sum(ls) for ls in zip(*per_seq)]  # merged history per user
    total = sum(lengths)

    if cfg.n_dense_tokens:
        led.mm("input", b, cfg.features.n_dense, cfg.n_dense_tokens * d, input_grad=False)
    if e != d:
        if cfg.features.sparse:
            led.mm("input", b * len(cfg.features.sparse), e, d)
        led.mm("input", total, e, d)
    led.mm("input", total, N_TIME_FEATURES, d, input_grad=False)
    if cfg.has_crosses:  # the crosses' statistics (data, no grad) -> one token
        led.mm("input", b, n_cross_stats(cfg), d, input_grad=False)
    for s, ls in zip(cfg.features.sequences, per_seq, strict=True):
        if s.num_event_features:  # event side features [n, F] x [F, E] (no grad to the input)
            led.mm("input", sum(ls), s.num_event_features, e, input_grad=False)

    n, n_ss = cfg.n_tokens, cfg.n_seq_summary_tokens
    n_in, n_fm, k = n + n_ss, cfg.fm_tokens, cfg.wukong_rank
    for layer in range(cfg.n_layers):
        blk = f"layers.{layer}"
        _summaries(led, cfg, blk, b, total, lengths)
        for _ in range(cfg.n_experts):
            led.mm(f"{blk}.wukong", d, n_in, k * b)  # X^T Y per sample: [d, n_in] x [n_in, k]
            led.mm(f"{blk}.wukong", b * n_in, d, k)  # X (X^T Y): [n_in, d] x [d, k] per sample
            led.mm(f"{blk}.wukong", b, n_in * k, cfg.wukong_hidden)
            led.mm(f"{blk}.wukong", b, cfg.wukong_hidden, n_fm * d)
            if n > n_fm:
                led.mm(f"{blk}.wukong", n - n_fm, n_in, b * d)
            led.mm(f"{blk}.wukong", n, n_in, b * d)  # residual
        if cfg.n_experts > 1:
            led.mm(f"{blk}.wukong", b, d, cfg.n_experts)
        # Context cross-attention (GDPA): q over the history, k/v of the n_ctx context tokens.
        led.mm(f"{blk}.cross_attention", total, d, a)
        led.mm(f"{blk}.cross_attention", b * cfg.n_context_tokens, d, 2 * a)
        led.attention(
            f"{blk}.cross_attention", total * cfg.n_context_tokens, cfg.n_heads, cfg.head_dim, cfg.head_dim
        )
        led.mm(f"{blk}.cross_attention", total, a, d)
        # Self-attention over the history.
        pairs = attention_pairs(
            lengths,
            cfg.attention_kind(layer),
            causal=cfg.causal,
            window=cfg.window,
            block_size=cfg.block_size,
        )
        led.mm(f"{blk}.self_attention", total, d, 3 * a)
        led.attention(f"{blk}.self_attention", pairs, cfg.n_heads, cfg.head_dim, cfg.head_dim)
        led.mm(f"{blk}.self_attention", total, a, d)
        if cfg.ffn_hidden:
            led.mm(f"{blk}.ffn", total, d, 2 * cfg.ffn_hidden)
            led.mm(f"{blk}.ffn", total, cfg.ffn_hidden, d)

    _summaries(led, cfg, "final", b, total, lengths)
    if cfg.has_target:
        _target(led, cfg, b, per_seq[0])
    d_head = (cfg.n_sum_tokens + n_ss + int(cfg.has_target)) * d
    dims = (d_head, *cfg.head_hidden, 1)
    for _ in cfg.features.tasks:
        for din, dout in itertools.pairwise(dims):
            led.mm("heads", b, din, dout)
    return dict(led.by_block)


def flops(config: GemConfig, batch: GemBatch) -> int:
    """Model FLOPs of one forward+backward over ``batch`` (valid tokens only): the MFU numerator."""
    return sum(flops_by_block(config, batch).values())


def parameter_counts(config: GemConfig) -> dict[str, int]:
    """``{"dense", "sparse", "total"}`` parameter counts (built on the meta device: allocates nothing)."""
    model = GemModel(config, device="meta")
    sparse = sum(p.numel() for p in model.sparse_parameters())
    dense = sum(p.numel() for p in model.dense_parameters())
    return {"dense": dense, "sparse": sparse, "total": dense + sparse}


def _fmt(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def model_summary(config: GemConfig) -> str:
    """A printable table of parameters per top-level block, dense and sparse totals."""
    model = GemModel(config, device="meta")
    rows = [("embeddings (sparse)", sum(p.numel() for p in model.embeddings.parameters()))]
    rows.append(("input", sum(p.numel() for p in model.input.parameters())))
    for name, layer in model.layers.items():
        rows.append(
            (
                f"layers.{name} ({config.attention_kind(int(name))})",
                sum(p.numel() for p in layer.parameters()),
            )
        )
    rows.append(
        (
            "final",
            sum(p.numel() for m in (model.final_norm, model.final_x, model.final_s) for p in m.parameters()),
        )
    )
    rows.append(("heads", sum(p.numel() for p in model.heads.parameters())))
    counts = parameter_counts(config)
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{'block':<{width}}{'params':>10}"]
    lines += [f"{name:<{width}}{_fmt(n):>10}" for name, n in rows]
    lines.append(f"{'dense total':<{width}}{_fmt(counts['dense']):>10}")
    lines.append(f"{'sparse total':<{width}}{_fmt(counts['sparse']):>10}")
    lines.append(f"{'total':<{width}}{_fmt(counts['total']):>10}")
    return "\n".join(lines)
