"""Triton kernel of the SwiGLU feed-forward's backward step: ``dh = dy @ W2`` with the activation's backward
in the GEMM's epilogue.

Unfused, the step is a GEMM that writes ``dh [M, H]`` and a pointwise kernel that reads ``dh``, ``gate`` and
``up`` and writes ``dgate``, ``dup`` and the recomputed ``h`` (the down projection's input, needed for its
weight gradient): 8 bytes of bf16 traffic per hidden element on top of the GEMM's. Here each program keeps
its ``dh`` tile in fp32 registers, reads the tile's ``gate`` and ``up`` and writes ``dgate``, ``dup`` and
``h``: ``dh`` never reaches memory and is never rounded to bf16. With ``K = d_model`` (512-1024) the GEMM's
own compute is smaller than the epilogue's traffic, so the fused kernel runs at the memory's pace.

Program: one ``BLOCK_M x BLOCK_N`` tile of ``dh`` (tiles grouped by ``GROUP_M`` rows for L2 reuse of W2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["SwiGLUBlocks", "default_blocks", "swiglu_backward_triton"]


@dataclass(frozen=True)
class SwiGLUBlocks:
    """Tile sizes and launch options of the fused backward kernel."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4


def default_blocks(device: torch.device) -> SwiGLUBlocks:
    """The tiles a launch uses: Hopper-sized on CUDA, the smallest legal ones in the CPU interpreter."""
    if device.type == "cuda":
        return SwiGLUBlocks()
    return SwiGLUBlocks(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)


@triton.jit
def _swiglu_backward_kernel(
    DY, W2, GU, DGU, Hout, M, H, K,
    stride_dy_m, stride_dy_k, stride_w_k, stride_w_n, stride_gu_m, stride_dgu_m, stride_h_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < H
    a_ptrs = DY + rows[:, None] * stride_dy_m + ks[None, :] * stride_dy_k
    b_ptrs = W2 + ks[:, None] * stride_w_k + cols[None, :] * stride_w_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_dy_k
        b_ptrs += BLOCK_K * stride_w_k

    # Epilogue: the SwiGLU backward on the fp32 tile of dh; gate = gu[:, :H], up = gu[:, H:].
    mask = row_ok[:, None] & col_ok[None, :]
    gu_ptrs = GU + rows[:, None] * stride_gu_m + cols[None, :]
    gate = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptrs + H, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    dgate = acc * up * sig * (1.0 + gate * (1.0 - sig))
    dup = acc * silu
    dt = DGU.dtype.element_ty
    dgu_ptrs = DGU + rows[:, None] * stride_dgu_m + cols[None, :]
    tl.store(dgu_ptrs, dgate.to(dt), mask=mask)
    tl.store(dgu_ptrs + H, dup.to(dt), mask=mask)
    tl.store(Hout + rows[:, None] * stride_h_m + cols[None, :], (silu * up).to(dt), mask=mask)


def swiglu_backward_triton(
    dy: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, blocks: SwiGLUBlocks | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy ``[M, d_out]``, w2 ``[d_out, H]``, gu ``[M, 2H]`` (rows contiguous) -> ``dgu [M, 2H]``,
    ``h [M, H]`` in gu's dtype (see :func:`gem_kernels.swiglu.reference.swiglu_backward_reference`)."""
    m, k = dy.shape
    hidden = w2.shape[1]
    dgu = torch.empty_like(gu)
    h = gu.new_empty(m, hidden)
    if m == 0 or hidden == 0:
        return dgu, h
    if k == 0:  # dh = 0: a GEMM over an empty K
        return torch.zeros_like(gu), swiglu_activation(gu)
    b = blocks or default_blocks(dy.device)
    grid = (triton.cdiv(m, b.block_m) * triton.cdiv(hidden, b.block_n),)
    _swiglu_backward_kernel[grid](
        dy, w2, gu, dgu, h, m, hidden, k,
        dy.stride(0), dy.stride(1), w2.stride(0), w2.stride(1), gu.stride(0), dgu.stride(0), h.stride(0),
        BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k, GROUP_M=b.group_m,
        EVEN_K=k % b.block_k == 0, IEEE=dy.dtype == torch.float32,
        num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    return dgu, h


def swiglu_activation(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of gu ``[M, 2H]`` in fp32, rounded once to gu's dtype."""
    gate, up = gu.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gu.dtype)
