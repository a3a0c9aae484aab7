"""CPU timing of jagged attention, forward + backward: the per-sequence loop (``attention.reference``)
against the vectorized path (``attention.cpu``, what the custom ops run on the CPU).

Shapes follow the tiny GEM model (``gem-train``'s ``tiny-cpu`` config): ``B`` sequences with log-normal
lengths (mu 2.8, sigma 0.9, clipped to ``[1, max_len]``), ``H=2``, ``D=32``; self-attention (causal
softmax, causal silu GDPA) and cross-attention (a few PMA seed queries over each sequence; each sequence's
tokens over a few keys). Run: ``python packages/gem-kernels/benchmarks/bench_attention_cpu.py``.

``--forward`` times the forward alone (what inference runs) at the predict shapes (``--batch 1024 --dim 16``
for ``tiny``) three ways, alternating in one process: the padded groups with batched matmuls, the padded
groups through PyTorch's fused CPU kernel (softmax only), and the CSR products over the visible pairs
(``attention.cpu_sparse``); ``auto`` names the one ``attention.cpu`` picks. Each call starts with the memos
empty (the index plans and patterns a model's later calls reuse), so these are first-call costs.

``--backward`` times the backward alone at the training shapes (``--dim 16`` for ``tiny``), the forward's
``out`` and LSE given as the autograd op gives them, alternating in one process: the padded groups with
batched matmuls (the backward before 2026-12-07, every call) against what ``attention.cpu`` picks now (the CSR
backward for a short side, the fused kernel's backward for fp32 softmax, else the matmuls). Plans and
patterns stay memoised, as in a training step (the forward built them).
"""

from __future__ import annotations

import argparse
import functools

import torch
from common import timeit

from gem_kernels.attention import cpu, cpu_groups, cpu_sparse, reference


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = lengths.cumsum(0)
    return out


def _case(lq: torch.Tensor, lk: torch.Tensor, heads: int, dim: int, g: torch.Generator):
    q = torch.randn(int(lq.sum()), heads, dim, generator=g)
    k = torch.randn(int(lk.sum()), heads, dim, generator=g)
    v = torch.randn(int(lk.sum()), heads, dim, generator=g)
    dout = torch.randn_like(q)
    return q, k, v, dout, _offsets(lq), _offsets(lk)


def _fwd_bwd(impl, q, k, v, dout, qo, ko, act, left, right):
    args = (q, k, v, qo, ko, act, left, right, q.shape[2] ** -0.5, 1.0 / 64)
    impl.attention_fwd(*args)
    impl.attention_bwd(dout, *args)


def _forward_only(q, k, v, dout, qo, ko, act, left, right, mode: str) -> None:
    """One forward with the memos empty; ``mode``: "matmul" / "fused" (padded groups, the fused kernel
    off / on) or "csr"."""
    saved = cpu._FLASH_CPU, cpu_sparse.SHORT_SIDE
    cpu._FLASH_CPU = None if mode == "matmul" else saved[0]
    cpu_sparse.SHORT_SIDE = 10**9 if mode == "csr" else 0
    cpu_groups.PLANS.clear()
    cpu_sparse._PATTERNS.clear()
    try:
        cpu.attention_fwd(q, k, v, qo, ko, act, left, right, q.shape[2] ** -0.5, 1.0 / 64)
    finally:
        cpu._FLASH_CPU, cpu_sparse.SHORT_SIDE = saved


def _backward_only(dout, q, k, v, qo, ko, act, left, right, out, lse, mode: str) -> None:
    """One backward; ``mode``: "matmul" (padded batched matmuls, whatever the call) or "auto"."""
    args = (q, k, v, qo, ko, act, left, right, q.shape[2] ** -0.5, 1.0 / 64)
    if mode == "auto":
        cpu.attention_bwd(dout, *args, out=out, lse=lse)
        return
    saved = cpu_sparse.SHORT_SIDE
    cpu_sparse.SHORT_SIDE = 0
    try:
        cpu.attention_bwd(dout, *args)
    finally:
        cpu_sparse.SHORT_SIDE = saved


def _backward_table(cases, args, g) -> None:
    print(f"{'case (backward only)':<26} {'matmul ms':>9} {'auto ms':>9} {'ratio':>6} {'auto takes':>11}")
    for name, lq, lk, act, left, right in cases:
        q, k, v, dout, qo, ko = _case(lq, lk, args.heads, args.dim, g)
        out, lse = cpu.attention_fwd(q, k, v, qo, ko, act, left, right, q.shape[2] ** -0.5, 1.0 / 64)
        ms = {mode: [] for mode in ("matmul", "auto")}
        for _ in range(args.rounds):  # alternating: this machine's load drifts between runs
            for mode in ms:
                tensors = (dout, q, k, v, qo, ko, act, left, right, out, lse)
                ms[mode].append(timeit(functools.partial(_backward_only, *tensors, mode), args.iters))
        m, a = (sorted(ms[mode])[len(ms[mode]) // 2] for mode in ("matmul", "auto"))
        takes = (
            "csr"
            if cpu_sparse.applies(int(lq.max()), int(lk.max()))
            else ("fused" if act == "softmax" else "matmul")
        )
        print(f"{name:<26} {m:>9.2f} {a:>9.2f} {m / a:>5.2f}x {takes:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=4, help="PMA queries per sequence")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--forward", action="store_true", help="forward only: fused kernel vs batched matmul")
    parser.add_argument("--backward", action="store_true", help="backward only: before (matmul) vs now")
    parser.add_argument("--rounds", type=int, default=5, help="--backward: alternating rounds (median)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hist = torch.exp(torch.randn(args.batch, generator=g) * 0.9 + 2.8).long().clamp(1, args.max_len)
    few = torch.full_like(hist, args.seeds)
    cases = [
        ("self causal softmax", hist, hist, "softmax", -1, 0),
        ("self causal silu", hist, hist, "silu", -1, 0),
        ("cross PMA: seeds x hist", few, hist, "softmax", -1, -1),
        ("cross: hist x seeds", hist, few, "softmax", -1, -1),
    ]
    if args.forward or args.backward:
        cases = [
            ("self causal softmax", hist, hist, "softmax", -1, 0),
            ("self window 16 softmax", hist, hist, "softmax", 16, 0),
            ("PMA: seeds x hist", few, hist, "softmax", -1, -1),
            ("context: hist x 6, silu", hist, torch.full_like(hist, 6), "silu", -1, -1),
        ]
        if cpu._FLASH_CPU is None:
            raise SystemExit("this torch has no fused CPU flash-attention kernel")
    print(
        f"B={args.batch} H={args.heads} D={args.dim} lengths log-normal(2.8, 0.9) in [1, {args.max_len}] "
        f"(mean {hist.float().mean():.1f}), threads={torch.get_num_threads()}, fp32, "
        f"{'forward' if args.forward else 'backward' if args.backward else 'fwd+bwd'}, median of "
        f"{args.iters}"
    )
    if args.backward:
        _backward_table(cases, args, g)
        return
    if args.forward:
        print(f"{'case (forward only)':<26} {'matmul ms':>9} {'fused ms':>9} {'CSR ms':>8} {'auto':>6}")
        for name, lq, lk, act, left, right in cases:
            tensors = _case(lq, lk, args.heads, args.dim, g)
            ms = {
                mode: timeit(functools.partial(_forward_only, *tensors, act, left, right, mode), args.iters)
                for mode in ("matmul", "fused", "csr")
            }
            fused = f"{ms['fused']:>9.2f}" if act == "softmax" else f"{'-':>9}"
            auto = "csr" if cpu_sparse.applies(int(lq.max()), int(lk.max())) else "padded"
            print(f"{name:<26} {ms['matmul']:>9.2f} {fused} {ms['csr']:>8.2f} {auto:>6}")
        return
    print(f"{'case':<26} {'loop ms':>9} {'vectorized ms':>14} {'speed-up':>9}")
    for name, lq, lk, act, left, right in cases:
        tensors = _case(lq, lk, args.heads, args.dim, g)
        loop, vec = (
            timeit(functools.partial(_fwd_bwd, impl, *tensors, act, left, right), args.iters)
            for impl in (reference, cpu)
        )
        print(f"{name:<26} {loop:>9.2f} {vec:>14.2f} {loop / vec:>8.1f}x")


if __name__ == "__main__":
    main()
