"""Compiles the jagged attention kernels for sm_90 (Hopper) without a GPU and reports what the compiler
made of them: TMA copies (``cp.async.bulk.tensor``), ``cp.async`` copies (software-pipelined pointer
loads), ``wgmma`` instructions, shared memory, and ``setmaxnreg`` (present when warp specialization took).

Catches compile errors of the Hopper-only paths (TMA descriptors) on a CPU machine;
the installed Triton may differ from the one on the GPU. bf16, D = Dv = 128, 8 warps, 3 stages. ``fp32``
compiles the tiled kernels' fp32 candidates (exact products: FMA dots) and prints each one's compile time
(the first-call cost of an fp32 bucket) and FMA count per thread, with ``--warps N`` to compare warp counts.
``onetile`` compiles the one-tile kernels of cross-attention (``short_kv``, 64 keys: forward and backward)
and PMA (``few_q``, 32 queries: backward), whole-stream and split, and the split's partial-sum kernel, at
their autotune candidates (:mod:`gem_kernels.attention.variants`), and adds ptxas's registers and
spills per thread (``ptxas -v``, also with ``--regs`` for the other modes).
``--ptx-dir DIR`` writes each kernel's PTX there without its debug information (``.loc``/``.file`` lines,
``$L__tmp`` labels, the DWARF sections: they follow the source lines), so that a refactoring of the
kernels' Triton source can be shown to leave the generated code unchanged (``diff -r BEFORE AFTER``).

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-kernels/benchmarks/compile_sm90.py [fwd dq dkdv tiled fp32] [--warps N] \\
        [--ptx-dir DIR] [--regs] [onetile]
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

import triton
from sm90_offline import code_only, usage_line  # this folder (the script's) is on sys.path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gem_kernels.attention import variants
from gem_kernels.attention.triton import bwd as triton_bwd
from gem_kernels.attention.triton import fwd as triton_fwd
from gem_kernels.attention.triton import onetile as triton_onetile
from gem_kernels.attention.triton import persistent as triton_persistent

_BF16 = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV_", "X"}
_FP32 = {"LSE", "DELTA", "DK_part", "DV_part", "DQ_part", "Part"}
PTX_DIR: str | None = None  # --ptx-dir
REGS = False  # --regs (always for onetile)


_PTR32 = {"q_offsets", "kv_offsets", "offsets", "chunk_starts", "tiles", "count", "counter"}


def signature(fn: Any, consts: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in _BF16:
            sig[name] = "*bf16"
        elif name in _FP32:
            sig[name] = "*fp32"
        elif name in _PTR32:
            sig[name] = "*i32"
        elif name in ("qk_scale", "out_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def divisible(fn: Any, sig: dict[str, str]) -> dict[tuple[int, ...], list[list[Any]]]:
    """The hints the JIT gives 16-aligned pointers and strides that are multiples of 16 (H*D, D)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name].startswith("*") or name.startswith("stride_")
    }


def report(
    label: str,
    fn: Any,
    consts: dict[str, Any],
    fp32: bool = False,
    num_warps: int = 8,
    num_stages: int = 3,
    regs: bool = False,
    fp32_args: frozenset[str] = frozenset(),
) -> None:
    """Compile ``fn`` for sm_90 and print what the compiler made of it; ``fp32``: every bf16 pointer fp32,
    ``fp32_args``: only those."""
    t0 = time.time()
    sig = signature(fn, consts)
    if fp32:
        sig = {name: "*fp32" if ty == "*bf16" else ty for name, ty in sig.items()}
    sig = {name: "*fp32" if name in fp32_args else ty for name, ty in sig.items()}
    try:
        k = triton.compile(
            ASTSource(fn, sig, consts, attrs=divisible(fn, sig)),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=num_warps, num_stages=num_stages),
        )
    except Exception as e:
        print(f"{label}: FAIL {type(e).__name__}: {str(e)[:1000]}", flush=True)
        return
    ptx = k.asm["ptx"]
    if PTX_DIR is not None:
        os.makedirs(PTX_DIR, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)
        with open(os.path.join(PTX_DIR, f"{name}.ptx"), "w") as f:
            f.write(code_only(ptx))
    print(
        f"{label}: ok {time.time() - t0:.0f}s  tma {ptx.count('cp.async.bulk.tensor')}  "
        f"cp.async {ptx.count('cp.async.cg') + ptx.count('cp.async.ca')}  "
        f"wgmma {ptx.count('wgmma.mma_async')}  "
        f"smem {k.metadata.shared}  setmaxnreg {ptx.count('setmaxnreg')}  fma {ptx.count('fma.rn.f32')}"
        + (f"  {usage_line(ptx)}" if regs or REGS else ""),
        flush=True,
    )


def report_onetile(base: dict[str, Any]) -> None:
    """The one-tile kernels (the short_kv forward; the backward, whole-stream and split) at their autotune
    candidates (``variants.*_CANDIDATES``: streamed tile, warps, stages), silu (the benchmark's cross/PMA
    activation, hardware tanh) and softmax; resident tile 64 keys (short_kv) or 32 queries (few_q); then the
    partial sums."""
    short_kv, few_q = variants.SHORT_KV_BWD_CANDIDATES, variants.FEW_Q_BWD_CANDIDATES
    kernels = [
        (
            "fwd_short_kv",
            triton_onetile.fwd_short_kv_kernel,
            "BLOCK_M",
            {"BLOCK_N": 64},
            variants.FWD_SHORT_KV_CANDIDATES,
        ),
        ("bwd_short_kv", triton_onetile.bwd_short_kv_kernel, "BLOCK_M", {"BLOCK_N": 64}, short_kv),
        (
            "bwd_short_kv_split",
            triton_onetile.bwd_short_kv_split_kernel,
            "BLOCK_M",
            {"BLOCK_N": 64},
            short_kv,
        ),
        ("bwd_few_q", triton_onetile.bwd_few_q_kernel, "BLOCK_N", {"BLOCK_M": 32}, few_q),
        ("bwd_few_q_split", triton_onetile.bwd_few_q_split_kernel, "BLOCK_N", {"BLOCK_M": 32}, few_q),
    ]
    for label, fn, stream, resident, candidates in kernels:
        for blk, w, st in candidates:
            for act in (1, 0):
                consts = dict(base, ACT=act, FAST_ACT=act == 1, **resident, **{stream: blk})
                if "split" in label:
                    consts["LOG_B"] = 10  # B = 1024
                report(
                    f"{label} {stream}={blk} w{w} s{st} act={act}",
                    fn,
                    consts,
                    num_warps=w,
                    num_stages=st,
                    regs=True,
                )
    for rows in (64, 32):
        consts = dict(D=128, BLOCK_R=rows, BLOCK_D=128)
        report(
            f"sum_chunk_partials BLOCK_R={rows} w4",
            triton_onetile.sum_chunk_partials_kernel,
            consts,
            num_warps=4,
            num_stages=3,
            regs=True,
        )


def main() -> None:
    persistent = {
        "fwd": (triton_persistent.fwd_persistent_kernel, 128, 64),
        "dq": (triton_persistent.dq_persistent_kernel, 128, 64),
        "dkdv": (triton_persistent.dkdv_persistent_kernel, 64, 128),
    }
    tiled = {
        "fwd": (triton_fwd.fwd_kernel, 128, 64),
        "dq": (triton_bwd.dq_kernel, 128, 64),
        "dkdv": (triton_bwd.dkdv_kernel, 64, 128),
    }
    global PTX_DIR, REGS
    args = sys.argv[1:]
    if "--regs" in args:
        REGS = True
        args.remove("--regs")
    if "--ptx-dir" in args:
        i = args.index("--ptx-dir")
        PTX_DIR = args[i + 1]
        del args[i : i + 2]
    warps = None
    if "--warps" in args:
        i = args.index("--warps")
        warps = int(args[i + 1])
        del args[i : i + 2]
    which = args or [*persistent, "tiled"]
    base = dict(D=128, DV=128, BLOCK_D=128, BLOCK_DV=128, PRECISION="tf32")
    for name in which:
        if name == "onetile":
            report_onetile(base)
            continue
        if name == "fp32":
            seen = set()
            for kname, classes in variants.CANDIDATES_FP32.items():
                for cls, cands in classes.items():
                    for bm, bn, w, st in cands:
                        w = warps or w
                        if (kname, bm, bn, w, st) in seen:
                            continue
                        seen.add((kname, bm, bn, w, st))
                        consts = dict(base, PRECISION="ieee", ACT=0, BLOCK_M=bm, BLOCK_N=bn, FAST_ACT=False)
                        report(
                            f"fp32 {kname} {cls} {bm}x{bn} w{w} s{st}", tiled[kname][0], consts, True, w, st
                        )
            continue
        if name == "tiled":
            for kname, (fn, bm, bn) in tiled.items():
                for act in (0, 1):
                    consts = dict(base, ACT=act, BLOCK_M=bm, BLOCK_N=bn, FAST_ACT=act == 1)
                    report(f"tiled {kname} act={act}", fn, consts)
            continue
        fn, bm, bn = persistent[name]
        for act, tma in [(0, False), (0, True), (1, False), (1, True)]:
            consts = dict(base, ACT=act, BLOCK_M=bm, BLOCK_N=bn, FAST_ACT=act == 1, USE_TMA=tma)
            if "WS" in fn.arg_names:  # a checkout from before tma_ws was removed (always off since)
                consts["WS"] = False
            report(f"persistent {name} act={act} tma={tma}", fn, consts)


if __name__ == "__main__":
    main()
