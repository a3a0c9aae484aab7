"""CPU emulation: the error a reduced-precision GEMM accumulator adds, by the GEMM's K.

Hopper's FP8 tensor cores accumulate in a reduced-precision register (DeepSeek-V3 report: "around 14 bits";
K = 4096 random matrices, maximum relative error "nearly 2%"). ``torch._scaled_mm(use_fast_accum=False)``
promotes the partial sums to fp32 every few MMA steps; ``use_fast_accum=True`` keeps the whole K sum in that
register. This script emulates the fast mode: the K axis is cut into steps of 32 (one FP8 ``wgmma`` K step);
each step's dot products are exact, and after each step the running sum is rounded to ``--bits`` bits of
mantissa (round toward zero, and, for comparison, to nearest). The precise mode is the same sum in fp64.
Operands are fresh N(0, 1) draws (the accumulation alone: no FP8 rounding of the operands).

Printed per K: the error of the outputs against the exact sum relative to their RMS (Frobenius: ||err|| /
||exact||) and its largest element (max |err| / RMS of the exact outputs; elementwise relative errors are
unbounded where an output is near zero). The K of interest:
forward and dgrad K = a layer's width (512-4096 on gem-model's base), wgrad K = the tokens of the batch
(~180,000 history events per base-h200 step).

    uv run --no-sync python packages/gem-precision/benchmarks/accumulation_error.py

It is a model of the hardware, not a measurement of it: the rounding mode of the real accumulator is not
documented, so both modes are shown, and the K = 4096 row can be held against DeepSeek's 2%.
"""

from __future__ import annotations

import argparse

import torch

STEP = 32  # K of one FP8 wgmma instruction


def round_mantissa(x: torch.Tensor, bits: int, mode: str) -> torch.Tensor:
    """``x`` with ``bits`` bits of mantissa (implicit leading bit included), toward zero or to nearest."""
    m, e = torch.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1
    scaled = m * 2.0**bits
    scaled = torch.trunc(scaled) if mode == "toward_zero" else torch.round(scaled)
    return torch.ldexp(scaled / 2.0**bits, e)


def accumulate(a: torch.Tensor, b: torch.Tensor, bits: int | None, mode: str) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` summed in K steps of ``STEP``, the running sum rounded after each step
    (``bits=None``: exact, fp64)."""
    k = a.shape[1]
    partial = torch.einsum(
        "mtk,tkn->tmn", a.reshape(a.shape[0], k // STEP, STEP), b.reshape(k // STEP, STEP, -1)
    )
    if bits is None:
        return partial.sum(0)
    acc = torch.zeros_like(partial[0])
    for p in partial:
        acc = round_mantissa(acc + p, bits, mode)
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=14)
    ap.add_argument("--ks", default="512,4096,32768,180224")
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    print(
        f"accumulator of {args.bits} mantissa bits, K steps of {STEP}, outputs {args.m}x{args.n}, "
        "N(0,1) operands"
    )
    print("| K | toward zero: Frobenius / max relative error | to nearest: Frobenius / max |")
    print("|---|---|---|")
    for k in (int(x) for x in args.ks.split(",")):
        k -= k % STEP
        a = torch.randn(args.m, k, dtype=torch.float64)
        b = torch.randn(k, args.n, dtype=torch.float64)
        exact = accumulate(a, b, None, "")
        cells = []
        for mode in ("toward_zero", "nearest"):
            err = accumulate(a, b, args.bits, mode) - exact
            rms = exact.pow(2).mean().sqrt()
            cells.append(f"{(err.norm() / exact.norm()).item():.2e} / {(err.abs().max() / rms).item():.2e}")
        print(f"| {k:,} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
