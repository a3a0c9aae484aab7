"""H200 benchmark of the fp8_rowwise casts at base-h200's layer shapes: the column-wise (transposed) quantizer
old against new, dy's two copies in one pass, and the fp8_rowwise linear forward+backward against bf16.

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    PYTHONUNBUFFERED=1 python packages/gem-precision/benchmarks/bench_fp8_quant.py --out DIR [--sweep]

Shapes: the linear layers of gem-model's ``base`` that see one row per history event (T = 180,001 by default:
base-h200's batches of 512 hold 167-187k events, and a ragged count is what the model gives), from the module
names of ``GemModel(get_config("base"))`` (6 layers each): attn.qkv 512->1536, attn.out 512->512, ffn.w13
512->4096, ffn.w2 2048->512, cross.q and cross.out 512->512, s_summary.pma.kv 512->1024.

GB/s counts the bytes a single pass must move (read bf16 once, write FP8 once): a two-pass quantizer can at
best reach 2/3 of the copy rate on that scale. ``--sweep`` also tries a few tile shapes of the new kernels and
reports the best (set ``triton_rowwise.AMAX_TILE`` / ``QUANT_TILE`` to it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
from torch import nn

from gem_precision import MXFP8Linear, Recipe, linear
from gem_precision.rowwise import quantize_rowwise, quantize_rowwise_both
from gem_precision.rowwise import triton as triton_rowwise

# (name, in_features, out_features, layers): base's event-level linears.
LAYERS = [
    ("attn.qkv", 512, 1536, 6),
    ("attn.out", 512, 512, 6),
    ("ffn.w13", 512, 4096, 6),
    ("ffn.w2", 2048, 512, 6),
    ("cross.q", 512, 512, 6),
    ("cross.out", 512, 512, 6),
    ("pma.kv", 512, 1024, 6),
]
ROWS: list[dict] = []


def bench(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median milliseconds (CUDA events; do_bench flushes L2 between runs)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def record(case: str, ms: float, **extra) -> dict:
    row = {"case": case, "ms": round(ms, 4), **extra}
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def col_quant(x: torch.Tensor, impl: str):
    triton_rowwise.COL_IMPL = impl
    return quantize_rowwise(x, transpose=True, k_multiple=16)


def check_same(x: torch.Tensor) -> bool:
    """New and old column quantizers give the same bytes and scales on finite data."""
    a, sa = col_quant(x, "tiled")
    b, sb = col_quant(x, "legacy")
    triton_rowwise.COL_IMPL = "tiled"
    rd, rs, cd, cs = quantize_rowwise_both(x, row_k_multiple=16, col_k_multiple=16)
    r0, s0 = quantize_rowwise(x, k_multiple=16)
    return bool(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)
        and torch.equal(cd.view(torch.uint8), a.view(torch.uint8)) and torch.equal(cs, sa)
        and torch.equal(rd.view(torch.uint8), r0.view(torch.uint8)) and torch.equal(rs, s0)
    )  # fmt: skip


def sweep(x: torch.Tensor) -> None:
    amax_opts = [
        (1024, 32, 128, 4),
        (512, 32, 128, 4),
        (2048, 64, 128, 8),
        (1024, 16, 256, 4),
        (1024, 32, 64, 4),
    ]
    quant_opts = [(128, 64, 4), (64, 64, 4), (128, 128, 8), (256, 64, 8), (64, 128, 4), (128, 32, 4)]
    keep_a, keep_q = triton_rowwise.AMAX_TILE, triton_rowwise.QUANT_TILE
    best = None
    for a in amax_opts:
        for q in quant_opts:
            triton_rowwise.AMAX_TILE, triton_rowwise.QUANT_TILE = a, q
            try:
                ms = bench(lambda x=x: col_quant(x, "tiled"))
            except Exception as e:  # a tile the compiler refuses (registers, shared memory)
                print(f"tile {a} {q}: {type(e).__name__}: {str(e)[:200]}")
                continue
            record(f"sweep col quant {tuple(x.shape)} amax={a} quant={q}", ms)
            if best is None or ms < best[0]:
                best = (ms, a, q)
    triton_rowwise.AMAX_TILE, triton_rowwise.QUANT_TILE = keep_a, keep_q
    if best:
        record("sweep best", best[0], amax_tile=best[1], quant_tile=best[2], default=[keep_a, keep_q])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--tokens", type=int, default=180_001)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-linear", action="store_true")
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} torch {torch.__version__} triton {triton.__version__} tokens {args.tokens}")
    t0 = time.time()
    torch.manual_seed(0)
    t = args.tokens
    big = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(big)
    copy_ms = bench(lambda: dst.copy_(big))
    copy_gbs = 2 * big.numel() * 2 / copy_ms / 1e6
    record(f"copy bf16 {t}x4096", copy_ms, GBps=round(copy_gbs, 1))
    dst.resize_(0)
    widths = sorted({w for _, i, o, _ in LAYERS for w in (i, o)})
    per_width: dict[int, dict[str, float]] = {}
    for c in widths:
        x = big[:, :c].contiguous()
        one_pass = x.numel() * 3  # bf16 read + FP8 write
        same = check_same(x)
        row = {}
        for impl in ("legacy", "tiled"):
            ms = bench(lambda impl=impl, x=x: col_quant(x, impl))
            row[impl] = ms
            gbs = one_pass / ms / 1e6
            record(f"col quant transposed {impl} {t}x{c}", ms, GBps=round(gbs, 1),
                   pct_of_copy=round(100 * gbs / copy_gbs, 1), same_bytes_as_legacy=same)  # fmt: skip
        triton_rowwise.COL_IMPL = "tiled"
        row["row"] = bench(lambda x=x: quantize_rowwise(x, k_multiple=16))
        row["both"] = bench(lambda x=x: quantize_rowwise_both(x, row_k_multiple=16, col_k_multiple=16))
        record(f"row quant {t}x{c}", row["row"], GBps=round(one_pass / row["row"] / 1e6, 1))
        record(f"both copies (dy) one pass {t}x{c}", row["both"],
               vs_row_plus_legacy_col=round((row["row"] + row["legacy"]) / row["both"], 2),
               vs_row_plus_tiled_col=round((row["row"] + row["tiled"]) / row["both"], 2))  # fmt: skip
        per_width[c] = row
        if args.sweep and c == 4096:
            sweep(x)
    big.resize_(0)
    torch.cuda.empty_cache()
    # The casts of one base-h200 step (event-level layers): forward row(x); backward old = row(dy) + col(dy)
    # + col(x), new = both(dy) + col(x).
    pw = per_width
    old = sum(n * (pw[i]["row"] + pw[o]["row"] + pw[o]["legacy"] + pw[i]["legacy"]) for _, i, o, n in LAYERS)
    new = sum(
        n * (per_width[i]["row"] + per_width[o]["both"] + per_width[i]["tiled"]) for _, i, o, n in LAYERS
    )
    record("casts of one step's event-level layers, old", old)
    record("casts of one step's event-level layers, new", new, speedup=round(old / new, 2))
    if not args.no_linear:
        total = {"bf16": 0.0, "fp8 legacy": 0.0, "fp8 new": 0.0}
        for name, k, n, count in LAYERS:
            base = nn.Linear(k, n, bias=False, device="cuda")
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
            fp8 = MXFP8Linear.from_linear(base, Recipe.fp8_rowwise())

            def step(mod: nn.Module, x: torch.Tensor = x, g: torch.Tensor = g):
                def run() -> None:
                    x.grad = None
                    mod.weight.grad = None
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        out = mod(x)
                    out.backward(g)

                return run

            flops = 6 * t * k * n
            ms_bf16 = bench(step(base))
            res = {"bf16": ms_bf16}
            for impl, key in (("legacy", "fp8 legacy"), ("tiled", "fp8 new")):
                triton_rowwise.COL_IMPL = impl
                linear.FUSED_BACKWARD = impl == "tiled"  # legacy: the previous backward (two GEMM ops)
                res[key] = bench(step(fp8))
            triton_rowwise.COL_IMPL = "tiled"
            for key, ms in res.items():
                total[key] += count * ms
                record(f"linear fwd+bwd {name} {t}x{k}->{n} {key}", ms, TFLOPs=round(flops / ms / 1e9, 1),
                       vs_bf16=round(ms_bf16 / ms, 3))  # fmt: skip
            del x, g, base, fp8
            torch.cuda.empty_cache()
        for key, ms in total.items():
            record(
                f"event-level linears of one step, fwd+bwd, {key}", ms, vs_bf16=round(total["bf16"] / ms, 3)
            )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__, "tokens": t,
           "amax_tile": triton_rowwise.AMAX_TILE, "quant_tile": triton_rowwise.QUANT_TILE,
           "elapsed_s": round(time.time() - t0, 1), "rows": ROWS}  # fmt: skip
    tmp = Path(args.out) / "bench_fp8_quant.json.tmp"
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(Path(args.out) / "bench_fp8_quant.json")
    print("\n| case | ms | details |\n|---|---|---|")
    for r in ROWS:
        extra = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("case", "ms"))
        print(f"| {r['case']} | {r['ms']} | {extra} |")


if __name__ == "__main__":
    main()
