"""The compiled training step of a config, per precision recipe: warm-up, recompiles, step time, MFU, profile.

One process, for each recipe (default ``bf16`` = no conversion under the config's autocast, and
``fp8_rowwise``): build the model, compile it the way ``train.compile`` does (per layer, jagged sizes
dynamic, caches in ``$GEM_COMPILE_CACHE`` or ``~/.cache/gem/compile``), then

- warm-up: one step on each of ``--distinct`` batches of different jagged sizes; its wall time is the
  compilation plus kernel autotuning (``first_step_s`` is the first step alone). BuiltRun the script twice to
  see the warm-up from a warm cache;
- recompiles: dynamo's frame counters during the warm-up (graphs compiled) and during the timed steps (must be
  0: every batch has new sizes);
- steady state: ``--steps`` steps of the trainer's own step (:meth:`gem_train.loop.step.BuiltRun.train_step`,
  with its one host sync for the loss and gradient norm) cycling those batches: ms/step,
  examples/s, model TFLOP/s (``gem_model.flops``), MFU against the datasheet dense bf16 peak of the device
  (``gem_train.loop.mfu.PEAK_FLOPS``; FP8 runs against the same bf16 peak) and against the bf16 GEMM ceiling
  measured here (8192^3), peak memory;
- the same steps fed from pinned host batches through :class:`gem_train.loop.prefetch.DevicePrefetcher`
  (copies one step ahead on a side stream), as the training loop gets them: its step time against the resident
  batches';
- a profile of ``--profile-steps`` steps: the share of GPU time by kernel kind (GEMM, FP8 quantization,
  attention, inductor-fused, embeddings, copies, other);
- with ``--cuda-graphs [RECIPES]`` (CUDA; default bf16): the same step padded to bucketed jagged sizes and
  replayed as one CUDA graph per bucket, against the step above and the padded step launched kernel by kernel
  (``benchmarks/graph_steps.py``). Put those recipes last in ``--recipes``: a capture that fails may leave
  the device unusable for the recipes after it.

Prints a table and writes ``DIR/bench_speed.json`` (rewritten after each recipe, so a run cut short keeps
what it measured). On the CPU (``--config tiny``) it runs the same code with the ``aot_eager`` backend: a
check of the plumbing, not a measurement.

    python packages/gem-train/benchmarks/bench_speed.py --config base-h200 --out DIR
    python packages/gem-train/benchmarks/bench_speed.py --config tiny --steps 3 --out /tmp/speed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from gem_parallel.compile import compile_cache_dir, compile_counters, compile_layers
from gem_train.config import SHIPPED_CONFIGS, TrainConfig, load_config
from gem_train.loop.build import build_run, build_source
from gem_train.loop.distributed import init_distributed
from gem_train.loop.mfu import MFU_BASIS, device_peak_flops, measure_gemm_ceiling
from gem_train.loop.prefetch import DevicePrefetcher
from gem_train.loop.step import StepPipeline

ALIASES = {"tiny": "tiny-cpu"}

# Kernel name substrings -> kind (first match wins; lower-cased names).
_QUANT = (
    "_rowwise_kernel",
    "_col_amax",
    "_col_quant",
    "_tile_amax",
    "_tile_quant",
    "_to_mx",
    "_dequant",
    "_block_quant",
)
_GEMM = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "matmul", "scaled_mm", "f8f8", "_mx_mm")
_ATTENTION = ("_fwd_kernel", "dq_kernel", "dkdv_kernel", "_fwd_short_kv", "_bwd_short_kv", "_bwd_few_q",
              "_block_attention", "attention", "gdpa")  # fmt: skip
_EAGER = ("elementwise", "reduce", "vectorized", "index", "scatter", "gather")
KERNEL_KINDS: list[tuple[str, tuple[str, ...]]] = [
    ("fp8 / mx quantization", _QUANT),
    ("gemm + SwiGLU backward (gem_kernels)", ("swiglu_backward",)),
    ("gemm", _GEMM),
    ("attention (gem_kernels)", _ATTENTION),
    ("jagged / rotary (gem_kernels)", ("_rotary_kernel", "_jagged_", "_padded_to_jagged")),
    ("inductor fused", ("triton_poi", "triton_red", "triton_per", "triton_tem", "triton_")),
    ("embeddings", ("embedding", "fbgemm", "split_", "batched_unary")),
    ("copies / memset", ("memcpy", "memset", "copy", "fill")),
    ("reductions / elementwise (eager)", _EAGER),
]


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _load(config: str, overrides: list[str]) -> TrainConfig:
    name = ALIASES.get(config, config) if config not in SHIPPED_CONFIGS else config
    return load_config(name, overrides)


def run_recipe(
    cfg: TrainConfig, recipe: str, host: list[Any], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Warm-up, recompiles, steady state and profile of one recipe (``host``: LoadedBatch list; ``cfg`` has
    the recipe's ``precision`` section)."""
    torch._dynamo.reset()
    run = build_run(cfg)  # the trainer's own run: model, recipe, optimizers, autocast (compile: below)
    compiled = not args.eager  # compiled whatever the config says: the measurement
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    dynamic = {"true": True, "auto": None}[args.dynamic]
    if compiled:  # as parallelize does with train.compile (one process: in place), backend chosen here
        compile_layers(run.train_model, backend=backend, dynamic=dynamic)
    use_bf16 = run.autocast_dtype == torch.bfloat16
    batches = [lb.batch.to(device) for lb in host]
    flops = [run.built.flops(lb.batch) for lb in host] if run.built.flops else None
    model = run.model
    counter = [0]
    # The trainer's step and its one host sync, read after the next step is queued where the trainer does
    # so too (StepPipeline).
    pipeline = StepPipeline(run, cfg.train.overlap_steps)

    def step(i: int) -> None:
        step_on(batches[i % len(batches)])

    def step_on(batch: Any) -> None:
        pipeline.push(batch, counter[0], read=False)
        counter[0] += 1

    def drain() -> None:
        pipeline.flush()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = compile_counters()
    t0 = time.perf_counter()
    step(0)
    drain()
    _sync(device)
    first = time.perf_counter() - t0
    for i in range(1, len(batches)):
        step(i)
    drain()
    _sync(device)
    warmup = time.perf_counter() - t0
    after_warmup = compile_counters()
    times: list[float] = []
    t1 = time.perf_counter()
    for i in range(args.steps):
        ts = time.perf_counter()
        step(i)
        if args.sync_each_step:
            _sync(device)
        times.append(time.perf_counter() - ts)
    drain()
    _sync(device)
    wall = time.perf_counter() - t1
    after_steady = compile_counters()
    mean_s = wall / args.steps
    peak = run.peak_flops
    out: dict[str, Any] = {
        "recipe": recipe,
        "compiled": compiled,
        "backend": backend if compiled else "eager",
        "dynamic": args.dynamic,
        "autocast": "bf16" if use_bf16 else "fp32",
        "converted_linears": sum(type(m).__name__ == "MXFP8Linear" for m in model.modules()),
        "warmup_s": warmup,
        "first_step_s": first,
        "warmup_steps": len(batches),
        "graphs_compiled_in_warmup": after_warmup["frames_ok"] - before["frames_ok"],
        "graphs_compiled_in_steady": after_steady["frames_ok"] - after_warmup["frames_ok"],
        "graph_breaks": after_steady["graph_breaks"] - before["graph_breaks"],
        "steps": args.steps,
        "step_ms_mean": 1e3 * mean_s,
        "step_ms_host_median": 1e3 * statistics.median(times),
        "examples_per_s": cfg.data.batch_size / mean_s,
    }
    if flops is not None:
        f = statistics.fmean(flops)
        out["model_gflop_per_step"] = f / 1e9
        out["model_tflops_per_s"] = f / mean_s / 1e12
        out["mfu_datasheet"] = f / mean_s / peak if peak else None
        if args.gemm_ceiling:
            out["mfu_of_measured_bf16_gemm"] = f / mean_s / args.gemm_ceiling
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.prefetch_steps > 0:
        # As the training loop gets them: host batches (pinned), copied one step ahead on a side stream.
        pinned = [lb.batch.pin_memory() if device.type == "cuda" else lb.batch for lb in host]
        items = (pinned[i % len(pinned)] for i in range(args.prefetch_steps))
        _sync(device)
        t2 = time.perf_counter()
        for _, batch in DevicePrefetcher(items, device):
            step_on(batch)
        drain()
        _sync(device)
        out["step_ms_prefetched"] = 1e3 * (time.perf_counter() - t2) / args.prefetch_steps
        out["prefetched_over_resident_rate"] = out["step_ms_mean"] / out["step_ms_prefetched"]
        out["graphs_compiled_in_steady"] = compile_counters()["frames_ok"] - after_warmup["frames_ok"]
    if args.profile_steps > 0:
        out["profile"] = profile(step, args.profile_steps, device)
        drain()
    if recipe in args.cuda_graphs.split(",") and device.type == "cuda":
        from graph_steps import measure_cuda_graphs  # this folder (the script's) is on sys.path

        drain()
        try:
            g = measure_cuda_graphs(run, batches, flops, args.steps, device)
        except Exception as e:  # a capture that fails is a result: report it, keep the recipe's numbers
            import traceback

            out["cuda_graphs"] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:],
            }
            print(f"{recipe}: cuda graphs FAILED: {type(e).__name__}: {e}", flush=True)
            return out
        g["speedup_vs_step"] = out["step_ms_mean"] / g["graph_ms"]
        g["padded_eager_vs_step"] = out["step_ms_mean"] / g["eager_padded_ms"]
        out["cuda_graphs"] = g
        print(f"{recipe}: cuda graphs {g['graph_ms']:.1f} ms/step ({g['speedup_vs_step']:.2f}x the step's "
              f"{out['step_ms_mean']:.1f} ms; padded, kernel by kernel: {g['eager_padded_ms']:.1f} ms); "
              f"buckets {g['buckets']}, padding {g['padding_on_these_batches']['padded_events']:.1%}, "
              f"{g['graph_stats']['captures']} captures in {g['graph_stats']['capture_s']:.1f} s, "
              f"pool {g['graph_pool_gib']:.1f} GiB", flush=True)  # fmt: skip
    return out


def profile(step: Any, n: int, device: torch.device) -> dict[str, Any]:
    """Share of device (or CPU, on the CPU) self time by kernel kind over ``n`` steps, the top kernels, and
    what the host threads spent their time on (``loop_profile.host_breakdown``: launches per step, top-level
    time by region: compiled graphs, gem custom ops, optimizer, embeddings, eager aten ops)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for i in range(n):
            step(i)
        _sync(device)
    by_kind: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if device.type == "cuda":
            t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
            if getattr(evt, "device_type", None) is not None and "CUDA" not in str(evt.device_type):
                continue
        else:
            t = evt.self_cpu_time_total if evt.key.startswith("aten::") else 0.0
        if t <= 0:
            continue
        by_kind[kernel_kind(evt.key)] += t
        by_kernel[evt.key] += t
    total = sum(by_kind.values()) or 1.0
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:40]
    from loop_profile import host_breakdown, main_thread_of  # this folder (the script's) is on sys.path

    events = list(prof.events())
    return {
        "host": host_breakdown(events, n, main_thread_of(events)),
        "gpu_ms_per_step": total / 1e3 / n,
        "share_by_kind": {k: v / total for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k[:120], "share": v / total, "ms_per_step": v / 1e3 / n} for k, v in top],
    }


def _table(results: dict[str, Any]) -> str:
    rows = [
        ("warm-up s (first step s)", lambda r: f"{r['warmup_s']:.1f} ({r['first_step_s']:.1f})"),
        (
            "graphs compiled warm-up / steady",
            lambda r: f"{r['graphs_compiled_in_warmup']} / {r['graphs_compiled_in_steady']}",
        ),
        ("graph breaks", lambda r: str(r["graph_breaks"])),
        ("step ms (mean)", lambda r: f"{r['step_ms_mean']:.1f}"),
        (
            "step ms, batches prefetched from host",
            lambda r: f"{r.get('step_ms_prefetched', float('nan')):.1f}",
        ),
        ("examples/s", lambda r: f"{r['examples_per_s']:,.0f}"),
        ("model TFLOP/s", lambda r: f"{r.get('model_tflops_per_s', float('nan')):.1f}"),
        ("MFU of datasheet bf16 peak", lambda r: _pct(r.get("mfu_datasheet"))),
        ("MFU of measured bf16 GEMM", lambda r: _pct(r.get("mfu_of_measured_bf16_gemm"))),
        ("peak memory GiB", lambda r: f"{r.get('peak_memory_gib', float('nan')):.1f}"),
    ]
    recipes = results["recipes"]
    names = list(recipes)
    lines = [f"| {results['config']} on {results['device']} | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]  # fmt: skip
    for label, fn in rows:
        lines.append(f"| {label} | " + " | ".join(fn(recipes[n]) for n in names) + " |")
    if len(names) == 2 and all("step_ms_mean" in recipes[n] for n in names):
        a, b = (recipes[n]["step_ms_mean"] for n in names)
        lines.append(f"| step-rate ratio {names[1]}/{names[0]} | {a / b:.2f}x |")
    for n in names:
        prof = recipes[n].get("profile")
        if prof:
            shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in prof["share_by_kind"].items())
            lines.append(f"\n{n}: {prof['gpu_ms_per_step']:.1f} ms of kernels per step: {shares}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", default="base-h200", help="shipped config name or TOML path ('tiny' = tiny-cpu)"
    )
    p.add_argument("--out", required=True, type=Path)
    p.add_argument(
        "--recipes", default="bf16,fp8_rowwise", help="comma-separated: bf16, fp8_rowwise, mxfp8, ..."
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps per recipe")
    p.add_argument(
        "--distinct", type=int, default=6, help="distinct batches (jagged sizes), all seen in warm-up"
    )
    p.add_argument(
        "--profile-steps", type=int, default=None, help="profiled steps (default 4 on CUDA, 0 on CPU)"
    )
    p.add_argument(
        "--prefetch-steps",
        type=int,
        default=None,
        help="steps fed from host batches by DevicePrefetcher (default: --steps)",
    )
    p.add_argument(
        "--eager", action="store_true", help="do not compile (else compiled, whatever train.compile)"
    )
    p.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; aot_eager on CPU)"
    )
    p.add_argument(
        "--dynamic",
        choices=("true", "auto"),
        default="true",
        help="true: jagged sizes symbolic from the first compile; auto: torch's automatic dynamic",
    )
    p.add_argument("--sync-each-step", action="store_true", help="synchronize after every timed step")
    p.add_argument(
        "--cuda-graphs",
        nargs="?",
        const="bf16",
        default="",
        help="for these recipes (comma-separated; the flag alone: bf16), also the step replayed as CUDA "
        "graphs over bucketed jagged sizes (benchmarks/graph_steps.py), after its other measurements",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    args = p.parse_args(argv)
    if args.steps < 1 or args.distinct < 1:
        p.error("--steps and --distinct must be >= 1")
    t_start = time.perf_counter()
    base = _load(args.config, args.overrides)
    d = init_distributed(base.run.device, base.run.cpu_threads)
    device = d.device
    if args.prefetch_steps is None:
        args.prefetch_steps = args.steps
    if args.profile_steps is None:
        args.profile_steps = 4 if device.type == "cuda" else 0
    args.out.mkdir(parents=True, exist_ok=True)
    out_path = args.out / "bench_speed.json"
    source = build_source(base)
    args.spec = source.spec
    t0 = time.perf_counter()
    host = [source.get("train", i, base.data.batch_size) for i in range(args.distinct)]
    data_s = time.perf_counter() - t0
    ceilings: dict[str, float] = {}
    size = 8192 if device.type == "cuda" else 256
    ceilings["bf16"] = measure_gemm_ceiling(device, torch.bfloat16, size=size)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        ceilings["fp8_rowwise"] = measure_gemm_ceiling(device, torch.float8_e4m3fn, size=size)
    args.gemm_ceiling = ceilings["bf16"] if device.type == "cuda" else None
    seqs = [next(iter(lb.batch.sequences.values())) for lb in host]
    results: dict[str, Any] = {
        "config": base.run.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "batch_size": base.data.batch_size,
        "batch_events": [s.total for s in seqs],
        "batch_max_len": [s.max_len for s in seqs],
        "data_s_per_batch": data_s / args.distinct,
        "peak_flops_datasheet": device_peak_flops(device, base.train.peak_flops),
        "mfu_basis": MFU_BASIS,
        "gemm_ceiling_tflops": {k: v / 1e12 for k, v in ceilings.items()},
        "compile_cache": str(compile_cache_dir()),
        "recipes": {},
    }
    for recipe in [r.strip() for r in args.recipes.split(",") if r.strip()]:
        conversion = "none" if recipe == "bf16" else recipe
        try:
            cfg = _load(
                args.config, [*args.overrides, f"precision.recipe={conversion}", "train.compile=false"]
            )
            results["recipes"][recipe] = run_recipe(cfg, recipe, host, args, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the recipe's model and optimizer state are gone
        except Exception as e:  # one recipe's failure is reported, the others still run
            results["recipes"][recipe] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{recipe}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        results["elapsed_s"] = time.perf_counter() - t_start
        _write_json(out_path, results)
        print(f"{recipe}: done at {results['elapsed_s']:.0f} s", flush=True)
    ok = {k: v for k, v in results["recipes"].items() if "error" not in v}
    print(_table({**results, "recipes": ok}))
    print(f"wrote {out_path}")
    return 0 if len(ok) == len(results["recipes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
