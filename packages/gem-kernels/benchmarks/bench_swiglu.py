"""The SwiGLU feed-forward, forward + backward, at GEM trunks' shapes: the fused backward kernel
(gem_kernels.swiglu_ffn) against the composition PyTorch runs, eager and under torch.compile (inductor's
default, and ``max-autotune-no-cudagraphs``: inductor's own Triton GEMM templates with epilogue fusion).

Workloads (bf16, one layer's FFN): ``base`` = base-h200's (M = 180,808 history tokens of a 512-user batch,
d 512, H 2048); ``large`` = large-h200's (M = 36,208, d 1024, H 4096). Rows:

- ``step``: the backward step alone, ``dh = dy @ W2`` + the activation's backward + ``h``: cuBLAS mm and
  inductor's fused pointwise kernel (what the model's compiled backward runs) against the fused kernel,
  with each kernel config of ``--sweep``; GB/s counts the fused kernel's bytes (dy, W2, gu in; dgu, h out).
- ``ffn``: forward + backward of the whole FFN under each implementation; TFLOP/s counts the 6 GEMMs'
  ``6 * M * d * 3H`` FLOPs (forward and backward).

Usage: ``python packages/gem-kernels/benchmarks/bench_swiglu.py [--workloads base,large] [--sweep]
[--autotune] [--out FILE]``. Prints one line per row and writes JSON when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from common import timeit

from gem_kernels import swiglu_ffn
from gem_kernels.swiglu.reference import swiglu_ffn_reference
from gem_kernels.swiglu.triton import BLOCKS_ENV, SwiGLUBlocks, default_blocks, swiglu_backward_triton

WORKLOADS = {"base": (180_808, 512, 2048), "large": (36_208, 1024, 4096), "small": (1000, 64, 128)}
# (block_m, block_n, block_k, group_m, num_warps, num_stages): tensor-descriptor tiles with and without the
# gate/up prefetch, a few pointer ones. Chosen offline (ptxas for sm_90, no GPU): call 1 of 2026-12-07 ran
# 128x128 tiles at 255 registers with ~1 KB of spills per thread (896 GB/s); the epilogue's five fp32 tiles
# and the pointer tensors' 64-bit addresses are the registers, and pointer loads were not pipelined (the
# shared memory of one stage). Descriptor loads: 128x64 or 64x128 on 8 warps take 171-184 registers, 64x64
# on 4 warps 165-172, no spills.
_TMA_TILES = [
    (128, 64, 64, 8, 8, 3),
    (128, 64, 64, 8, 8, 2),
    (64, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 8, 2),
    (64, 64, 64, 8, 4, 3),
    (64, 64, 64, 8, 4, 2),
    (128, 128, 64, 8, 8, 3),
]
# The persistent warp-specialized kernel: tiles that Triton specializes without spills (ptxas, sm_90).
WS_SWEEP = [
    SwiGLUBlocks(64, 64, 64, 8, 4, stages, tma=True, persistent=per_sm)
    for stages in (2, 3, 4)
    for per_sm in (1, 2, 3)
]
SWEEP = [
    SwiGLUBlocks(),
    SwiGLUBlocks(128, 64, 64, 8, 8, 3),
    SwiGLUBlocks(128, 64, 64, 8, 8, 3, prefetch=True),
    SwiGLUBlocks(64, 64, 64, 8, 4, 3, prefetch=True),
    *(SwiGLUBlocks(*t, prefetch=p, tma=True) for t in _TMA_TILES for p in (False, True)),
    *WS_SWEEP,
]
_SWEEP_AFTER_FIRST = 4  # later workloads time only the first workload's fastest few


def _unfused_step(dy: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dh = dy @ w2
    gate, up = gu.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgu = torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * silu], dim=-1).to(gu.dtype)
    return dgu, (silu * up).to(gu.dtype)


def _rows(name: str, m: int, d: int, hidden: int, args: argparse.Namespace) -> list[dict]:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(m, d, device=dev, dtype=bf, generator=g)
    w13 = (torch.randn(2 * hidden, d, device=dev, generator=g) / d**0.5).to(bf)
    w2 = (torch.randn(d, hidden, device=dev, generator=g) / hidden**0.5).to(bf)
    dy = torch.randn(m, d, device=dev, dtype=bf, generator=g)
    gu = x @ w13.t()
    rows: list[dict] = []
    step_bytes = 2 * (m * d + d * hidden + m * 2 * hidden + m * 2 * hidden + m * hidden)

    def row(kind: str, impl: str, ms: float, **extra) -> None:
        r = {"workload": name, "M": m, "d": d, "H": hidden, "kind": kind, "impl": impl, "ms": ms, **extra}
        if kind == "step":
            r["gb_s"] = step_bytes / ms / 1e6
        else:
            r["tflops"] = 6 * m * d * 3 * hidden / ms / 1e9
        rows.append(r)
        more = " ".join(f"{k}={v}" for k, v in extra.items())
        rate = f"{r['gb_s']:.0f} GB/s" if kind == "step" else f"{r['tflops']:.0f} TFLOP/s"
        head = f"{name:6s} M={m} d={d} H={hidden} {kind:4s} {impl:34s}"
        print(f"{head} {ms:8.3f} ms  {rate}  {more}", flush=True)

    # The backward step alone.
    compiled_step = torch.compile(_unfused_step, dynamic=False)
    ref_dgu, ref_h = compiled_step(dy, w2, gu)
    base_ms = timeit(lambda: compiled_step(dy, w2, gu), args.iters)
    row("step", "cuBLAS mm + inductor pointwise", base_ms)
    dh_ms = timeit(lambda: dy @ w2, args.iters)
    row("step", "  of which the cuBLAS mm", dh_ms)
    candidates = [default_blocks(x.device)]
    if args.blocks:
        candidates = args.shortlist or [SwiGLUBlocks.parse(t) for t in args.blocks.split(";")]
    elif args.sweep:
        candidates = args.shortlist or SWEEP
    for blocks in candidates:
        try:
            dgu, h = swiglu_backward_triton(dy, w2, gu, blocks)
            err = max(
                float((dgu.float() - ref_dgu.float()).norm() / ref_dgu.float().norm()),
                float((h.float() - ref_h.float()).norm() / ref_h.float().norm()),
            )
            ms = timeit(lambda b=blocks: swiglu_backward_triton(dy, w2, gu, b), args.iters)
        except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
            print(f"{name} blocks {blocks}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        b = blocks
        tag = f"fused {b.block_m}x{b.block_n}x{b.block_k} w{b.num_warps} s{b.num_stages} p{int(b.prefetch)}"
        tag += " tma" if b.tma else ""
        tag += f" persistent x{b.persistent}" if b.persistent else ""
        row("step", tag, ms, vs_unfused=round(base_ms / ms, 3), rel_err_vs_unfused=f"{err:.1e}")
        rows[-1]["blocks"] = b.csv()
    fused = sorted((r for r in rows if "blocks" in r), key=lambda r: r["ms"])
    if fused:
        best = fused[0]
        if (args.sweep or args.blocks) and not args.shortlist:
            args.shortlist = [SwiGLUBlocks.parse(r["blocks"]) for r in fused[:_SWEEP_AFTER_FIRST]]
        if args.sweep or args.blocks:  # the FFN rows below run the fastest tiles of this workload
            os.environ[BLOCKS_ENV] = best["blocks"]
        print(f"best {name} {best['blocks']} {best['ms']:.3f} ms {best['vs_unfused']}x", flush=True)

    if args.steps_only:
        return rows
    # The whole FFN, forward + backward.
    leaves = [t.clone().requires_grad_(True) for t in (x, w13, w2)]
    dy_out = torch.randn(m, d, device=dev, dtype=bf, generator=g)

    def fwd_bwd(fn):
        def run() -> None:
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(dy_out)

        return run

    impls = {
        "eager composition": swiglu_ffn_reference,
        "compiled composition (default)": torch.compile(swiglu_ffn_reference, dynamic=False),
        "eager fused": lambda a, b, c: swiglu_ffn(a, b, c, backend="triton"),
        "compiled fused (default)": torch.compile(lambda a, b, c: swiglu_ffn(a, b, c, backend="triton"),
                                                  dynamic=False),
    }  # fmt: skip
    if args.autotune:
        impls["compiled composition (max-autotune)"] = torch.compile(
            swiglu_ffn_reference, mode="max-autotune-no-cudagraphs", dynamic=False
        )
    results = {}
    for impl, fn in impls.items():
        t0 = time.perf_counter()
        fwd_bwd(fn)()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        results[impl] = [t.grad.float().clone() for t in leaves]
        ms = timeit(fwd_bwd(fn), args.iters)
        ref = results["eager composition"]
        err = max(float((a - b).norm() / b.norm()) for a, b in zip(results[impl], ref))
        row("ffn", impl, ms, first_call_s=round(first_s, 1), grad_rel_diff_vs_eager=f"{err:.1e}")
    by = {r["impl"]: r["ms"] for r in rows if r["kind"] == "ffn"}
    ratio = by["compiled composition (default)"] / by["compiled fused (default)"]
    print(f"{name}: compiled fused vs compiled composition: {ratio:.3f}x", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="base,large")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="time every kernel config of SWEEP")
    p.add_argument("--blocks", default="", help="time these tiles (';'-separated SwiGLUBlocks.parse forms)")
    p.add_argument("--steps-only", action="store_true", help="only the backward step rows")
    p.add_argument("--autotune", action="store_true", help="also inductor's max-autotune (slow to compile)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    args.shortlist = []
    if not torch.cuda.is_available():
        raise SystemExit("bench_swiglu needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = []
    for name in args.workloads.split(","):
        rows += _rows(name, *WORKLOADS[name], args)
    if args.out:
        with open(args.out, "w") as f:
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
