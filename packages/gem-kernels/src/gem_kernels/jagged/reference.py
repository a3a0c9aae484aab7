"""PyTorch paths of the jagged helpers: the CPU path, the fallback on CUDA, and the test oracle.

Every function here works on flattened features (values ``[total, F]``, padded ``[B, N, F]``) and uses
only index arithmetic on the device: no host synchronisation, so they also run on CUDA inside
``torch.compile`` graphs. Token-to-sequence maps come from ``searchsorted`` over the offsets.
"""

from __future__ import annotations

import torch


def segment_ids(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every token: int64 ``[total]``; token ``t`` belongs to sequence ``b`` when
    ``offsets[b] <= t < offsets[b+1]`` (empty sequences own no token)."""
    tokens = torch.arange(total, device=offsets.device, dtype=offsets.dtype)
    # right=True skips empty sequences: the first b with offsets[b+1] > t.
    return torch.searchsorted(offsets[1:].contiguous(), tokens, right=True)


def token_positions(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment ids, position within the sequence)``, both int64 ``[total]``."""
    seg = segment_ids(offsets, total)
    pos = torch.arange(total, device=offsets.device, dtype=torch.int64) - offsets.long()[seg]
    return seg, pos


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, padding_value: float
) -> torch.Tensor:
    """values ``[total, F]`` -> ``[B, max_len, F]``; tokens past ``max_len`` are dropped."""
    total, feat = values.shape
    batch = offsets.numel() - 1
    seg, pos = token_positions(offsets, total)
    # Tokens past max_len go to one extra dump row, so no data-dependent masking (no sync on CUDA).
    dump = batch * max_len
    dest = torch.where(pos < max_len, seg * max_len + pos, torch.full_like(pos, dump))
    out = values.new_full((dump + 1, feat), padding_value)
    out.index_copy_(0, dest, values)
    return out[:dump].view(batch, max_len, feat)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """padded ``[B, N, F]`` -> ``[total, F]``; tokens at positions ``>= N`` get 0."""
    batch, n, feat = padded.shape
    seg, pos = token_positions(offsets, total)
    # Positions past N read one extra zero row (the adjoint of jagged_to_padded's truncation).
    src = torch.where(pos < n, seg * n + pos, torch.full_like(pos, batch * n))
    rows = torch.cat([padded.reshape(batch * n, feat), padded.new_zeros(1, feat)])
    return rows.index_select(0, src)


def concat_destinations(
    a_offsets: torch.Tensor, a_total: int, b_offsets: torch.Tensor, b_total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the concatenated tensor that receive the tokens of ``a`` and of ``b`` (int64)."""
    seg_a = segment_ids(a_offsets, a_total)
    seg_b = segment_ids(b_offsets, b_total)
    # Before sequence s the output holds a_offsets[s] + b_offsets[s] tokens; a's tokens come first.
    a_dest = torch.arange(a_total, device=a_offsets.device) + b_offsets.long()[seg_a]
    b_dest = torch.arange(b_total, device=b_offsets.device) + a_offsets.long()[seg_b + 1]
    return a_dest, b_dest


def jagged_concat(
    a: torch.Tensor, a_offsets: torch.Tensor, b: torch.Tensor, b_offsets: torch.Tensor
) -> torch.Tensor:
    """Per sequence ``[a_s ; b_s]``: ``[Ta + Tb, F]``."""
    a_dest, b_dest = concat_destinations(a_offsets, a.shape[0], b_offsets, b.shape[0])
    out = a.new_empty((a.shape[0] + b.shape[0], a.shape[1]))
    out.index_copy_(0, a_dest, a)
    out.index_copy_(0, b_dest, b)
    return out


def jagged_split(
    values: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor, a_total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`jagged_concat`."""
    b_total = values.shape[0] - a_total
    a_dest, b_dest = concat_destinations(a_offsets, a_total, b_offsets, b_total)
    return values.index_select(0, a_dest), values.index_select(0, b_dest)


def jagged_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[B, F]`` mean over each sequence (0 for an empty one); sums in fp32 for low precision."""
    batch = offsets.numel() - 1
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    seg = segment_ids(offsets, values.shape[0])
    sums = torch.zeros(batch, values.shape[1], dtype=acc, device=values.device)
    sums.index_add_(0, seg, values.to(acc))
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(acc)
    return (sums / lengths[:, None]).to(values.dtype)


def jagged_mean_backward(grad: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Gradient of :func:`jagged_mean`: ``grad[b] / len_b`` for every token of sequence ``b``."""
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    seg = segment_ids(offsets, total)
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(acc)
    return (grad.to(acc) / lengths[:, None])[seg].to(grad.dtype)


def last_k_sources(offsets: torch.Tensor, k: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source row of every slot of :func:`jagged_last_k` (``total`` for an empty slot) and the mask."""
    lengths = (offsets[1:] - offsets[:-1]).long()
    n = lengths.clamp(max=k)
    slot = torch.arange(k, device=offsets.device)
    mask = slot[None, :] < n[:, None]
    src = offsets[1:].long()[:, None] - n[:, None] + slot[None, :]
    return torch.where(mask, src, torch.full_like(src, total)), mask


def jagged_last_k(values: torch.Tensor, offsets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, k, F], mask [B, k])``: the last ``min(len, k)`` tokens of each sequence in order,
    left-aligned (slot 0 holds the oldest of them), zeros after."""
    total, feat = values.shape
    src, mask = last_k_sources(offsets, k, total)
    # One zero row after the values serves every empty slot (and a batch with no tokens).
    padded = torch.cat([values, values.new_zeros(1, feat)])
    return padded.index_select(0, src.reshape(-1)).view(mask.shape[0], k, feat), mask


def jagged_last_k_backward(grad: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Gradient of :func:`jagged_last_k` for the values ``[total, F]``."""
    batch, k, feat = grad.shape
    src, _ = last_k_sources(offsets, k, total)
    out = grad.new_zeros(total + 1, feat)
    # Real slots have distinct sources; empty slots all land on the extra row, which is dropped.
    out.index_add_(0, src.reshape(-1), grad.reshape(batch * k, feat))
    return out[:total]
