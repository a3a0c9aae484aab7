"""Dense-parallel costs on one GPU: checkpointing, the largest batch, 8-bit all-gather, FSDP2 overhead.

Parts (``--parts``, comma-separated; default all):

- ``checkpointing``: step time (forward + backward, bf16 autocast) and peak memory of gem-model ``base`` at
  ``--batch-size`` under each policy of ``--policies`` (none, full, selective, budget), each with bf16 and
  with FP8 saved activations (``--saved``).
- ``max-batch``: per policy, the largest batch whose peak memory fits ``--memory-cap-gib`` (default 90% of
  the GPU): peak memory is fitted linearly in the batch from two probes, the predicted batch is then run
  (and shrunk by 10% on an out-of-memory). Reports its time per sample against no checkpointing at *its*
  largest batch (target: >= 2x the batch at <= 10% cost per sample).
- ``all-gather``: FSDP2 step time with bf16 parameters and the bf16 / fp8 / mxfp8 all-gather, and the
  quantization cost itself: every quantized weight's ``fsdp_pre_all_gather`` + ``fsdp_post_all_gather``
  (quantize the shard, dequantize the gathered weight) against the bf16 cast FSDP does otherwise.
- ``fsdp``: FSDP2 at world size 1 against the unwrapped model (target <= 3% step time).

Every model runs in a one-rank process group (nccl on CUDA, gloo on the CPU), through
``gem_parallel.parallelize``.
Times are medians of ``--steps`` steps after ``--warmup`` steps (the first compiles / autotunes).

Usage (H200; PYTHONPATH must hold packages/*/src; ~5-6 min for all parts at the defaults):
    python packages/gem-train/benchmarks/bench_parallel.py --out $OUT
    python packages/gem-train/benchmarks/bench_parallel.py --parts fsdp,all-gather --out $OUT
Smoke test of the script on a CPU (tiny config, seconds):
    python packages/gem-train/benchmarks/bench_parallel.py --smoke --out /tmp/bench

It measures gem-parallel's mechanisms on GEM, so it lives with gem-train (which may import every package);
it was ``packages/gem-parallel/benchmarks/bench_parallel.py``.
Results: ``packages/gem-parallel/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gem_model as gm
from gem_parallel import FSDPConfig, ParallelConfig, ParallelDims, parallelize, retained_bytes
from gem_parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    apply_saved_activation_compression,
)
from gem_parallel.all_gather import QuantizedAllGatherWeight

PARTS = ("checkpointing", "max-batch", "all-gather", "fsdp")
POLICIES = ("none", "full", "selective", "budget")


# -- set-up --------------------------------------------------------------------------------------------------


def init_one_rank(device: str) -> tuple[ParallelDims, object]:
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims(world_size=1)
    return dims, dims.build_mesh(device)


def new_model(config: gm.GemConfig, device: str) -> gm.GemModel:
    model = gm.GemModel(config, device="meta")
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    return model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step(model, batch: gm.GemBatch, device: str) -> float:
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = model(batch)
    loss, _ = gm.multitask_loss(logits, batch)
    loss.backward()
    return float(loss.detach())


def timed(model, batch: gm.GemBatch, args, *, warmup: int | None = None, steps: int | None = None) -> dict:
    """Median step time (ms) and peak memory (GiB) over ``steps`` steps after ``warmup`` (default: the
    command line's)."""
    device = args.device
    warmup = args.warmup if warmup is None else warmup
    n_steps = args.steps if steps is None else steps
    for _ in range(warmup):
        step(model, batch, device)
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(n_steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step(model, batch, device)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    out = {"step_ms": sorted(times)[len(times) // 2], "step_ms_all": times, "loss": loss}
    if device == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["activation_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    else:  # no allocator statistics: the activation bytes the forward holds for backward
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            _, held = retained_bytes(lambda: model(batch), device)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out["activation_gib"] = held / 2**30
        out["peak_gib"] = (held + 2 * params) / 2**30  # + parameters and their gradients
    return out


def parallel_model(config, args, dims, mesh, *, policy="none", saved="bf16", all_gather="bf16",
                   param_dtype=None, fsdp=True) -> torch.nn.Module:  # fmt: skip
    model = new_model(config, args.device)
    if not fsdp:  # the unwrapped baseline: only the per-layer policy, as parallelize would apply it
        apply_activation_checkpointing(
            model, policy, compile=policy == "budget", memory_budget=args.memory_budget
        )
        if saved != "bf16":
            apply_saved_activation_compression(model, saved)
        return model
    cfg = ParallelConfig(
        fsdp=FSDPConfig(param_dtype=param_dtype, reduce_dtype=torch.float32, wrap_single_rank=True),
        activation_checkpointing=policy, memory_budget=args.memory_budget, compile=policy == "budget",
        saved_activations=saved, all_gather=all_gather, all_gather_min_numel=args.all_gather_min_numel,
    )  # fmt: skip
    return parallelize(model, dims, mesh, cfg)


def make_batch(config, batch_size: int, device: str) -> gm.GemBatch:
    return gm.random_batch(config.features, batch_size, seed=1).to(device)


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


# -- parts ---------------------------------------------------------------------------------------------------


def part_checkpointing(config, args, dims, mesh) -> list[dict]:
    rows = []
    batch = make_batch(config, args.batch_size, args.device)
    for policy in args.policies:
        for saved in args.saved:
            model = parallel_model(config, args, dims, mesh, policy=policy, saved=saved)
            try:
                r = timed(model, batch, args)
            except torch.OutOfMemoryError:
                r = {"step_ms": float("nan"), "peak_gib": float("nan"), "oom": True}
            rows.append({"policy": policy, "saved": saved, "batch": args.batch_size, **r})
            print(f"  checkpointing {policy:9s} saved={saved:5s}: {r['step_ms']:8.1f} ms, "
                  f"peak {r['peak_gib']:.3f} GiB", flush=True)  # fmt: skip
            del model
            _free(args.device)
    none = next((r for r in rows if r["policy"] == "none" and r["saved"] == "bf16"), None)
    for r in rows:
        if none:
            r["time_vs_none"] = r["step_ms"] / none["step_ms"]
            r["memory_vs_none"] = r["peak_gib"] / none["peak_gib"]
    return rows


def _peak_at(model, config, args, batch_size: int, probe: bool = False) -> dict:
    # A probe only needs the peak: two warm-up steps (budget: calibration, then compilation) and one step.
    kwargs = {"warmup": 2, "steps": 1} if probe else {}
    return timed(model, make_batch(config, batch_size, args.device), args, **kwargs)


def part_max_batch(config, args, dims, mesh) -> list[dict]:
    cap = args.memory_cap_gib
    if not cap and args.device == "cuda":
        cap = 0.9 * torch.cuda.get_device_properties(0).total_memory / 2**30
    rows = []
    for policy in args.policies:
        for saved in args.saved:
            model = parallel_model(config, args, dims, mesh, policy=policy, saved=saved)
            b1, b2 = args.probe_batches
            p1, p2 = (_peak_at(model, config, args, b, probe=True)["peak_gib"] for b in (b1, b2))
            cap = cap or 3 * p2  # CPU smoke run: a cap a few probes above the first policy's
            slope = max((p2 - p1) / (b2 - b1), 1e-9)
            predicted = int((cap - (p1 - slope * b1)) / slope) // args.batch_step * args.batch_step
            predicted = min(predicted, args.max_batch_limit)
            batch_size, r = max(predicted, args.batch_step), None
            for _ in range(3):  # the fit is linear; lengths are random: back off on an out-of-memory
                try:
                    r = _peak_at(model, config, args, batch_size)
                    if r["peak_gib"] <= cap:
                        break
                except torch.OutOfMemoryError:
                    _free(args.device)
                r = None
                batch_size = int(batch_size * 0.9) // args.batch_step * args.batch_step
            row = {"policy": policy, "saved": saved, "cap_gib": cap, "probes": {b1: p1, b2: p2},
                   "hit_limit": predicted == args.max_batch_limit,
                   "gib_per_sample": slope, "max_batch": batch_size if r else None}  # fmt: skip
            if r:
                row.update(
                    step_ms=r["step_ms"], peak_gib=r["peak_gib"], ms_per_sample=r["step_ms"] / batch_size
                )
            rows.append(row)
            print(f"  max-batch {policy:9s} saved={saved:5s}: batch {row['max_batch']} "
                  f"({slope * 1024:.1f} MiB/sample)", flush=True)  # fmt: skip
            del model
            _free(args.device)
    none = next(
        (r for r in rows if r["policy"] == "none" and r["saved"] == "bf16" and r.get("max_batch")), None
    )
    for r in rows:
        if none and r.get("max_batch"):
            r["batch_vs_none"] = r["max_batch"] / none["max_batch"]
            r["time_per_sample_vs_none"] = r["ms_per_sample"] / none["ms_per_sample"]
            # The target: >= 2x the batch of no checkpointing at <= 10% more time per sample.
            r["meets_target"] = r["batch_vs_none"] >= 2.0 and r["time_per_sample_vs_none"] <= 1.10
    return rows


def _quantization_cost(model, args) -> dict:
    """ms to quantize every wrapped shard and dequantize the gathered weights once (one all-gather round),
    against the bf16 cast of the same shards."""
    shards = [p.to_local() for p in model.parameters()
              if hasattr(p, "to_local") and isinstance(p.to_local(), QuantizedAllGatherWeight)]  # fmt: skip
    if not shards:
        return {"n_weights": 0}

    def quant_round():
        for s in shards:
            inputs, meta = s.fsdp_pre_all_gather(None, None, None, None, None)
            s.fsdp_post_all_gather(inputs, meta, torch.bfloat16)

    def cast_round():
        for s in shards:
            s._tensor.to(torch.bfloat16)

    out = {"n_weights": len(shards), "elements": sum(s.numel() for s in shards)}
    for name, fn in (("quantize_dequantize_ms", quant_round), ("bf16_cast_ms", cast_round)):
        for _ in range(3):
            fn()
        _sync(args.device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            fn()
        _sync(args.device)
        out[name] = (time.perf_counter() - t0) * 1e3 / args.steps
    return out


def part_all_gather(config, args, dims, mesh) -> list[dict]:
    rows = []
    batch = make_batch(config, args.batch_size, args.device)
    for fmt in ("bf16", "fp8", "mxfp8"):
        model = parallel_model(config, args, dims, mesh, all_gather=fmt, param_dtype=torch.bfloat16)
        r = timed(model, batch, args)
        r.update(_quantization_cost(model, args))
        rows.append({"all_gather": fmt, **r})
        print(f"  all-gather {fmt:5s}: {r['step_ms']:8.1f} ms/step, quant+dequant "
              f"{r.get('quantize_dequantize_ms', 0.0):.2f} ms/gather", flush=True)  # fmt: skip
        del model
        _free(args.device)
    for r in rows:
        r["time_vs_bf16"] = r["step_ms"] / rows[0]["step_ms"]
    return rows


def part_fsdp(config, args, dims, mesh) -> list[dict]:
    batch = make_batch(config, args.batch_size, args.device)
    rows = []
    for wrapped in (False, True):
        model = parallel_model(config, args, dims, mesh, fsdp=wrapped)
        r = timed(model, batch, args)
        rows.append({"fsdp": wrapped, **r})
        print(f"  fsdp={wrapped!s:5s}: {r['step_ms']:8.1f} ms/step", flush=True)
        del model
        _free(args.device)
    rows[1]["time_vs_unwrapped"] = rows[1]["step_ms"] / rows[0]["step_ms"]
    return rows


# -- report --------------------------------------------------------------------------------------------------


def table(results: dict) -> str:
    lines = []
    if "checkpointing" in results:
        lines += [
            "",
            "| policy | saved | batch | step ms | x none | peak GiB | x none |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in results["checkpointing"]:
            lines.append(f"| {r['policy']} | {r['saved']} | {r['batch']} | {r['step_ms']:.1f} | "
                         f"{r.get('time_vs_none', float('nan')):.3f} | {r['peak_gib']:.2f} | "
                         f"{r.get('memory_vs_none', float('nan')):.3f} |")  # fmt: skip
    if "max-batch" in results:
        lines += ["", "| policy | saved | max batch | x none | ms/sample | x none | peak GiB |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in results["max-batch"]:
            if r.get("max_batch"):
                lines.append(f"| {r['policy']} | {r['saved']} | {r['max_batch']} | "
                             f"{r.get('batch_vs_none', float('nan')):.2f} | {r['ms_per_sample']:.3f} | "
                             f"{r.get('time_per_sample_vs_none', float('nan')):.3f} | "
                             f"{r['peak_gib']:.1f} |")  # fmt: skip
    if "all-gather" in results:
        lines += ["", "| all-gather | step ms | x bf16 | quant+dequant ms/gather | bf16 cast ms/gather |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in results["all-gather"]:
            lines.append(f"| {r['all_gather']} | {r['step_ms']:.1f} | {r['time_vs_bf16']:.3f} | "
                         f"{r.get('quantize_dequantize_ms', float('nan')):.2f} | "
                         f"{r.get('bf16_cast_ms', float('nan')):.2f} |")  # fmt: skip
    if "fsdp" in results:
        u, f = results["fsdp"]
        lines += ["", "| model | step ms | x unwrapped |", "|---|---|---|",
                  f"| unwrapped | {u['step_ms']:.1f} | 1.000 |",
                  f"| FSDP2 (1 rank) | {f['step_ms']:.1f} | {f['time_vs_unwrapped']:.3f} |"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="base", choices=gm.CONFIG_NAMES)
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--policies", default=None, help=f"comma-separated, default {','.join(POLICIES)}")
    p.add_argument("--saved", default="bf16,fp8", help="saved-activation formats: bf16, fp8, mxfp8")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--probe-batches", default="128,256", help="two batches for the memory fit of max-batch")
    p.add_argument("--batch-step", type=int, default=32)
    p.add_argument("--memory-cap-gib", type=float, default=0.0, help="default: 90%% of the GPU")
    p.add_argument("--max-batch-limit", type=int, default=4096, help="max-batch searches no further")
    p.add_argument("--memory-budget", type=float, default=0.5)
    p.add_argument("--all-gather-min-numel", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config, small batches: checks the script")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.smoke:
        args.device, args.config, args.batch_size, args.warmup, args.steps = "cpu", "tiny", 8, 2, 2
        args.probe_batches, args.batch_step, args.all_gather_min_numel = "4,8", 4, 4096
        if args.policies is None:
            args.policies = "none,full,selective"  # budget compiles: ask for it to smoke-test it
    args.parts = [x for x in args.parts.split(",") if x]
    args.policies = [x for x in (args.policies or ",".join(POLICIES)).split(",") if x]
    args.saved = [x for x in args.saved.split(",") if x]
    args.probe_batches = [int(x) for x in args.probe_batches.split(",")]
    for part in args.parts:
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}; choose from {PARTS}")
    torch.set_float32_matmul_precision("high")
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    config = gm.get_config(args.config)
    dims, mesh = init_one_rank(args.device)
    t0 = time.perf_counter()
    results: dict = {
        "config": args.config, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()},
    }  # fmt: skip
    runners = {"checkpointing": part_checkpointing, "max-batch": part_max_batch,
               "all-gather": part_all_gather, "fsdp": part_fsdp}  # fmt: skip
    for part in args.parts:
        print(f"[{time.perf_counter() - t0:6.1f} s] {part}", flush=True)
        results[part] = runners[part](config, args, dims, mesh)
    results["wall_s"] = time.perf_counter() - t0
    text = table(results)
    print(text)
    print(f"\nwall {results['wall_s']:.0f} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"parallel_{args.config}_{args.device}"
        (out / f"{name}.json").write_text(json.dumps(results, indent=2, default=str))
        (out / f"{name}.md").write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
