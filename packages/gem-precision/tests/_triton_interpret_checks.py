"""Checks of the Triton kernels against the PyTorch reference; run by test_mx_triton.py in a subprocess
with TRITON_INTERPRET=1 on the CPU, and directly on a GPU. Prints one line per check; exits 1 on failure.
"""

from __future__ import annotations

import os
import sys

import torch

from gem_precision import mx_mm, random_hadamard, to_mx
from gem_precision.formats import E4M3
from gem_precision.rowwise.reference import quantize_rowwise_reference
from gem_precision.rowwise.triton import quantize_rowwise_triton

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def wide(r: int, c: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = 10.0 ** (torch.rand(r, 1, generator=g) * 60 - 30)
    x = (
        base
        * 2.0 ** (torch.randn(r, c, generator=g) * 3)
        * (torch.randint(0, 2, (r, c), generator=g) * 2 - 1)
    )
    x[0, : min(c, 40)] = 0.0
    if r > 3:
        x[1, 0] = float("nan")
        x[2, c - 1] = float("inf")
        x[3, :3] = torch.tensor([1e-40, -0.0, 448.0 * 2**-20])[: min(3, c)]
    return x.to(dtype).to(DEVICE)


def same_mx(a, b) -> bool:
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def main(big: bool) -> None:
    shapes = [(70, 45), (33, 128), (1, 1)] + ([(1000, 4104), (4096, 520)] if big else [])
    for r, c in shapes:
        for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            for mode in ("floor", "rceil"):
                x = wide(r, c, seed=r + c)
                for axis, square in ((-1, False), (0, False), (-1, True)):
                    kw = dict(axis=axis, elem_dtype=dt, scale_mode=mode, square=square)
                    t = to_mx(x, backend="triton", **kw)
                    ref = to_mx(x, backend="reference", **kw)
                    check(f"to_mx {r}x{c} {dt} {mode} axis={axis} square={square}", same_mx(t, ref))
    x = wide(40, 96, seed=1, dtype=torch.float16)
    check("to_mx fp16 input", same_mx(to_mx(x, backend="triton"), to_mx(x, backend="reference")))
    x = torch.randn(3, 50, 40, device=DEVICE)
    t, ref = to_mx(x, axis=1, backend="triton"), to_mx(x, axis=1, backend="reference")
    check("to_mx 3-D middle axis", same_mx(t, ref))
    t, ref = to_mx(x, square=True, backend="triton"), to_mx(x, square=True, backend="reference")
    check("to_mx 3-D square", same_mx(t, ref))

    # Hadamard: the kernel's fp32 dot and torch's matmul sum in different orders, so values may differ in
    # the last fp32 bit and a rare element by one FP8 step; the dequantized values agree to 1 step.
    h = random_hadamard(32, seed=3).to(DEVICE)
    for axis in (-1, 0):
        x = torch.randn(64, 96, device=DEVICE) if axis == -1 else torch.randn(96, 64, device=DEVICE)
        t, ref = (
            to_mx(x, axis=axis, hadamard=h, backend="triton"),
            to_mx(x, axis=axis, hadamard=h, backend="reference"),
        )
        diff = (t.data.view(torch.uint8).int() - ref.data.view(torch.uint8).int()).abs()
        check(
            f"to_mx hadamard axis={axis}",
            torch.equal(t.scale, ref.scale) and diff.max() <= 1 and (diff > 0).float().mean() < 0.01,
            f"mismatch {(diff > 0).float().mean():.4f}",
        )

    # Stochastic rounding: unbiased, and only the two neighbours of each value are drawn.
    base = torch.randn(1, 32, device=DEVICE)
    base[0, 0] = 4.0
    xs = base.repeat(4096, 1)
    q = to_mx(xs, rounding="stochastic", backend="triton", generator=torch.Generator().manual_seed(0))
    deq = q.dequantize(torch.float64)
    spacing = 2.0 ** (torch.floor(torch.log2(base.abs().double())).clamp(min=-12) - 3)
    err = (deq.mean(0) - base[0].double()).abs()
    check(
        "to_mx stochastic unbiased",
        bool((err <= 5 * 0.5 * spacing[0] / 4096**0.5).all()),
        f"max err/spacing {(err / spacing[0]).max():.4f}",
    )
    check("to_mx stochastic neighbours", bool(((deq - base.double()).abs() <= spacing + 1e-12).all()))

    # mx_mm: both kernel variants against dequantize-then-fp64.
    mm_shapes = [(33, 96, 17), (64, 64, 64), (5, 50, 40)] + ([(1024, 4096, 512)] if big else [])
    for m, k, n in mm_shapes:
        a = torch.randn(m, k, device=DEVICE)
        w = torch.randn(n, k, device=DEVICE) * 30
        for square in (False, True):
            qa, qw = to_mx(a), to_mx(w, square=square)
            ref = qa.dequantize(torch.float64) @ qw.dequantize(torch.float64).t()
            for variant in (False, True):
                from gem_precision.mx import triton as triton_mx

                out = triton_mx.mx_mm_triton(qa, qw.t(), out_dtype=torch.float32, bf16_dot=variant)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                # fp32 accumulation of exact products: ~1e-7; on Hopper FP8 tensor cores add partial sums
                # with ~2**-13 precision inside each 32-wide slice (the bf16 variant does not).
                tol = 1e-5 if (variant or DEVICE == "cpu") else 2e-4
                check(f"mx_mm {m}x{k}x{n} square={square} bf16_dot={variant}", err < tol, f"err {err:.2e}")
    from gem_precision.mx.triton import dequantize_triton, mx_mm_triton

    x = torch.randn(70, 96, device=DEVICE) * 1e3
    for kw in (dict(), dict(axis=0), dict(square=True)):
        q = to_mx(x, **kw)
        for view in (q, q.t()):
            want = view.dequantize(torch.float32, backend="reference")
            d = dequantize_triton(view, torch.float32)
            check(f"dequantize_triton {kw} {tuple(view.shape)}", torch.equal(d, want))
            # MXTensor.dequantize dispatches to the same kernel (under the interpreter too, when forced).
            d = view.dequantize(torch.float32, backend="triton")
            check(f"MXTensor.dequantize(backend='triton') {kw} {tuple(view.shape)}", torch.equal(d, want))
    if DEVICE == "cuda":
        a, w = torch.randn(256, 512, device=DEVICE), torch.randn(384, 512, device=DEVICE)
        qa, qw = to_mx(a), to_mx(w, axis=0, square=True)
        ref = qa.dequantize(torch.float64) @ qw.dequantize(torch.float64).t()
        out = mx_mm_triton(qa, qw.t(), out_dtype=torch.bfloat16, path="dequant")
        err = ((out.double() - ref).norm() / ref.norm()).item()
        check("mx_mm dequant path (bf16 out)", err < 4e-3, f"err {err:.2e}")  # bf16 rounding of the output
    q1 = mx_mm(to_mx(torch.randn(16, 64, device=DEVICE)), to_mx(torch.randn(64, 16, device=DEVICE), axis=0))
    check("mx_mm dispatch dtype", q1.dtype == torch.bfloat16)

    # Row-wise quantization (plain and transposed) against the PyTorch reference.
    for r, c in [(37, 80), (64, 128)] + ([(4096, 4096)] if big else []):
        x = torch.randn(r, c, device=DEVICE) * torch.rand(r, 1, device=DEVICE) * 10
        for transpose in (False, True):
            d, s = quantize_rowwise_triton(x, E4M3, transpose=transpose)
            rd, rs = quantize_rowwise_reference(x.t() if transpose else x)
            ds = (d.float() * s - rd.float() * rs).abs().max() / x.abs().max()
            # Scales agree to fp32 rounding; a few elements whose scaled value lands on a rounding
            # midpoint up to the division's last bit may differ by one step (2**-4 relative).
            check(f"rowwise {r}x{c} transpose={transpose}",
                  torch.allclose(s, rs, rtol=1e-6) and ds < 2**-4, f"max diff {ds:.2e}")  # fmt: skip
    # K zero-padded to a multiple of 16 (the token axis of the weight-gradient GEMM): the same bytes, then
    # zeros.
    for r, c in [(37, 80), (64, 21)]:
        x = torch.randn(r, c, device=DEVICE)
        for transpose in (False, True):
            d, s = quantize_rowwise_triton(x, E4M3, transpose=transpose)
            dp, sp = quantize_rowwise_triton(x, E4M3, transpose=transpose, k_multiple=16)
            k = d.shape[1]
            ok = dp.shape == (d.shape[0], -(-k // 16) * 16) and dp.is_contiguous() and torch.equal(sp, s)
            ok = ok and torch.equal(dp[:, :k].view(torch.uint8), d.view(torch.uint8))
            ok = ok and not dp[:, k:].view(torch.uint8).any()
            check(f"rowwise padded {r}x{c} transpose={transpose}", ok)
    # Empty and single-element inputs.
    for shape, kw in (((4, 0), {}), ((0, 64), {}), ((0, 64), dict(axis=0)), ((0, 0), dict(square=True)),
                      ((1, 1), {}), ((1, 1), dict(square=True))):  # fmt: skip
        x = torch.randn(shape, device=DEVICE)
        check(f"to_mx empty/single {shape} {kw}", same_mx(to_mx(x, backend="triton", **kw),
                                                         to_mx(x, backend="reference", **kw)))  # fmt: skip
    qa, qb = to_mx(torch.randn(3, 0, device=DEVICE)), to_mx(torch.randn(0, 4, device=DEVICE), axis=0)
    out = mx_mm_triton(qa, qb, out_dtype=torch.float32)
    check("mx_mm K=0", torch.equal(out, torch.zeros(3, 4, device=DEVICE)))
    qa, qb = to_mx(torch.randn(0, 32, device=DEVICE)), to_mx(torch.randn(32, 4, device=DEVICE), axis=0)
    check("mx_mm M=0", mx_mm_triton(qa, qb, out_dtype=torch.float32).shape == (0, 4))
    d, s = quantize_rowwise_triton(torch.randn(0, 16, device=DEVICE), E4M3, transpose=True)
    check("rowwise empty", d.shape == (16, 0) and s.shape == (16, 1))
    print("FAILED:", FAILED if FAILED else "none")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main(big="--big" in sys.argv)
