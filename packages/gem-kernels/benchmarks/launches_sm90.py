"""Compiles the jagged helpers', rotary's, block attention's and the SwiGLU backward's Triton kernels for
sm_90 (Hopper) as their launchers launch them, with no GPU.

Each launcher (``jagged_to_padded_triton``, ``padded_to_jagged_triton``, ``jagged_mean_triton``,
``rotary_triton``, ``block_attention_fwd`` / ``_bwd``, ``swiglu_backward_triton``) runs on CPU tensors with
its launches recorded, not run (:func:`sm90_offline.record_launches`), and each launch is compiled for
``GPUTarget("cuda", 90, 32)`` with its argument types, constexprs, warps and stages
(:func:`sm90_offline.compile_launch`). Prints one line per kernel (shared memory; ``--regs``: ptxas
registers and spills); ``--ptx-dir DIR`` writes each kernel's PTX without debug information, for a
before/after ``diff -r``. (The attention kernels: ``compile_sm90.py``; the block kernels at the benchmark
shape with their registers: ``block_registers_sm90.py``.)

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-kernels/benchmarks/launches_sm90.py [--ptx-dir DIR] [--regs]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import torch
import triton
from sm90_offline import Launch, code_only, compile_launch, record_launches, usage_line

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("run without TRITON_INTERPRET: the launchers must take their GPU settings")

from gem_kernels.block import triton as block_triton
from gem_kernels.jagged import triton as jagged_triton
from gem_kernels.rotary import triton as rotary_triton
from gem_kernels.swiglu import triton as swiglu_triton


def launches() -> list[Launch]:
    """Every kernel at representative settings: the jagged copies and mean in bf16 and fp32 (one and 96
    features), rotary in bf16 forward and inverse with default and real-valued positions, block attention
    forward and backward (bf16, D = Dv = 128, block 64, causal or not, rotary none / default / real-valued
    positions, one and four heads per program)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 1, 70, 300, 129])
    offsets = torch.zeros(6, dtype=torch.int32)
    offsets[1:] = lengths.cumsum(0)
    total, max_len = int(offsets[-1]), int(lengths.max())
    out: list[Launch] = []
    for dtype in (torch.bfloat16, torch.float32):
        for feat in (1, 96):
            values = torch.randn(total, feat, generator=g).to(dtype)
            padded = torch.randn(5, max_len, feat, generator=g).to(dtype)
            tag = f"{dtype} F={feat}"
            out += record_launches(
                f"jagged_to_padded {tag}",
                lambda v=values: jagged_triton.jagged_to_padded_triton(v, offsets, max_len, 0.0),
            )
            out += record_launches(
                f"padded_to_jagged {tag}",
                lambda p=padded: jagged_triton.padded_to_jagged_triton(p, offsets, total),
            )
            out += record_launches(
                f"jagged_mean {tag}", lambda v=values: jagged_triton.jagged_mean_triton(v, offsets)
            )
    x = torch.randn(total, 4, 128, generator=g).to(torch.bfloat16)
    pos = torch.rand(total, generator=g) * 100
    for inverse in (False, True):
        for positions in (None, pos):
            out += record_launches(
                f"rotary inverse={inverse} positions={positions is not None}",
                lambda inverse=inverse, positions=positions: rotary_triton.rotary_triton(
                    x, offsets, positions, 10000.0, inverse
                ),
            )
    q, k, v, do = (torch.randn(total, 4, 128, generator=g).to(torch.bfloat16) for _ in range(4))
    for head_group in (1, 4):
        for causal in (False, True):
            for mode, rotary, positions in (
                ("none", False, None),
                ("default", True, None),
                ("float", True, pos),
            ):
                tag = f"block head_group={head_group} causal={causal} rotary={mode}"
                with block_triton.launched_with(head_group=head_group):
                    args = (offsets, max_len, 64, causal, 128**-0.5, positions, 10000.0, rotary)
                    out += record_launches(
                        f"{tag} fwd", lambda args=args: block_triton.block_attention_fwd(q, k, v, *args)
                    )
                    out += record_launches(
                        f"{tag} bwd",
                        lambda args=args: block_triton.block_attention_bwd(do, q, k, v, q, *args),
                    )
    # The fused SwiGLU backward at base's widths (d 512, H 2048), bf16: its CUDA defaults (descriptors on
    # sm_90+, pointers before or where descriptors cannot address the tensors).
    dy, w2, gu = (
        torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((999, 512), (512, 2048), (999, 4096))
    )
    cuda = swiglu_triton.CUDA_BLOCKS
    for blocks in (cuda, dataclasses.replace(cuda, tma=True)):
        out += record_launches(
            f"swiglu backward {blocks.csv()}",
            lambda b=blocks: swiglu_triton.swiglu_backward_triton(dy, w2, gu, b),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx-dir", help="write each kernel's PTX without debug information here")
    ap.add_argument("--regs", action="store_true", help="registers and spills (ptxas)")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90", flush=True)
    for label, fn, args, kwargs in launches():
        name = f"{label} {fn.__name__}"
        try:
            k = compile_launch(fn, args, kwargs)
        except Exception as e:
            print(f"{name}: FAIL {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        ptx = k.asm["ptx"]
        if a.ptx_dir:
            os.makedirs(a.ptx_dir, exist_ok=True)
            with open(os.path.join(a.ptx_dir, re.sub(r"[^A-Za-z0-9_.=-]+", "_", name) + ".ptx"), "w") as f:
                f.write(code_only(ptx))
        print(
            f"{name}: ok  smem {k.metadata.shared}" + (f"  {usage_line(ptx)}" if a.regs else ""), flush=True
        )


if __name__ == "__main__":
    main()
