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

import collections
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gem_kernels.launch_triton import persistent_grid, use_descriptor_scratch
from gem_kernels.swiglu.reference import swiglu_backward_reference

__all__ = ["SwiGLUBlocks", "default_blocks", "swiglu_backward_triton"]


BLOCKS_ENV = "GEM_KERNELS_SWIGLU_BLOCKS"
# Launches by path ("tma" | "pointer"): tests read which one ran.
launches: collections.Counter[str] = collections.Counter()


@dataclass(frozen=True)
class SwiGLUBlocks:
    """Tile sizes and launch options of the fused backward kernel.

    ``prefetch``: load the tile's ``gate`` and ``up`` before the K loop, so their latency hides behind the
    GEMM (at the cost of holding them in registers through it). ``tma``: every load and store through
    device-side tensor descriptors (sm_90+; used only where the hidden width is a multiple of ``block_n``
    and the rows 16-byte aligned, else the pointer path runs): bulk copies with no per-thread addresses,
    rows past M read as 0 and never written. Slower than pointers on the H100 (by 1.3x at the best tiles
    of each): kept for the sweep and for other GPUs. ``persistent``: programs per SM of the persistent,
    warp-specialized descriptor kernel (0: off; needs ``tma``): each program loops over tiles, and Triton's
    automatic warp specialization gives the loads a producer warp group of their own, so one tile's epilogue
    overlaps the next tile's GEMM (``prefetch`` does not apply).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    prefetch: bool = False
    tma: bool = False
    persistent: int = 0

    @classmethod
    def parse(cls, text: str) -> SwiGLUBlocks:
        """From ``"block_m,block_n,block_k,group_m,num_warps,num_stages,prefetch[,tma[,persistent]]"``
        (prefetch and tma 0 or 1)."""
        parts = text.split(",")
        if len(parts) not in (7, 8, 9) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{BLOCKS_ENV} must be 7 to 9 comma-separated integers, got {text!r}")
        v = [int(p) for p in parts] + [0] * (9 - len(parts))
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], prefetch=bool(v[6]), tma=bool(v[7]), persistent=v[8])

    def csv(self) -> str:
        """The :meth:`parse` form."""
        return ",".join(str(int(v)) for v in vars(self).values())


# The CUDA default: the fastest tiles of bench_swiglu.py's sweep on an H100 (2026-12-07: 2.43 ms at base's
# [180808 x 512] x [512 x 2048], against 3.18 ms for the best descriptor tiles and 4.04 ms for 128x128 tiles;
# gem-train BENCHMARKS.md). 254 registers, no spills (ptxas, sm_90).
CUDA_BLOCKS = SwiGLUBlocks(64, 64, 64, 8, 4, 3, prefetch=True)


def default_blocks(device: torch.device) -> SwiGLUBlocks:
    """The tiles a launch uses: ``$GEM_KERNELS_SWIGLU_BLOCKS`` if set, else :data:`CUDA_BLOCKS` on CUDA and
    the smallest legal tiles in the CPU interpreter."""
    text = os.environ.get(BLOCKS_ENV, "")
    if text:
        return SwiGLUBlocks.parse(text)
    if device.type == "cuda":
        return CUDA_BLOCKS
    return SwiGLUBlocks(16, 16, 16, group_m=2, num_warps=1, num_stages=1, prefetch=True)


@triton.jit
def _swiglu_backward_kernel(
    DY, W2, GU, DGU, Hout, M, H, K,
    stride_dy_m, stride_dy_k, stride_w_k, stride_w_n, stride_gu_m, stride_dgu_m, stride_h_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    if USE_TMA:
        _tma_tile(DY, W2, GU, DGU, Hout, M, H, K, stride_dy_m, stride_w_k, stride_gu_m, stride_dgu_m,
                  stride_h_m, pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_M, BLOCK_N, BLOCK_K, IEEE,
                  PREFETCH)  # fmt: skip
    else:
        _pointer_tile(DY, W2, GU, DGU, Hout, M, H, K, stride_dy_m, stride_dy_k, stride_w_k, stride_w_n,
                      stride_gu_m, stride_dgu_m, stride_h_m, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                      EVEN_K, IEEE, PREFETCH)  # fmt: skip


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile number ``tile``, tiles grouped by ``GROUP_M`` rows (L2 reuse of W2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _swiglu_backward_ws_kernel(
    DY, W2, GU, DGU, Hout, M, H, K, stride_dy_m, stride_w_k, stride_gu_m, stride_dgu_m, stride_h_m,
    NUM_PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Persistent: program ``p`` takes tiles ``p, p + NUM_PROGRAMS, ...``; the tile loop is warp-specialized
    (not flattened: Triton 3.6-3.7 specialize only the unflattened loop here). As in Triton's persistent
    matmul tutorial, the epilogue recomputes its tile from a counter of its own, which breaks the dependence
    between the loads of the next tile and the stores of this one."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    dy_d, w_d, gu_d, dgu_d, h_d = _descriptors(DY, W2, GU, DGU, Hout, M, H, K, stride_dy_m, stride_w_k,
                                               stride_gu_m, stride_dgu_m, stride_h_m, BLOCK_M, BLOCK_N,
                                               BLOCK_K)  # fmt: skip
    tile_c = start - NUM_PROGRAMS
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_PROGRAMS, warp_specialize=True):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):  # columns past K read as 0
            acc = _dot(dy_d.load([pid_m * BLOCK_M, ki * BLOCK_K]), w_d.load([ki * BLOCK_K, pid_n * BLOCK_N]),
                       acc, IEEE)  # fmt: skip
        tile_c += NUM_PROGRAMS
        pid_m, pid_n = _grouped_tile(tile_c, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        _tma_store(acc, gu_d.load([row0, col0]), gu_d.load([row0, H + col0]), DGU, dgu_d, h_d, row0, col0, H)


@triton.jit
def _epilogue(acc, gate, up):
    """The SwiGLU backward on the fp32 tile ``acc`` of dh: ``(dgate, dup, h)`` in fp32."""
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    return acc * up * sig * (1.0 + gate * (1.0 - sig)), acc * silu, silu * up


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _pointer_tile(DY, W2, GU, DGU, Hout, M, H, K, stride_dy_m, stride_dy_k, stride_w_k, stride_w_n,
                  stride_gu_m, stride_dgu_m, stride_h_m, pid_m, pid_n, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                  PREFETCH: tl.constexpr):  # fmt: skip
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < H
    a_ptrs = DY + rows[:, None] * stride_dy_m + ks[None, :] * stride_dy_k
    b_ptrs = W2 + ks[:, None] * stride_w_k + cols[None, :] * stride_w_n
    mask = row_ok[:, None] & col_ok[None, :]
    gu_ptrs = GU + rows[:, None] * stride_gu_m + cols[None, :]
    if PREFETCH:
        gate = tl.load(gu_ptrs, mask=mask, other=0.0)
        up = tl.load(gu_ptrs + H, mask=mask, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, IEEE)
        a_ptrs += BLOCK_K * stride_dy_k
        b_ptrs += BLOCK_K * stride_w_k
    # gate = gu[:, :H], up = gu[:, H:]
    if not PREFETCH:
        gate = tl.load(gu_ptrs, mask=mask, other=0.0)
        up = tl.load(gu_ptrs + H, mask=mask, other=0.0)
    dgate, dup, h = _epilogue(acc, gate, up)
    dt = DGU.dtype.element_ty
    dgu_ptrs = DGU + rows[:, None] * stride_dgu_m + cols[None, :]
    tl.store(dgu_ptrs, dgate.to(dt), mask=mask)
    tl.store(dgu_ptrs + H, dup.to(dt), mask=mask)
    tl.store(Hout + rows[:, None] * stride_h_m + cols[None, :], h.to(dt), mask=mask)


@triton.jit
def _desc(X, rows, cols, stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A ``[BLOCK_R, BLOCK_C]`` tensor descriptor over ``X`` ``[rows, cols]`` (row stride ``stride``)."""
    return tl.make_tensor_descriptor(
        X, shape=[rows, cols], strides=[stride, 1], block_shape=[BLOCK_R, BLOCK_C]
    )


@triton.jit
def _descriptors(DY, W2, GU, DGU, Hout, M, H, K, stride_dy_m, stride_w_k, stride_gu_m, stride_dgu_m,
                 stride_h_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """Descriptors of dy ``[M, K]``, W2 ``[K, H]``, gu and dgu ``[M, 2H]`` and h ``[M, H]``. The launcher
    checks ``H % BLOCK_N == 0``, so a gate tile never reaches into up's columns."""
    return (
        _desc(DY, M, K, stride_dy_m, BLOCK_M, BLOCK_K),
        _desc(W2, K, H, stride_w_k, BLOCK_K, BLOCK_N),
        _desc(GU, M, 2 * H, stride_gu_m, BLOCK_M, BLOCK_N),
        _desc(DGU, M, 2 * H, stride_dgu_m, BLOCK_M, BLOCK_N),
        _desc(Hout, M, H, stride_h_m, BLOCK_M, BLOCK_N),
    )


@triton.jit
def _tma_store(acc, gate, up, DGU, dgu_d, h_d, row0, col0, H):
    """The epilogue of the tile at ``(row0, col0)`` and its three stores through the descriptors."""
    dgate, dup, h = _epilogue(acc, gate, up)
    dt = DGU.dtype.element_ty
    dgu_d.store([row0, col0], dgate.to(dt))
    dgu_d.store([row0, H + col0], dup.to(dt))
    h_d.store([row0, col0], h.to(dt))


@triton.jit
def _tma_tile(DY, W2, GU, DGU, Hout, M, H, K, stride_dy_m, stride_w_k, stride_gu_m, stride_dgu_m,
              stride_h_m, row0, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              IEEE: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    dy_d, w_d, gu_d, dgu_d, h_d = _descriptors(DY, W2, GU, DGU, Hout, M, H, K, stride_dy_m, stride_w_k,
                                               stride_gu_m, stride_dgu_m, stride_h_m, BLOCK_M, BLOCK_N,
                                               BLOCK_K)  # fmt: skip
    if PREFETCH:
        gate = gu_d.load([row0, col0])
        up = gu_d.load([row0, H + col0])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # columns past K read as 0
        acc = _dot(dy_d.load([row0, k0]), w_d.load([k0, col0]), acc, IEEE)
    if not PREFETCH:
        gate = gu_d.load([row0, col0])
        up = gu_d.load([row0, H + col0])
    _tma_store(acc, gate, up, DGU, dgu_d, h_d, row0, col0, H)


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
        return swiglu_backward_reference(dy, w2, gu)
    b = blocks or default_blocks(dy.device)
    use_tma = b.tma and _tma_ok((dy, w2, gu, dgu, h), b)
    if use_tma:
        use_descriptor_scratch()
    tiles = triton.cdiv(m, b.block_m) * triton.cdiv(hidden, b.block_n)
    if use_tma and b.persistent > 0:
        launches["persistent"] += 1
        grid = persistent_grid(tiles, dy.device, b.persistent)
        _swiglu_backward_ws_kernel[grid](
            dy, w2, gu, dgu, h, m, hidden, k,
            dy.stride(0), w2.stride(0), gu.stride(0), dgu.stride(0), h.stride(0), grid[0],
            BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k, GROUP_M=b.group_m,
            IEEE=dy.dtype == torch.float32, num_warps=b.num_warps, num_stages=b.num_stages,
        )  # fmt: skip
        return dgu, h
    launches["tma" if use_tma else "pointer"] += 1
    grid = (tiles,)
    _swiglu_backward_kernel[grid](
        dy, w2, gu, dgu, h, m, hidden, k,
        dy.stride(0), dy.stride(1), w2.stride(0), w2.stride(1), gu.stride(0), dgu.stride(0), h.stride(0),
        BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k, GROUP_M=b.group_m,
        EVEN_K=k % b.block_k == 0, IEEE=dy.dtype == torch.float32, PREFETCH=b.prefetch,
        USE_TMA=use_tma,
        num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    return dgu, h


def _tma_ok(tensors: tuple[torch.Tensor, ...], b: SwiGLUBlocks) -> bool:
    """Whether the descriptors can address ``(dy, w2, gu, dgu, h)``: unit inner strides, 16-byte aligned rows
    and bases, and a hidden width (``w2``'s columns) in whole column tiles."""
    return tensors[1].shape[1] % b.block_n == 0 and all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in tensors
    )
