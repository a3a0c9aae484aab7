"""Does Triton's automatic Hopper warp specialization (``tl.range(..., warp_specialize=True)``, Triton >= 3.4)
take on the loop shapes of gem's attention backward? Compiled offline for sm_90 (no GPU needed), one line
per case: whether it compiled and whether the PTX holds ``setmaxnreg`` (the register split between producer
and consumer warp groups that warp specialization emits).

The cases are a TMA-descriptor GEMM loop (``ad.load`` / ``bd.load`` + ``tl.dot``, one tile per program), the
same with a pointer load in the loop (as ``LSE``/``DELTA`` in dK/dV), two such loops in one program (the
backward runs three band ranges: masked, full, masked) and one loop inside a ``while`` loop (the persistent
kernels' item loop). Issue 37 asked whether the persistent backward can take warp specialization; the
answer depends on the last two cases.

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-kernels/benchmarks/ws_probe_sm90.py
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _probe(A, B, C, LSE, M, N, K, n_items,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           PTR_LOAD: tl.constexpr, TWO_LOOPS: tl.constexpr, IN_WHILE: tl.constexpr):  # fmt: skip
    ad = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    bd = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    cd = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    w = tl.program_id(0)
    stop = n_items if IN_WHILE else w + 1
    while w < stop:
        pid_m = w % 16
        pid_n = w // 16
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in tl.range(0, K, BK, warp_specialize=True):
            s = tl.dot(ad.load([pid_m * BM, k]), tl.trans(bd.load([pid_n * BN, k])))
            if PTR_LOAD:
                s = s - tl.load(LSE + k + tl.arange(0, BN))[None, :]
            acc += s
        if TWO_LOOPS:
            for k in tl.range(0, K, BK, warp_specialize=True):
                acc += tl.dot(ad.load([pid_m * BM, k]), tl.trans(bd.load([pid_n * BN, k])))
        cd.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))
        w += tl.num_programs(0)


@triton.jit
def _probe_flat(A, B, C, LSE, M, N, K, n_items,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PTR_LOAD: tl.constexpr, TWO_LOOPS: tl.constexpr, IN_WHILE: tl.constexpr):  # fmt: skip
    """The loop at the top of the program (no ``while``): one tile per program."""
    ad = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    bd = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    cd = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in tl.range(0, K, BK, warp_specialize=True):
        s = tl.dot(ad.load([pid_m * BM, k]), tl.trans(bd.load([pid_n * BN, k])))
        if PTR_LOAD:
            s = s - tl.load(LSE + k + tl.arange(0, BN))[None, :]
        acc += s
    if TWO_LOOPS:
        for k in tl.range(0, K, BK, warp_specialize=True):
            acc += tl.dot(ad.load([pid_m * BM, k]), tl.trans(bd.load([pid_n * BN, k])))
    cd.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


def run_case(index: int) -> None:
    sig = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "LSE": "*fp32", "M": "i32", "N": "i32", "K": "i32",
           "n_items": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "PTR_LOAD": "constexpr",
           "TWO_LOOPS": "constexpr", "IN_WHILE": "constexpr"}  # fmt: skip
    cases = [
        ("one descriptor loop", _probe_flat, False, False, False),
        ("+ a pointer load in the loop", _probe_flat, True, False, False),
        ("two loops in one program", _probe_flat, False, True, False),
        ("one loop inside a while loop", _probe, False, False, False),
        ("inside a persistent while loop", _probe, False, False, True),
    ]
    label, fn, ptr, two, in_while = cases[index]
    consts = {"BM": 128, "BN": 128, "BK": 64, "PTR_LOAD": ptr, "TWO_LOOPS": two, "IN_WHILE": in_while}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    try:
        k = triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 3})  # fmt: skip
        ptx = k.asm["ptx"]
        took = "warp-specialized" if "setmaxnreg" in ptx else "NOT specialized"
        print(f"  {label:34s}: compiled, {took} (setmaxnreg {ptx.count('setmaxnreg')})", flush=True)
    except Exception as e:  # the pass fails on some loop shapes: that is the finding
        print(f"  {label:34s}: FAILED to compile: {str(e).splitlines()[-1][:120]}", flush=True)


CASES = 5


def main() -> None:
    """Each case in its own process: a failed assertion in the compiler may abort the process."""
    import subprocess
    import sys

    print(f"triton {triton.__version__}, sm_90, 4 warps, 3 stages, 128x128x64 bf16 tiles", flush=True)
    for i in range(CASES):
        proc = subprocess.run([sys.executable, __file__, str(i)], capture_output=True, text=True, timeout=300)
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        print(line if line else f"  case {i}: the compiler process died (exit {proc.returncode})", flush=True)


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        run_case(int(sys.argv[1]))
    else:
        main()
