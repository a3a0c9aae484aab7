"""Padded groups of jagged sequences for the CPU attention paths of :mod:`gem_kernels.attention.cpu`.

Sequences are grouped into buckets by their query and key lengths (:data:`BUCKETS_PER_OCTAVE` buckets per
doubling); a group holds index tensors that gather its sequences' rows into padded ``[G, L]`` batches and
scatter results back. Plans are memoised by value of the offsets (:data:`PLANS`): a model's calls over one
history reuse them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gem_kernels.memo import ValueMemo

# Largest G * H * Lq_max * Lk_max of one group's score tensor (2**26 fp32 elements = 256 MiB); several
# such temporaries live at once in the backward, so this bounds its peak memory to about 1 GiB. A single
# sequence longer than the budget still forms its own group (as in the per-sequence loop).
SCORE_BUDGET = 2**26
# Buckets per doubling of the length: 2 keeps each dimension's padding under 1.42x (the padded area under
# 2x) for about twice the groups of power-of-two buckets. Timed at the tiny-model shape (B=256, H=2, D=32,
# causal, fwd+bwd, 1 thread): 1 -> 31 ms, 2 -> 27, 3 -> 26, 4 -> 26, 8 -> 31 (more groups, more overhead).
BUCKETS_PER_OCTAVE = 2
# Upper bounds of the buckets: floor(2 ** (e / BUCKETS_PER_OCTAVE)), deduplicated, up to 2**62.
BUCKET_BOUNDS = torch.tensor(
    sorted({int(2 ** (e / BUCKETS_PER_OCTAVE)) for e in range(62 * BUCKETS_PER_OCTAVE)})
)


@dataclass
class Group:
    """One padded group of ``G`` sequences.

    ``q_idx`` ``[G * Lq]`` / ``k_idx`` ``[G * Lk]`` (row-major over ``[G, L]``, on the data's device) index
    rows of the padded flat tensors; padding positions point at the extra zero row appended at the end.
    ``q_src`` / ``k_src`` are the same with padding pointing at row 0 (rows of the unpadded tensors), and
    ``q_pad`` / ``k_pad`` the padding positions, which a gather through them must zero.
    ``q_len`` / ``k_len`` ``[G]`` int64 CPU are the sequences' lengths, ``left`` / ``right`` the band."""

    size: int
    lq: int
    lk: int
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    q_len: torch.Tensor
    k_len: torch.Tensor
    left: int
    right: int
    q_src: torch.Tensor
    k_src: torch.Tensor
    q_pad: torch.Tensor
    k_pad: torch.Tensor

    @property
    def has_band(self) -> bool:
        """Whether a band limits the keys. Without one, GDPA needs no mask: padding rows are the zero row,
        so a padded key adds ``act(q . 0) * v_pad = 0`` (``v_pad = 0``) to a valid query's output and has
        ``dp = dout . v_pad = 0``, hence ``ds = 0``; a padded query's values land in the discarded row and its
        gathered ``dout`` is 0. Softmax still needs the key mask (``exp`` of a padded score is not 0)."""
        return self.left >= 0 or self.right >= 0

    def band(self) -> torch.Tensor | None:
        """``[Lq, Lk]`` bool CPU: True where key ``j`` lies in query ``i``'s band (``None``: no band)."""
        if self.left < 0 and self.right < 0:
            return None
        iq, ik = torch.arange(self.lq)[:, None], torch.arange(self.lk)[None, :]
        band = torch.ones(self.lq, self.lk, dtype=torch.bool)
        if self.left >= 0:
            band &= ik >= iq - self.left
        if self.right >= 0:
            band &= ik <= iq + self.right
        return band

    def masked_out(self, device: torch.device) -> torch.Tensor:
        """``[G, Lq, Lk]`` bool on ``device``: True where key ``j`` is NOT visible from query ``i`` (padding
        or outside the band)."""
        q_valid = torch.arange(self.lq)[None, :] < self.q_len[:, None]  # [G, Lq]
        k_valid = torch.arange(self.lk)[None, :] < self.k_len[:, None]  # [G, Lk]
        visible = q_valid[:, :, None] & k_valid[:, None, :]
        band = self.band()
        if band is not None:
            visible &= band
        return (~visible).to(device)


def bucket_ids(n: torch.Tensor) -> torch.Tensor:
    """Bucket of each length ``n >= 1`` (int64): lengths in one bucket are within a factor
    ``2 ** (1 / BUCKETS_PER_OCTAVE)`` of the bucket's largest, so padding stays bounded. Exact integers."""
    return torch.searchsorted(BUCKET_BOUNDS, n)


def buckets(lq: torch.Tensor, lk: torch.Tensor, heads: int) -> Iterator[torch.Tensor]:
    """Yield int64 CPU tensors of sequence ids, one per group (sequences with ``Lq == 0`` or ``Lk == 0``
    are left out: their outputs and gradients are 0). Iterates once per (bucket, chunk)."""
    active = torch.nonzero((lq > 0) & (lk > 0)).flatten()
    if active.numel() == 0:
        return
    key = bucket_ids(lq[active]) * BUCKET_BOUNDS.numel() + bucket_ids(lk[active])
    _, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
    order = active[torch.argsort(inverse, stable=True)]
    for members in torch.split(order, counts.tolist()):
        per_seq = heads * int(lq[members].max()) * int(lk[members].max())
        yield from torch.split(members, max(1, SCORE_BUDGET // per_seq))


def make_group(
    members: torch.Tensor,
    q_start: torch.Tensor,
    k_start: torch.Tensor,
    lq: torch.Tensor,
    lk: torch.Tensor,
    pad_q: int,
    pad_k: int,
    left: int,
    right: int,
    device: torch.device,
) -> Group:
    """Index tensors of the sequences ``members`` (int64 CPU ``[G]``)."""
    lqg, lkg = lq[members], lk[members]
    iq = torch.arange(int(lqg.max()))
    ik = torch.arange(int(lkg.max()))
    q_valid = (iq[None, :] < lqg[:, None]).flatten()
    k_valid = (ik[None, :] < lkg[:, None]).flatten()
    q_idx = (q_start[members][:, None] + iq[None, :]).flatten()
    k_idx = (k_start[members][:, None] + ik[None, :]).flatten()
    return Group(
        members.numel(),
        iq.numel(),
        ik.numel(),
        torch.where(q_valid, q_idx, pad_q).to(device),
        torch.where(k_valid, k_idx, pad_k).to(device),
        lqg,
        lkg,
        left,
        right,
        torch.where(q_valid, q_idx, 0).to(device),
        torch.where(k_valid, k_idx, 0).to(device),
        torch.nonzero(~q_valid).flatten().to(device),
        torch.nonzero(~k_valid).flatten().to(device),
    )


# A GEM forward runs two self-attention layers over one history (and training their backwards): their
# groups are the same; only the band differs, which the groups carry as two ints.
PLANS: ValueMemo[list[Group]] = ValueMemo(4)


def groups(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    heads: int,
    pad_q: int,
    pad_k: int,
    left: int,
    right: int,
    device: torch.device,
) -> list[Group]:
    """The padded groups of a call (:func:`buckets`, :func:`_group`), memoised by value of the offsets."""
    q_start, k_start, lq, lk = segments(q_offsets, kv_offsets)

    def make() -> list[Group]:
        return [
            make_group(members, q_start, k_start, lq, lk, pad_q, pad_k, -1, -1, device)
            for members in buckets(lq, lk, heads)
        ]

    key = (q_start, k_start, lq, lk, heads, pad_q, pad_k, SCORE_BUDGET, str(device))
    return [dataclasses.replace(g, left=left, right=right) for g in PLANS.get(key, make)]


def head_major(flat: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """``flat`` ``[N, H, D]`` -> ``[H, N + 1, D]`` in ``cdt``, the last row 0 (the target of padding indices).

    Head-major once per call, so that each group's gather is a contiguous ``[H, G, L, D]`` batch for the
    matmuls (no per-group transposes)."""
    out = torch.empty(flat.shape[1], flat.shape[0] + 1, flat.shape[2], dtype=cdt, device=flat.device)
    out[:, :-1] = flat.transpose(0, 1)
    out[:, -1] = 0  # only the padding row: zero-filling all of it first was a whole extra pass
    return out


def gather(flat: torch.Tensor, idx: torch.Tensor, size: int) -> torch.Tensor:
    """``flat`` ``[H, N+1, D]``, ``idx`` ``[G * L]`` -> ``[H, G, L, D]`` (contiguous)."""
    # torch's Tensor.unflatten is unannotated (torch/_tensor.py).
    out: torch.Tensor = flat.index_select(1, idx).unflatten(1, (size, -1))  # type: ignore[no-untyped-call]
    return out


def scatter(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:, idx[n]] = src[:, n]`` for ``dst`` ``[H, N+1, ...]`` and ``src`` ``[H, G, L, ...]``.

    Segments never overlap, so each valid row is written once; all padding positions write the extra last
    row, which is discarded."""
    dst.index_copy_(1, idx, src.flatten(1, 2))


def flat(padded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[H, N+1, ...]`` head-major -> ``[N, H, ...]`` contiguous in ``dtype`` (the padding row dropped)."""
    return padded[:, :-1].transpose(0, 1).contiguous().to(dtype)


def gather_rows(flat: torch.Tensor, src: torch.Tensor, pad: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """Rows ``src`` of ``flat`` ``[N, H, D]`` (any strides) in ``cdt``, the padding positions ``pad`` zeroed:
    ``[len(src), H, D]`` contiguous. Straight from the caller's tensors (q, k, v are often strided views of
    one projection): no copy of the whole of them first. The padding rows are read from row 0 and then
    zeroed, so whatever row 0 holds (NaN included) never reaches another sequence."""
    out = flat.index_select(0, src).to(cdt)
    if pad.numel():
        out.index_fill_(0, pad, 0)
    return out


def segments(
    q_offsets: torch.Tensor, kv_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    qo = q_offsets.detach().to("cpu", torch.int64)
    ko = kv_offsets.detach().to("cpu", torch.int64)
    return qo[:-1], ko[:-1], qo[1:] - qo[:-1], ko[1:] - ko[:-1]
