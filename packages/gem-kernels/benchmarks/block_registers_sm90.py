"""Register use of the block-attention kernels on sm_90 (Hopper), measured offline (no GPU needed).

Compiles ``_block_attention_fwd`` and ``_block_attention_bwd`` of :mod:`gem_kernels.block.triton` for
``GPUTarget("cuda", 90, 32)`` at the benchmark shape (bf16, D = Dv = 128, block 64, B = 1152 sequences of
at most 2000 tokens, H = 4), with the module's launch settings (``launch_settings()``: warps, stages, heads
per program, the backward's register cap) and the constexprs its own ``launch_args`` computes, in three
rotary modes: none, default positions (angles from the token index) and real-valued positions
(``HAS_POS``, angles from a loaded fp32 position). Then runs the ptxas that ships with Triton on each
kernel's PTX with Triton's own flags and prints, per kernel: warps, registers per thread, spill
stores/loads (bytes), stack frame, static+dynamic shared memory, and how many programs of it fit on one SM
by registers (65536 per SM, allocated per warp in units of 256).

The installed Triton and ptxas may differ from the GPU machine's (the H200 figures in BENCHMARKS.md were
taken with triton 3.6); compare before/after on the same machine. ``--source FILE`` compiles the kernels
of another copy of ``block/triton.py`` (e.g. ``git show HEAD:<path> > /tmp/block_head.py``), for a
before/after table; ``--head-group N``, ``--fwd-warps N``, ``--bwd-warps N``, ``--maxnreg N`` (backward)
override the module's settings, ``--set NAME=INT`` any other integer field of its ``LaunchSettings``;
``--causal`` compiles the causal variants; ``--ptx-dir DIR`` writes each kernel's PTX without debug
information (diff two of them to show that a change leaves a kernel's code as it was).

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-kernels/benchmarks/block_registers_sm90.py [--source FILE] [--head-group N] \\
        [--fwd-warps N] [--bwd-warps N] [--maxnreg N] [--causal] [--ptx-dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from typing import Any

import torch
import triton
from sm90_offline import code_only, ptxas_usage  # this folder (the script's) is on sys.path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import gem_kernels.block.triton as block_module

# The benchmark shape of BENCHMARKS.md ("Block attention and jagged helpers").
BATCH, HEADS, HEAD_DIM, BLOCK_SIZE, MAX_LEN, MIN_LEN = 1152, 4, 128, 64, 2000, 800
REGS_PER_SM, REG_UNIT, MAX_WARPS_PER_SM = 65536, 256, 64

_BF16 = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"}
_I32_PTR = {"offsets_ptr", "block_starts_ptr"}
_F32_PTR = {"positions_ptr", "inv_freq_ptr"}
_F32 = {"scale_log2e", "scale"}


def load_module(path: str | None) -> Any:
    """The block-kernel module: this checkout's, or the copy of ``block/triton.py`` at ``path``."""
    if path is None:
        return block_module
    spec = importlib.util.spec_from_file_location("block_under_test", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_meta(bt: Any, rotary: bool, has_pos: bool) -> dict[str, Any]:
    """The constexprs the module's launch would pass at the benchmark shape (no data is allocated:
    ``q`` is a broadcast view, only its shape and dtype are read)."""
    lengths = torch.full((BATCH,), (MIN_LEN + MAX_LEN) // 2, dtype=torch.int64)
    offsets = torch.zeros(BATCH + 1, dtype=torch.int32)
    offsets[1:] = lengths.cumsum(0)
    total = int(offsets[-1])
    q = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16).expand(total, HEADS, HEAD_DIM)
    positions = torch.empty(1, dtype=torch.float32).expand(total) if has_pos else None
    _, _, _, _, meta = bt.launch_args(q, q, offsets, MAX_LEN, BLOCK_SIZE, positions, 10000.0, rotary)
    assert meta["ROTARY"] == rotary and meta["HAS_POS"] == has_pos
    return dict(meta)


def signature(fn: Any, consts: dict[str, Any], rotary: bool) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in _BF16:
            sig[name] = "*bf16"
        elif name in _I32_PTR:
            sig[name] = "*i32"
        elif name in _F32_PTR:
            # Without rotary the launch passes block_starts for the unused pointers.
            sig[name] = "*fp32" if rotary else "*i32"
        elif name in _F32:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def divisibility(fn: Any, sig: dict[str, str]) -> dict[tuple[int, ...], list[list[Any]]]:
    """The hints the JIT derives at the benchmark shape: 16-aligned pointers; B = 1152 and the strides
    (H*D = 512, D = 128) are multiples of 16."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name].startswith("*") or name.startswith("stride_") or name == "B"
    }


def programs_per_sm(regs: int, warps: int) -> int:
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    return min(REGS_PER_SM // (per_warp * warps), MAX_WARPS_PER_SM // warps)


def compile_one(
    fn: Any, consts: dict[str, Any], rotary: bool, warps: int, stages: int, maxnreg: int | None
) -> tuple[Any, dict[str, int]]:
    sig = signature(fn, consts, rotary)
    options: dict[str, Any] = dict(num_warps=warps, num_stages=stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    k = triton.compile(
        ASTSource(fn, sig, consts, attrs=divisibility(fn, sig)),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    return k, ptxas_usage(k.asm["ptx"], maxnreg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="another copy of block/triton.py to compile (before/after)")
    ap.add_argument("--head-group", type=int)
    ap.add_argument("--fwd-warps", type=int)
    ap.add_argument("--bwd-warps", type=int)
    ap.add_argument("--maxnreg", type=int, help="register cap of the backward (default: bwd_maxnreg)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--ptx-dir")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=INT", help="override a setting")
    args = ap.parse_args()
    bt = load_module(args.source)
    changes: dict[str, int | None] = {}
    for item in args.set:
        name, value = item.split("=")
        changes[name] = None if value == "None" else int(value)
    for name, value in (("head_group", args.head_group), ("fwd_warps", args.fwd_warps),
                        ("bwd_warps", args.bwd_warps), ("bwd_maxnreg", args.maxnreg)):  # fmt: skip
        if value is not None:
            changes[name] = value
    with bt.launched_with(**changes) as settings:
        report(args, bt, settings)


def report(args: argparse.Namespace, bt: Any, settings: Any) -> None:
    """Compile both kernels in the three rotary modes with ``settings`` and print (or write) the results."""
    fwd_warps, bwd_warps, maxnreg = settings.fwd_warps, settings.bwd_warps, settings.bwd_maxnreg
    print(
        f"triton {triton.__version__}, sm_90a, bf16, D=Dv={HEAD_DIM}, block {BLOCK_SIZE}, H={HEADS}, "
        f"B={BATCH}, causal={args.causal}, HEAD_GROUP={settings.head_group}, "
        f"NUM_STAGES={settings.num_stages}, BWD_MAXNREG={maxnreg}, source={args.source or bt.__file__}",
        flush=True,
    )
    header = (
        f"{'kernel':7s} {'rotary':8s} {'warps':>5s} {'regs':>5s} {'spill st/ld B':>13s} {'stack B':>7s} "
        f"{'smem B':>7s} {'progs/SM':>8s} {'compile s':>9s}"
    )
    print(header)
    print("-" * len(header))
    modes = [("none", False, False), ("default", True, False), ("float", True, True)]
    kernels = [
        ("fwd", bt._block_attention_fwd, "DV", fwd_warps, None),
        ("bwd", bt._block_attention_bwd, "DVD", bwd_warps, maxnreg),
    ]
    for kname, fn, dv_name, warps, cap in kernels:
        for mode, rotary, has_pos in modes:
            consts = launch_meta(bt, rotary, has_pos)
            consts[dv_name] = HEAD_DIM
            consts["CAUSAL"] = args.causal
            t0 = time.time()
            try:
                k, use = compile_one(fn, consts, rotary, warps, settings.num_stages, cap)
            except Exception as e:
                print(f"{kname:7s} {mode:8s} FAIL {type(e).__name__}: {str(e)[:800]}", flush=True)
                continue
            if args.ptx_dir:
                os.makedirs(args.ptx_dir, exist_ok=True)
                with open(os.path.join(args.ptx_dir, f"{kname}_{mode}.ptx"), "w") as f:
                    f.write(code_only(k.asm["ptx"]))
            smem = max(int(k.metadata.shared), use["smem_ptxas"])
            spill = f"{use['spill_st']}/{use['spill_ld']}"
            print(
                f"{kname:7s} {mode:8s} {warps:5d} {use['regs']:5d} {spill:>13s} {use['stack']:7d} {smem:7d} "
                f"{programs_per_sm(use['regs'], warps):8d} {time.time() - t0:9.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
