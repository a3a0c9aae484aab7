"""PyTorch reference of block attention (with rotary embeddings applied to q and k first): the CPU path
and the test oracle.

It computes in fp32 (fp64 for fp64 inputs) and rounds once to the input dtype at the end, which is what the
Triton kernels do too. It vectorises over all blocks of all sequences at once, by scattering the tokens
into a ``[num_blocks, block_size]`` grid; that needs the number of blocks on the host, so on CUDA it costs
one sync (the Triton kernels do not).
"""

from __future__ import annotations

import torch

from gem_kernels.jagged.reference import token_positions
from gem_kernels.rotary.reference import compute_dtype, rotary_reference


class _BlockGrid:
    """Scatters jagged tokens into a ``[num_blocks, block_size]`` grid of blocks and gathers them back."""

    def __init__(self, offsets: torch.Tensor, total: int, block_size: int, ct: torch.dtype):
        seg, pos = token_positions(offsets, total)
        lengths = (offsets[1:] - offsets[:-1]).long()
        blocks_per_seq = (lengths + block_size - 1) // block_size
        first_block = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
        self.num_blocks = int(blocks_per_seq.sum())  # host sync: fine for a reference
        self.blk = first_block[seg] + pos // block_size
        self.slot = pos % block_size
        self.block_size, self.ct = block_size, ct
        self.valid = torch.zeros(self.num_blocks, block_size, dtype=torch.bool, device=offsets.device)
        self.valid[self.blk, self.slot] = True

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``[total, H, E]`` -> ``[num_blocks, block_size, H, E]`` in the compute dtype, zero-padded."""
        grid = x.new_zeros((self.num_blocks, self.block_size, *x.shape[1:]), dtype=self.ct)
        return grid.index_put((self.blk, self.slot), x.to(self.ct))

    def gather(self, xb: torch.Tensor) -> torch.Tensor:
        return xb[self.blk, self.slot]

    def probabilities(self, qb: torch.Tensor, kb: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
        """Softmax within each block: ``[num_blocks, H, block_size, block_size]``."""
        s = torch.einsum("nihd,njhd->nhij", qb, kb) * scale
        # Key slot 0 of a real block is always valid (and causal keeps j <= i), so no row is fully
        # masked: padding query rows get finite values that are never gathered back.
        mask = self.valid[:, None, None, :]
        if causal:
            bs = self.block_size
            mask = mask & torch.ones(bs, bs, dtype=torch.bool, device=qb.device).tril()
        return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)


def block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
    causal: bool,
    scale: float,
    positions: torch.Tensor | None = None,
    base: float = 10000.0,
    use_rotary: bool = False,
) -> torch.Tensor:
    """Softmax attention within fixed blocks of each sequence (differentiable PyTorch ops).

    q, k ``[total, H, D]``, v ``[total, H, Dv]``, offsets ``[B+1]``. Block ``j`` of a sequence holds
    its tokens ``[j*block_size, (j+1)*block_size)``; with ``use_rotary`` q and k are rotated first
    (positions as in :func:`rotary_reference`). Returns ``[total, H, Dv]`` in v's dtype.
    """
    ct = compute_dtype(q.dtype)
    if use_rotary:
        q = rotary_reference(q.to(ct), offsets, positions, base)
        k = rotary_reference(k.to(ct), offsets, positions, base)
    grid = _BlockGrid(offsets, q.shape[0], block_size, ct)
    p = grid.probabilities(grid.scatter(q), grid.scatter(k), scale, causal)
    ob = torch.einsum("nhij,njhd->nihd", p, grid.scatter(v))
    return grid.gather(ob).to(v.dtype)


def block_attention_backward_reference(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
    causal: bool,
    scale: float,
    positions: torch.Tensor | None = None,
    base: float = 10000.0,
    use_rotary: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`block_attention_reference`, by the explicit formulas the kernel uses:
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(P dP))``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``, then the inverse rotation of dQ and dK."""
    ct = compute_dtype(q.dtype)
    qr, kr = q.to(ct), k.to(ct)
    if use_rotary:
        qr = rotary_reference(qr, offsets, positions, base)
        kr = rotary_reference(kr, offsets, positions, base)
    grid = _BlockGrid(offsets, q.shape[0], block_size, ct)
    qb, kb, vb, dob = grid.scatter(qr), grid.scatter(kr), grid.scatter(v), grid.scatter(grad_out)
    p = grid.probabilities(qb, kb, scale, causal)
    dv = torch.einsum("nhij,nihd->njhd", p, dob)
    dp = torch.einsum("nihd,njhd->nhij", dob, vb)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq = grid.gather(torch.einsum("nhij,njhd->nihd", ds, kb) * scale)
    dk = grid.gather(torch.einsum("nhij,nihd->njhd", ds, qb) * scale)
    if use_rotary:
        dq = rotary_reference(dq, offsets, positions, base, inverse=True)
        dk = rotary_reference(dk, offsets, positions, base, inverse=True)
    return dq.to(q.dtype), dk.to(k.dtype), grid.gather(dv).to(v.dtype)
