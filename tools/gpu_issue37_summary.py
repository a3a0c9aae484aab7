"""Compact summary of ``tools/gpu_issue37.sh``'s results: one block per part, each number with its shape,
time, rate and ratio to the baseline measured in the same run. Usage: ``python tools/gpu_issue37_summary.py
OUT``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def allgather(d: dict[str, Any]) -> list[str]:
    i = d["info"]
    out = [f"[allgather] {i['device']}, {i['n_weights']} weights of {i['config']}; one round, all shards:"]
    for r in d["rows"]:
        target = "met" if r["meets_target_2x"] else "MISSED"
        out.append(
            f"  {r['fmt']:5s} 1/{r['shards']} shards, {r['elements'] / 1e6:.1f}M el:"
            f" bf16 cast {r['bf16_cast_ms']:.3f} ms ({r['bf16_cast_gbps']:.0f} GB/s);"
            f" per unit ({r['n_units']} launches) {r['unit_quant_ms']:.3f} ms"
            f" ({r['unit_quant_gbps']:.0f} GB/s) = {r['unit_vs_bf16_cast']:.2f}x the cast (<= 2: {target});"
            f" one launch {r['all_quant_ms']:.3f} ms;"
            f" per weight {r['fused_quant_ms']:.3f} ms = {r['fused_vs_bf16_cast']:.2f}x;"
            f" old {r['old_quant_ms']:.3f} ms;"
            f" dequant {r['old_dequant_ms']:.3f} -> {r['fused_dequant_ms']:.3f} ms;"
            f" bytes equal {r['bytes_equal_old'] and r['dequant_equal_old']}"
        )
        for name, s in r.get("sweep", {}).items():
            best = min(s["ms"].values())
            out.append(f"    sweep {name}: best {s['best']} ({best:.3f} ms), default {s['default']}")
    return out


def fp8layers(d: dict[str, Any]) -> list[str]:
    m = d["measured_rates"]
    out = [
        f"[fp8layers] {d['device']}: bf16 {m['bf16_flops'] / 1e12:.0f} TF/s, fp8 {m['fp8_flops'] / 1e12:.0f}"
        f" (precise {m['fp8_flops_precise'] / 1e12:.0f}) TF/s, copy {m['copy_bytes'] / 1e12:.2f} TB/s,"
        f" casts {m['row_cast_efficiency']:.0%} row / {m['col_cast_efficiency']:.0%} column of copy,"
        f" {m['cast_kernel_s'] * 1e6:.1f} us fixed"
    ]
    for r in d["rows"]:
        mark = "" if r["auto_right"] else " WRONG"
        out.append(
            f"  {r['config']:10s} {r['layer']:9s} {r['gemm']:7s} {r['m']}x{r['k']}x{r['n']}:"
            f" bf16 {r['bf16_ms']:.3f} ms ({r['tflops_bf16']:.0f} TF/s), fp8 {r['fp8_ms']:.3f} ms"
            f" = {r['measured_speedup']:.2f}x; predicted {r['predicted_speedup']:.2f}x;"
            f" auto {r['auto_choice']}{mark}"
        )
    for c, t in d["totals"].items():
        out.append(
            f"  {c}: event-level GEMMs per step bf16 {t['bf16_ms']:.1f} ms; all-fp8 {t['fp8_vs_bf16']:.2f}x,"
            f" auto {t['auto_vs_bf16']:.2f}x (never loses: {t['auto_never_loses']}),"
            f" best {t['best_vs_bf16']:.2f}x"
        )
    wrong = sum(not r["auto_right"] for r in d["rows"])
    out.append(f"  auto's choice wrong on {wrong} of {len(d['rows'])} GEMMs")
    return out


def _graphs(g: dict[str, Any]) -> str:
    if "error" in g:
        return f"    cuda graphs: ERROR {g['error'][:300]}"
    s = g["graph_stats"]
    return (
        f"    cuda graphs: {g['graph_ms']:.1f} ms/step = {g['speedup_vs_step']:.2f}x the step"
        f" (padded, kernel by kernel: {g['eager_padded_ms']:.1f} ms = {g['padded_eager_vs_step']:.2f}x);"
        f" MFU {(g.get('mfu_datasheet_graph') or 0):.1%}; buckets {g['buckets']};"
        f" padding {g['padding_on_these_batches']['padded_events']:.1%};"
        f" {s['captures']} captures in {s['capture_s']:.1f} s; pool {g['graph_pool_gib']:.1f} GiB;"
        f" host syncs in a padded step: {g['host_syncs_in_a_padded_step']}"
    )


def speed(name: str, d: dict[str, Any]) -> list[str]:
    recipes = d.get("recipes", {})
    out = [f"[{name}] {d.get('device', '?')}, config {d.get('config', '?')}:"]
    for r, v in recipes.items():
        if "error" in v:
            out.append(f"  {r}: ERROR {v['error'][:200]}")
            continue
        out.append(
            f"  {r}: {v['step_ms_mean']:.1f} ms/step, {v.get('model_tflops_per_s', 0):.1f} TF/s,"
            f" MFU {(v.get('mfu_datasheet') or 0):.1%}, peak {v.get('peak_memory_gib', 0):.1f} GiB,"
            f" warm-up {v['warmup_s']:.0f} s, recompiles in steady {v['graphs_compiled_in_steady']},"
            f" FP8 layers {v['converted_linears']}"
        )
        if v.get("cuda_graphs"):
            out.append(_graphs(v["cuda_graphs"]))
        prof = v.get("profile") or {}
        if prof.get("share_by_kind") and prof.get("gpu_ms_per_step"):
            gpu = prof["gpu_ms_per_step"]
            kinds = ", ".join(f"{k} {gpu * x:.1f}" for k, x in prof["share_by_kind"].items())
            out.append(f"    GPU {gpu:.1f} ms/step by kind (ms): {kinds}")
            tops = prof.get("top_kernels", [])[:8]
            top = ", ".join(f"{t['name'][:48]} {t['ms_per_step']:.2f}" for t in tops)
            out.append(f"    top kernels (ms): {top}")
    ok = {k: v for k, v in recipes.items() if "error" not in v}
    if "bf16" in ok and "fp8_rowwise" in ok:
        ratio = ok["bf16"]["step_ms_mean"] / ok["fp8_rowwise"]["step_ms_mean"]
        out.append(f"  fp8_rowwise (auto) vs bf16: {ratio:.3f}x")
    return out


def main(root: str) -> None:
    base = Path(root)
    print(f"== issue 37 GPU results in {base} ==")
    dev = base / "device.txt"
    if dev.exists():
        print(dev.read_text().strip())
    for name, fn in (("allgather", allgather), ("fp8layers", fp8layers)):
        files = sorted((base / name).glob("*.json")) if (base / name).exists() else []
        d = _load(files[0]) if files else None
        print("\n".join(fn(d)) if d else f"[{name}] no result")
    steps: dict[str, float] = {}
    for name in ("base", "large", "ffn_off", "ffn_on", "large_ffn_off", "large_ffn_on"):
        d = _load(base / name / "bench_speed.json")
        if d is None:
            if name in ("base", "large"):
                print(f"[{name}] no result")
            continue
        print("\n".join(speed(name, d)))
        bf16 = d.get("recipes", {}).get("bf16", {})
        if "step_ms_mean" in bf16:
            steps[name] = bf16["step_ms_mean"]
    for off, on in (("ffn_off", "ffn_on"), ("large_ffn_off", "large_ffn_on")):
        if off in steps and on in steps:
            print(f"[{on}] fused SwiGLU vs composition, bf16 step: {steps[off] / steps[on]:.3f}x")
    bench = base / "ffnbench" / "log.txt"
    if bench.exists():
        lines = [x for x in bench.read_text().splitlines() if " ms " in x or " vs " in x]
        print("[ffnbench] " + "\n  ".join(lines))
    ws = base / "wsprobe" / "log.txt"
    if ws.exists():
        print("[wsprobe] " + " | ".join(x.strip() for x in ws.read_text().splitlines() if x.strip()))
    log = base / "tests" / "log.txt"
    if log.exists():
        lines = [x for x in log.read_text().splitlines() if "FAIL" in x or "passed" in x or "failed" in x]
        print("[tests] " + " | ".join(lines[-4:]))


if __name__ == "__main__":
    main(sys.argv[1])
