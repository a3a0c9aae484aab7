"""The 8-bit all-gather's quantizer on one GPU: the fused packed-row kernels against the path they replace
and against the bf16 cast of the same shards (issue 37's target: the quantizer <= 2x the bf16 cast).

For every linear weight of a gem-model config that the 8-bit all-gather wraps (``numel >=
--min-numel``, as ``ParallelConfig.all_gather_min_numel``), an fp32 master shard of ``rows / s`` rows for
each ``s`` in ``--shards`` (1: one rank, the weights whole; 8: a shard group of 8) is made on the device.
One *round* handles every shard once, as one all-gather round of FSDP2 does:

- ``bf16_cast``: ``shard.to(bf16)`` (what FSDP's own all-gather does per round with ``param_dtype=bf16``);
- ``old_quant``: ``quantize_rowwise`` / ``to_mx`` then the scale bytes concatenated (gem-parallel's
  ``fsdp_pre_all_gather`` before the fused kernel);
- ``fused_quant``: ``gem_precision.packed.quantize_packed`` (one launch per shard);
- ``unit_quant``: ``quantize_packed_many`` once per FSDP unit (each ``layers.N`` block, the rest as the root
  unit): what gem-parallel's ``AllGatherRound`` launches, one per unit and round (the target's number);
- ``all_quant``: ``quantize_packed_many`` over every shard at once (one launch);
- ``old_dequant`` / ``fused_dequant``: the gathered rows back to the bf16 weight (slices, copies and the
  cast, against one ``dequantize_packed`` launch into a kept buffer, as FSDP2 re-gathers).

Before timing, every shard's fused bytes are compared with the old path's (and the dequantized weights bit
for bit): a GPU check of the kernels at the model's real shapes. Times are CUDA-event medians of
``--trials`` trials of ``--rounds`` rounds each, after a warm-up; GB/s count bytes read and written once
(quantize: 4 B in, ``1 + s/K`` B out per element; cast: 4 in, 2 out; dequantize: ``1 + s/K`` in, 2 out).
``--sweep`` also times a few launch settings of each kernel and reports the best (set them in
``gem_precision.packed.triton`` if one wins clearly).

Prints one line per (format, shard count) and writes ``DIR/all_gather_quant.json``.

    python packages/gem-train/benchmarks/bench_all_gather_quant.py --config base --out DIR [--sweep]
    python packages/gem-train/benchmarks/bench_all_gather_quant.py --device cpu --config tiny \
        --min-numel 1024 --out /tmp/agq                                          # the plumbing, on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from gem_parallel.all_gather import dequantize_gathered
from gem_precision import quantize_rowwise, to_mx
from gem_precision.packed import dequantize_packed, packed_width, quantize_packed, quantize_packed_many
from gem_precision.packed import triton as packed_triton

SWEEP = {
    "PACK_ROWWISE": [(4, 1024, 8), (8, 512, 4), (2, 2048, 8), (16, 512, 8)],
    "PACK_MX": [(32, 128, 4), (16, 256, 4), (64, 128, 8), (32, 256, 8)],
    "UNPACK": [(32, 256, 4), (16, 256, 4), (32, 128, 4), (64, 128, 8)],
}


def weight_shapes(config: str, min_numel: int) -> list[tuple[str, int, int]]:
    """``(unit, N, K)`` of every ``nn.Linear`` weight of the gem-model config with at least ``min_numel``
    elements: ``unit`` the FSDP unit gem-parallel shards it in (``layers.N`` or ``root``); the model is built
    on the meta device (no memory)."""
    import gem_model

    model = gem_model.GemModel(gem_model.get_config(config), device="meta")
    return [
        (".".join(name.split(".")[:2]) if name.startswith("layers.") else "root", *m.weight.shape)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.weight.numel() >= min_numel
    ]


def old_pack(shard: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "fp8":
        data, scale = quantize_rowwise(shard, torch.float8_e4m3fn)
    else:
        mx = to_mx(shard, axis=-1, block_size=32, elem_dtype=torch.float8_e4m3fn, scale_mode="rceil")
        data, scale = mx.data, mx.scale
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(shard.shape[0], -1)
    return torch.cat([data.view(torch.uint8), scale_bytes], dim=1)


def old_unpack(packed: torch.Tensor, k: int, fmt: str) -> torch.Tensor:
    data, scale_bytes = packed[:, :k], packed[:, k:].contiguous()
    scale = scale_bytes.view(torch.float32) if fmt == "fp8" else scale_bytes
    return dequantize_gathered(data, scale, fmt, torch.bfloat16)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_round(fn: Callable[[], object], device: str, rounds: int, trials: int) -> float:
    """Median ms of one call of ``fn`` (a round over every shard)."""
    for _ in range(3):
        fn()
    sync(device)
    per: list[float] = []
    for _ in range(trials):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(rounds):
                fn()
            end.record()
            end.synchronize()
            per.append(start.elapsed_time(end) / rounds)
        else:
            t0 = time.perf_counter()
            for _ in range(rounds):
                fn()
            per.append((time.perf_counter() - t0) * 1e3 / rounds)
    return statistics.median(per)


def measure(shapes: list[tuple[str, int, int]], fmt: str, shards: int, args: argparse.Namespace) -> dict:
    dev = args.device
    g = torch.Generator(device=dev).manual_seed(shards)
    kept = [(unit, n, k) for unit, n, k in shapes if n % shards == 0]
    masters = [torch.randn(n // shards, k, device=dev, generator=g) * 0.02 for _, n, k in kept]
    units: dict[str, list[torch.Tensor]] = {}
    for (unit, _, _), m in zip(kept, masters):
        units.setdefault(unit, []).append(m)
    elements = sum(m.numel() for m in masters)
    packed_bytes = sum(m.shape[0] * packed_width(m.shape[1], fmt) for m in masters)
    new = [quantize_packed(m, fmt) for m in masters]
    old = [old_pack(m, fmt) for m in masters]
    many = quantize_packed_many(masters, fmt)
    bytes_equal = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(new, old, many))
    bufs = [torch.empty(m.shape, dtype=torch.bfloat16, device=dev) for m in masters]
    deq_equal = all(
        torch.equal(
            dequantize_packed(p, m.shape[1], fmt, out=b).view(torch.int16),
            old_unpack(p, m.shape[1], fmt).view(torch.int16),
        )
        for p, m, b in zip(new, masters, bufs)
    )

    def rnd(fn: Callable[[], object]) -> float:
        return time_round(fn, dev, args.rounds, args.trials)

    row: dict = {
        "fmt": fmt, "shards": shards, "n_weights": len(masters), "elements": elements,
        "bytes_equal_old": bytes_equal, "dequant_equal_old": deq_equal,
        "bf16_cast_ms": rnd(lambda: [m.to(torch.bfloat16) for m in masters]),
        "old_quant_ms": rnd(lambda: [old_pack(m, fmt) for m in masters]),
        "fused_quant_ms": rnd(lambda: [quantize_packed(m, fmt) for m in masters]),
        "n_units": len(units),
        "unit_quant_ms": rnd(lambda: [quantize_packed_many(u, fmt) for u in units.values()]),
        "all_quant_ms": rnd(lambda: quantize_packed_many(masters, fmt)),
        "old_dequant_ms": rnd(lambda: [old_unpack(p, m.shape[1], fmt) for p, m in zip(new, masters)]),
        "fused_dequant_ms": rnd(
            lambda: [dequantize_packed(p, m.shape[1], fmt, out=b) for p, m, b in zip(new, masters, bufs)]
        ),
    }  # fmt: skip
    row["fused_vs_bf16_cast"] = row["fused_quant_ms"] / row["bf16_cast_ms"]
    row["unit_vs_bf16_cast"] = row["unit_quant_ms"] / row["bf16_cast_ms"]
    row["meets_target_2x"] = row["unit_vs_bf16_cast"] <= 2.0
    row["unit_quant_gbps"] = (4 * elements + packed_bytes) / row["unit_quant_ms"] / 1e6
    row["fused_speedup_vs_old"] = row["old_quant_ms"] / row["fused_quant_ms"]
    row["dequant_speedup_vs_old"] = row["old_dequant_ms"] / row["fused_dequant_ms"]
    row["round_old_ms"] = row["old_quant_ms"] + row["old_dequant_ms"]
    row["round_fused_ms"] = row["fused_quant_ms"] + row["fused_dequant_ms"]
    row["fused_quant_gbps"] = (4 * elements + packed_bytes) / row["fused_quant_ms"] / 1e6
    row["bf16_cast_gbps"] = 6 * elements / row["bf16_cast_ms"] / 1e6
    row["fused_dequant_gbps"] = (packed_bytes + 2 * elements) / row["fused_dequant_ms"] / 1e6
    if args.sweep and dev == "cuda":
        row["sweep"] = sweep(masters, new, bufs, fmt, rnd)
    return row


def sweep(masters, packed, bufs, fmt: str, rnd: Callable[[Callable[[], object]], float]) -> dict:
    """ms per round of each launch setting of the two kernels this format runs (the module's settings
    are restored after)."""
    out: dict = {}
    pack_name = "PACK_ROWWISE" if fmt == "fp8" else "PACK_MX"
    for name, fn in (
        (pack_name, lambda: [quantize_packed(m, fmt) for m in masters]),
        ("UNPACK", lambda: [dequantize_packed(p, m.shape[1], fmt, out=b)
                            for p, m, b in zip(packed, masters, bufs)]),
    ):  # fmt: skip
        default = getattr(packed_triton, name)
        times = {}
        try:
            for setting in SWEEP[name]:
                setattr(packed_triton, name, setting)
                times[str(setting)] = rnd(fn)
        finally:
            setattr(packed_triton, name, default)
        out[name] = {"default": str(default), "ms": times, "best": min(times, key=times.__getitem__)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="base")
    p.add_argument("--device", default="cuda")
    p.add_argument("--min-numel", type=int, default=16384)
    p.add_argument("--shards", default="1,8")
    p.add_argument("--formats", default="fp8,mxfp8")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    shapes = weight_shapes(args.config, args.min_numel)
    info = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "config": args.config, "min_numel": args.min_numel,
            "n_weights": len(shapes)}  # fmt: skip
    if args.device == "cuda":
        from importlib.metadata import version

        info["triton"] = version("triton")
    total = sum(n * k for _, n, k in shapes) / 1e6
    print(f"all-gather quantizer on {info['device']}: {len(shapes)} weights of {args.config} "
          f"(numel >= {args.min_numel}), {total:.1f}M elements", flush=True)  # fmt: skip
    rows = []
    for fmt in args.formats.split(","):
        for shards in (int(s) for s in args.shards.split(",")):
            r = measure(shapes, fmt, shards, args)
            rows.append(r)
            print(
                f"  {fmt:5s} shards={shards}: {r['n_weights']} shards {r['elements'] / 1e6:.1f}M el"
                f" | bf16 cast {r['bf16_cast_ms']:.3f} ms ({r['bf16_cast_gbps']:.0f} GB/s)"
                f" | old quant {r['old_quant_ms']:.3f}"
                f" | fused {r['fused_quant_ms']:.3f} ms ({r['fused_quant_gbps']:.0f} GB/s)"
                f" = {r['fused_vs_bf16_cast']:.2f}x cast"
                f" | per unit ({r['n_units']} launches) {r['unit_quant_ms']:.3f} ms"
                f" ({r['unit_quant_gbps']:.0f} GB/s)"
                f" = {r['unit_vs_bf16_cast']:.2f}x cast [target <= 2] | one launch {r['all_quant_ms']:.3f} ms"
                f" | per-weight fused {r['fused_speedup_vs_old']:.1f}x faster than old"
                f" | dequant old {r['old_dequant_ms']:.3f} fused {r['fused_dequant_ms']:.3f} ms"
                f" | bytes equal old: {r['bytes_equal_old']} / {r['dequant_equal_old']}",
                flush=True,
            )
            if "sweep" in r:
                for name, s in r["sweep"].items():
                    print(
                        f"    sweep {name}: best {s['best']} (default {s['default']}): {s['ms']}", flush=True
                    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "all_gather_quant.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    if not all(r["bytes_equal_old"] and r["dequant_equal_old"] for r in rows):
        raise SystemExit("FAIL: the fused bytes differ from the old path's")


if __name__ == "__main__":
    main()
