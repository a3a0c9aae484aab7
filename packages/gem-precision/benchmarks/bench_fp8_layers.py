"""The roofline of ``Recipe.fp8_rowwise(auto_fallback=True)`` against measurements, per GEMM, on one GPU.

1. The device's rates, as :class:`gem_precision.roofline.DeviceRates` uses them: the copy rate, bf16 and
   row-wise FP8 GEMM rates (``torch._scaled_mm``, fast and precise accumulation) at a layer-like shape, the
   row-wise and the tiled column-wise cast's share of the copy rate, and a cast kernel's fixed cost (a tiny
   tensor). Printed as a ``DeviceRates(...)`` literal (put it in ``gem_precision/roofline.py`` if it
   differs much from the table there, or pass it to ``roofline.use_rates``).
2. Every GEMM of the event-level linear layers of base-h200 (T = 182,000 history events, d_model 512) and
   large-h200 (T = 38,000, d_model 1024): forward ``[T, in] x [out, in]``, dgrad ``[T, out] x [in, out]``
   (w cast column-wise), wgrad ``[out, T] x [in, T]`` (both cast column-wise), each timed in bf16
   (``a @ b.T``) and in FP8 (``fp8_rowwise_mm`` with its casts, forced: ``min_speedup=0``). Beside each: the
   roofline's prediction with the shipped table and with the rates measured in step 1, and whether the auto
   recipe's choice (FP8 iff predicted >= ``AUTO_MIN_SPEEDUP``) was the faster path.
3. Per config: the event-level layers' GEMMs of one step (each layer kind times its count) in bf16, all in
   FP8, and as the auto recipe chooses: the auto recipe must not lose (>= 1.0x bf16).

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-precision/benchmarks/bench_fp8_layers.py --out DIR        # ~1 min on an H100

Times: ``triton.testing.do_bench`` medians (L2 flushed between runs). Writes ``DIR/bench_fp8_layers.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import triton

from gem_precision.roofline import AUTO_MIN_SPEEDUP, DeviceRates, fp8_gemm_speedup, rates_for
from gem_precision.rowwise import fp8_rowwise_mm, quantize_rowwise

# (config, tokens, [(layer kind, in, out, layers)]): the event-level linears (one row per history event).
CONFIGS = [
    ("base-h200", 182_000, [("attn.qkv", 512, 1536, 6), ("attn.out", 512, 512, 6), ("ffn.w13", 512, 4096, 6),
                            ("ffn.w2", 2048, 512, 6), ("cross.q", 512, 512, 6), ("cross.out", 512, 512, 6),
                            ("pma.kv", 512, 1024, 6)]),
    ("large-h200", 38_000, [("attn.qkv", 1024, 3072, 12), ("attn.out", 1024, 1024, 12),
                            ("ffn.w13", 1024, 8192, 12), ("ffn.w2", 4096, 1024, 12),
                            ("cross.q", 1024, 1024, 12), ("cross.out", 1024, 1024, 12),
                            ("pma.kv", 1024, 2048, 12)]),
]  # fmt: skip


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median"))


def measure_rates(name: str) -> DeviceRates:
    """The rates of this GPU (see the module docstring, step 1)."""
    dev = "cuda"
    x = torch.randn(65536, 4096, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    copy = 2 * x.numel() * 2 / (bench(lambda: dst.copy_(x)) * 1e-3)
    dst.resize_(0)
    m, k, n = 65536, 1024, 4096
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    flops = 2 * m * k * n
    bf16 = flops / (bench(lambda: a @ b.t()) * 1e-3)
    qa, sa = quantize_rowwise(a, k_multiple=16)
    qb, sb = quantize_rowwise(b, k_multiple=16)

    def scaled(fast: bool) -> float:
        ms = bench(lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.reshape(1, -1),
                                            out_dtype=torch.bfloat16, use_fast_accum=fast))  # fmt: skip
        return flops / (ms * 1e-3)

    fp8, fp8_precise = scaled(True), scaled(False)
    row_s = bench(lambda: quantize_rowwise(x, k_multiple=16)) * 1e-3
    col_s = bench(lambda: quantize_rowwise(x, transpose=True, k_multiple=16)) * 1e-3
    tiny = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    fixed = bench(lambda: quantize_rowwise(tiny, k_multiple=16)) * 1e-3
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    base = DeviceRates(name, bf16_flops=bf16, fp8_flops=fp8, fp8_flops_precise=fp8_precise, copy_bytes=copy,
                       sms=sms)  # fmt: skip
    return dataclasses.replace(
        base,
        row_cast_efficiency=x.numel() * base.row_cast_bytes / (row_s - 2 * fixed) / copy,
        col_cast_efficiency=x.numel() * base.col_cast_bytes / (col_s - 3 * fixed) / copy,
        cast_kernel_s=fixed / 2,  # the row-wise cast is one launch of the kernel, plus the pad's zeroing
    )


def gemm_rows(config: str, tokens: int, layers, measured: DeviceRates) -> list[dict]:
    shipped = rates_for("cuda")
    rows = []
    for kind, i, o, count in layers:
        x = torch.randn(tokens, i, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, o, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(o, i, device="cuda", dtype=torch.bfloat16)
        # (gemm, A stored, a_t, B stored, b_t, m, k, n, precise)
        gemms = [
            ("forward", x, False, w, False, tokens, i, o, False),
            ("dgrad", dy, False, w, True, tokens, o, i, True),
            ("wgrad", dy, True, x, True, o, tokens, i, True),
        ]
        for g, a, a_t, b, b_t, m, k, n, precise in gemms:
            aa = a.t() if a_t else a
            bb = b.t() if b_t else b
            ms16 = bench(lambda aa=aa, bb=bb: aa @ bb.t())
            ms8 = bench(lambda a=a, b=b, a_t=a_t, b_t=b_t, p=precise: fp8_rowwise_mm(
                a, b, a_t=a_t, b_t=b_t, use_fast_accum=not p, min_speedup=0.0))  # fmt: skip
            kw = dict(a_col=a_t, b_col=b_t, precise=precise)
            pred = fp8_gemm_speedup(m, k, n, rates=shipped, **kw)  # type: ignore[arg-type]
            pred_m = fp8_gemm_speedup(m, k, n, rates=measured, **kw)  # type: ignore[arg-type]
            auto_fp8 = pred >= AUTO_MIN_SPEEDUP
            row = {
                "config": config, "layer": kind, "gemm": g, "m": m, "k": k, "n": n, "count": count,
                "bf16_ms": ms16, "fp8_ms": ms8, "measured_speedup": ms16 / ms8,
                "predicted_speedup": pred, "predicted_with_measured_rates": pred_m,
                "auto_choice": "fp8" if auto_fp8 else "bf16",
                "auto_ms": ms8 if auto_fp8 else ms16,
                "auto_right": (ms8 < ms16) == auto_fp8,
                "tflops_bf16": 2 * m * k * n / ms16 / 1e9,
            }  # fmt: skip
            rows.append(row)
            print(f"  {config:10s} {kind:9s} {g:7s} {m}x{k}x{n}: bf16 {ms16:.3f} ms"
                  f" ({row['tflops_bf16']:.0f} TF/s) fp8 {ms8:.3f} ms = {row['measured_speedup']:.2f}x"
                  f" | predicted {pred:.2f}x"
                  f" (measured rates {pred_m:.2f}x) | auto {row['auto_choice']}"
                  f" {'right' if row['auto_right'] else 'WRONG'}", flush=True)  # fmt: skip
        del x, dy, w
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default="base-h200,large-h200")
    args = p.parse_args()
    name = torch.cuda.get_device_name()
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    t0 = time.time()
    measured = measure_rates(name)
    print(f"measured: {measured}", flush=True)
    print(f"shipped table for this device: {rates_for('cuda')}", flush=True)
    rows, totals = [], {}
    for config, tokens, layers in CONFIGS:
        if config not in args.configs.split(","):
            continue
        r = gemm_rows(config, tokens, layers, measured)
        rows += r
        t = {key: sum(x["count"] * x[key] for x in r) for key in ("bf16_ms", "fp8_ms", "auto_ms")}
        best = sum(x["count"] * min(x["bf16_ms"], x["fp8_ms"]) for x in r)
        totals[config] = {**t, "best_ms": best, "fp8_vs_bf16": t["bf16_ms"] / t["fp8_ms"],
                          "auto_vs_bf16": t["bf16_ms"] / t["auto_ms"], "best_vs_bf16": t["bf16_ms"] / best,
                          "auto_never_loses": t["auto_ms"] <= t["bf16_ms"] * 1.01}  # fmt: skip
        print(f"{config}: event-level GEMMs of one step: bf16 {t['bf16_ms']:.1f} ms, "
              f"all fp8 {t['fp8_ms']:.1f} ms "
              f"({totals[config]['fp8_vs_bf16']:.2f}x), auto {t['auto_ms']:.1f} ms "
              f"({totals[config]['auto_vs_bf16']:.2f}x), best per GEMM {best:.1f} ms "
              f"({totals[config]['best_vs_bf16']:.2f}x)", flush=True)  # fmt: skip
    out = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
           "measured_rates": dataclasses.asdict(measured),
           "shipped_rates": dataclasses.asdict(rates_for("cuda")),
           "auto_min_speedup": AUTO_MIN_SPEEDUP, "rows": rows, "totals": totals,
           "elapsed_s": time.time() - t0}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_fp8_layers.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
