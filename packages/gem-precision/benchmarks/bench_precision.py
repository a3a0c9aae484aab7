"""H200 benchmark of gem-precision (the table of BENCHMARKS.md). Baselines are measured in the same run.

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    PYTHONUNBUFFERED=1 python packages/gem-precision/benchmarks/bench_precision.py [--out DIR] [--quick]

Cases: to_mx bf16 -> MXFP8 at 16384x8192 (1x32 along each axis, 32x32) against a device copy; mx_mm
exact (both kernel variants, a few tile configs) against bf16 torch.matmul at 8192^3 and 65536x1024x1024;
linear forward+backward at M=65536, K=N=4096 for bf16 nn.Linear, fp8_rowwise and MXFP8 recipes;
compress_saved_activations on a 4-layer bf16 MLP (saved-activation bytes and step time).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch
import triton
from torch import nn

from gem_precision import MXFP8Linear, Recipe, compress_saved_activations, to_mx
from gem_precision.mx import triton as triton_mx
from gem_precision.rowwise import quantize_rowwise

ROWS: list[dict] = []


def bench(fn, warmup: int = 25, rep: int = 150) -> float:
    """Median milliseconds (CUDA events, L2 flushed between runs by do_bench)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def record(case: str, ms: float, **extra) -> None:
    row = {"case": case, "ms": round(ms, 4), **extra}
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def bench_to_mx(quick: bool) -> None:
    r, c = 16384, 8192
    x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x))
    copy_bytes = 2 * x.numel() * 2
    copy_tbs = copy_bytes / copy_ms / 1e9
    record("copy bf16 16384x8192", copy_ms, TBps=round(copy_tbs, 3))
    moved = x.numel() * 2 + x.numel() + x.numel() // 32  # read bf16, write fp8 + one scale per 32
    tile_options = {
        triton_mx._ALONG_COLS: [(16, 256, 4), (32, 256, 8)],
        triton_mx._ALONG_ROWS: [(32, 128, 4), (64, 128, 8)],
        triton_mx._SQUARE: [(64, 64, 4), (64, 128, 8)],
    }
    cases = {
        triton_mx._ALONG_COLS: ("1x32 axis=-1", dict(axis=-1)),
        triton_mx._ALONG_ROWS: ("1x32 axis=0", dict(axis=0)),
        triton_mx._SQUARE: ("32x32", dict(square=True)),
    }
    for layout, (name, kw) in cases.items():
        best = None
        for tile in tile_options[layout][: 1 if quick else None]:
            triton_mx.TILES[layout] = tile
            ms = bench(lambda kw=kw: to_mx(x, **kw))
            if best is None or ms < best[0]:
                best = (ms, tile)
        triton_mx.TILES[layout] = best[1]
        tbs = moved / best[0] / 1e9
        record(
            f"to_mx bf16->mxfp8 {name} 16384x8192",
            best[0],
            TBps=round(tbs, 3),
            pct_of_copy=round(100 * tbs / copy_tbs, 1),
            tile=best[1],
        )
    # Stochastic rounding and the fused Hadamard transform, at the tuned tile.
    ms = bench(lambda: to_mx(x, rounding="stochastic"))
    record("to_mx 1x32 stochastic 16384x8192", ms, TBps=round(moved / ms / 1e9, 3))
    h = torch.linalg.qr(torch.randn(32, 32, device="cuda"))[0]
    ms = bench(lambda: to_mx(x, hadamard=h))
    record("to_mx 1x32 + Hadamard 16384x8192", ms, TBps=round(moved / ms / 1e9, 3))


def bench_mx_mm(quick: bool) -> None:
    configs = {
        True: [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 128, 8, 3)],
        False: [(128, 128, 64, 4, 4)],
    }
    best_overall = None
    dq_ms = float("inf")
    for m, k, n in ((8192, 8192, 8192), (65536, 1024, 1024)):
        flops = 2 * m * n * k
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16_ms = bench(lambda a=a, w=w: a @ w.t())
        record(f"bf16 matmul {m}x{k}x{n}", bf16_ms, TFLOPs=round(flops / bf16_ms / 1e9, 1))
        qa, qw = to_mx(a), to_mx(w)
        ref = (qa.dequantize(torch.float32) @ qw.dequantize(torch.float32).t()).double()
        for variant in (True, False):
            for cfg in configs[variant][: 1 if quick else None]:
                try:
                    out = triton_mx.mx_mm_triton(
                        qa, qw.t(), out_dtype=torch.float32, bf16_dot=variant, config=cfg, path="fused"
                    )
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    ms = bench(
                        lambda cfg=cfg, variant=variant, qa=qa, qw=qw: triton_mx.mx_mm_triton(
                            qa, qw.t(), out_dtype=torch.bfloat16, bf16_dot=variant, config=cfg, path="fused"
                        )
                    )
                except Exception as e:  # a config that does not fit in shared memory
                    print(f"config {cfg} variant bf16_dot={variant} failed: {type(e).__name__}: {e}"[:300])
                    continue
                name = "bf16-dequant" if variant else "fp8-dot+rescale"
                record(
                    f"mx_mm {name} {m}x{k}x{n}",
                    ms,
                    TFLOPs=round(flops / ms / 1e9, 1),
                    vs_bf16=round(bf16_ms / ms, 3),
                    cfg=cfg,
                    rel_err_vs_fp32=f"{err:.1e}",
                )
                if m == 8192 and (best_overall is None or ms < best_overall[0]):
                    best_overall = (ms, variant, cfg)
        # Exact dequantization to bf16 (Triton) + cuBLAS bf16 GEMM.
        out = triton_mx.mx_mm_triton(qa, qw.t(), out_dtype=torch.bfloat16, path="dequant")
        err = ((out.double() - ref).norm() / ref.norm()).item()
        ms = bench(
            lambda qa=qa, qw=qw: triton_mx.mx_mm_triton(qa, qw.t(), out_dtype=torch.bfloat16, path="dequant")
        )
        record(f"mx_mm dequant+cuBLAS {m}x{k}x{n}", ms, TFLOPs=round(flops / ms / 1e9, 1),
               vs_bf16=round(bf16_ms / ms, 3), rel_err_vs_fp32_bf16_out=f"{err:.1e}")  # fmt: skip
        if m == 8192:
            dq_ms = ms
        # The FP8 row-wise ceiling for comparison.
        qa8, sa = quantize_rowwise(a)
        qw8, sw = quantize_rowwise(w)
        ms = bench(
            lambda qa8=qa8, qw8=qw8, sa=sa, sw=sw: torch._scaled_mm(
                qa8,
                qw8.t(),
                scale_a=sa,
                scale_b=sw.reshape(1, -1),
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        )
        record(
            f"_scaled_mm fp8 rowwise {m}x{k}x{n}",
            ms,
            TFLOPs=round(flops / ms / 1e9, 1),
            vs_bf16=round(bf16_ms / ms, 3),
        )
        del a, w, qa, qw, ref
    if best_overall is not None:
        triton_mx.MX_MM_BF16_DOT = best_overall[1]
        triton_mx.MX_MM_CONFIG = best_overall[2]
        triton_mx.MX_MM_PATH = "dequant" if dq_ms < best_overall[0] else "fused"
        print(f"mx_mm for the linear benchmarks: path={triton_mx.MX_MM_PATH}, fused: {best_overall[1:]}")


def bench_linear(quick: bool) -> None:
    m, k, n = 65536, 4096, 4096
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step(mod):
        def run():
            x.grad = None
            mod.weight.grad = None
            mod(x).backward(g)

        return run

    flops = 3 * 2 * m * n * k
    bf16_ms = bench(step(base))
    record("linear fwd+bwd bf16 nn.Linear 65536x4096x4096", bf16_ms, TFLOPs=round(flops / bf16_ms / 1e9, 1))
    with torch.no_grad():
        ref_y = base(x).float()
    recipes = {
        "fp8_rowwise": Recipe.fp8_rowwise(),
        "fp8_rowwise (exact accum)": Recipe.fp8_rowwise(fp8_fast_accum=False),
        "fp8_rowwise, wgrad bf16": Recipe.fp8_rowwise(wgrad="bf16"),
        "mxfp8 (default: wgrad bf16)": Recipe(),
        "mxfp8 all three": Recipe.mxfp8_all(),
        "mxfp8 all three, 32x32": Recipe.mxfp8_all(square_blocks=True),
    }
    if quick:
        recipes = dict(list(recipes.items())[:1] + list(recipes.items())[3:4])
    for name, recipe in recipes.items():
        mod = MXFP8Linear.from_linear(base, recipe)
        try:
            with torch.no_grad():
                y = mod(x).float()
            err = ((y - ref_y).norm() / ref_y.norm()).item()
            del y
            ms = bench(step(mod))
        except Exception:
            traceback.print_exc()
            continue
        record(f"linear fwd+bwd {name}", ms, vs_bf16=round(bf16_ms / ms, 3), fwd_rel_err=f"{err:.1e}")
    # Where the time of the fp8_rowwise step goes: its six casts alone.
    w = base.weight.detach()
    dy = g

    def casts():
        quantize_rowwise(x.detach())
        quantize_rowwise(w)
        quantize_rowwise(dy)
        quantize_rowwise(w, transpose=True)
        quantize_rowwise(dy, transpose=True)
        quantize_rowwise(x.detach(), transpose=True)

    record("fp8_rowwise casts of one step (6 quantize_rowwise)", bench(casts))
    record("quantize_rowwise 65536x4096 transpose=True", bench(lambda: quantize_rowwise(dy, transpose=True)))
    record("quantize_rowwise 65536x4096", bench(lambda: quantize_rowwise(dy)))


def bench_compress(quick: bool) -> None:
    torch.manual_seed(0)
    d, tokens = 4096, 16384
    layers = []
    for _ in range(4):
        layers += [nn.Linear(d, d, device="cuda", dtype=torch.bfloat16), nn.ReLU()]
    mlp = nn.Sequential(*layers)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref_grads = None
    base_saved = None
    for fmt in (None, "fp8", "mxfp8"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if fmt is None:
            y = mlp(x)
        else:
            with compress_saved_activations(fmt):
                y = mlp(x)
        loss = y.float().sum()  # sum saves nothing: after `del y` only the graph's saved tensors remain
        del y
        torch.cuda.synchronize()
        saved = torch.cuda.memory_allocated() - before
        loss.backward()
        grads = [p.grad.float().clone() for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        if fmt is None:
            ref_grads, base_saved = grads, saved
            err = 0.0
        else:
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(grads, ref_grads))

        def run(fmt=fmt):
            if fmt:
                with compress_saved_activations(fmt):
                    out = mlp(x)
            else:
                out = mlp(x)
            out.float().sum().backward()
            mlp.zero_grad(set_to_none=True)
            x.grad = None

        ms = bench(run, rep=100)
        record(
            f"4-layer MLP 16384x4096 bf16 fwd+bwd, compress={fmt}",
            ms,
            saved_MiB=round(saved / 2**20, 1),
            pct_of_uncompressed=round(100 * saved / base_saved, 1),
            max_grad_rel_err=f"{err:.1e}",
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="to_mx,mx_mm,linear,compress")
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(
        f"device {props.name} cc {props.major}.{props.minor} torch {torch.__version__} "
        f"triton {triton.__version__} float8_e8m0fnu {hasattr(torch, 'float8_e8m0fnu')}"
    )
    t0 = time.time()
    sections = {
        "to_mx": bench_to_mx,
        "mx_mm": bench_mx_mm,
        "linear": bench_linear,
        "compress": bench_compress,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        try:
            sections[name](args.quick)
        except Exception:  # keep the other sections' numbers
            traceback.print_exc()
        print(f"[{name} done at {time.time() - t0:.0f} s]", flush=True)
        torch.cuda.empty_cache()
        (Path(args.out) / "bench_precision.json").write_text(json.dumps(ROWS, indent=1))
    print("\n| case | ms | details |\n|---|---|---|")
    for r in ROWS:
        extra = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("case", "ms"))
        print(f"| {r['case']} | {r['ms']} | {extra} |")


if __name__ == "__main__":
    main()
