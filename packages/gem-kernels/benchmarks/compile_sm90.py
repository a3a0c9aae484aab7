"""Compiles the jagged attention kernels for sm_90 (Hopper) without a GPU and reports what the compiler
made of them: TMA copies (``cp.async.bulk.tensor``), ``cp.async`` copies (software-pipelined pointer
loads), ``wgmma`` instructions, shared memory, and ``setmaxnreg`` (present when warp specialization took).

Catches compile errors of the Hopper-only paths (TMA descriptors, warp specialization) on a CPU machine;
the installed Triton may differ from the one on the GPU. bf16, D = Dv = 128, 8 warps, 3 stages. ``fp32``
compiles the tiled kernels' fp32 candidates (exact products: FMA dots) and prints each one's compile time
(the first-call cost of an fp32 bucket) and FMA count per thread, with ``--warps N`` to compare warp counts.
``--ptx-dir DIR`` writes each kernel's PTX there without its debug information (``.loc``/``.file`` lines,
``$L__tmp`` labels, the DWARF sections: they follow the source lines), so that a refactoring of the
kernels' Triton source can be shown to leave the generated code unchanged (``diff -r BEFORE AFTER``).

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-kernels/benchmarks/compile_sm90.py [fwd dq dkdv tiled fp32] [--warps N] \\
        [--ptx-dir DIR]
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gem_kernels.triton_kernels import attention_bwd as triton_bwd
from gem_kernels.triton_kernels import attention_fwd as triton_fwd
from gem_kernels.triton_kernels import attention_persistent as triton_persistent

_BF16 = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV_"}
PTX_DIR: str | None = None  # --ptx-dir
_DEBUG_LINE = re.compile(r"^\s*(\.(loc|file)\b.*|\$L__tmp\d+:\s*)$\n?", re.MULTILINE)


def code_only(ptx: str) -> str:
    """The PTX without its debug information (see the module docstring)."""
    cut = re.search(r"^\s*\.section\s+\.debug", ptx, re.MULTILINE)
    return _DEBUG_LINE.sub("", ptx[: cut.start()] if cut else ptx)


_PTR32 = {"q_offsets", "kv_offsets", "tiles", "count", "counter"}


def signature(fn: Any, consts: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in _BF16:
            sig[name] = "*bf16"
        elif name in ("LSE", "DELTA"):
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
    label: str, fn: Any, consts: dict[str, Any], fp32: bool = False, num_warps: int = 8, num_stages: int = 3
) -> None:
    t0 = time.time()
    sig = signature(fn, consts)
    if fp32:
        sig = {name: "*fp32" if ty == "*bf16" else ty for name, ty in sig.items()}
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
        f"smem {k.metadata.shared}  setmaxnreg {ptx.count('setmaxnreg')}  fma {ptx.count('fma.rn.f32')}",
        flush=True,
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
    global PTX_DIR
    args = sys.argv[1:]
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
        if name == "fp32":
            from gem_kernels.triton_kernels.attention import _CANDIDATES_FP32

            seen = set()
            for kname, classes in _CANDIDATES_FP32.items():
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
        for act, tma, ws in [
            (0, False, False),
            (0, True, False),
            (1, False, False),
            (1, True, False),
            (1, True, True),
        ]:
            consts = dict(base, ACT=act, BLOCK_M=bm, BLOCK_N=bn, FAST_ACT=act == 1, USE_TMA=tma, WS=ws)
            report(f"persistent {name} act={act} tma={tma} ws={ws}", fn, consts)


if __name__ == "__main__":
    main()
