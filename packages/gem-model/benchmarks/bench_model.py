"""Forward+backward step time, MFU and per-block time shares of a GemModel config on one GPU.

MFU = flops(config, batch) / step time / peak, with peak = 794e12 (bf16 GEMM 8192^3 measured on the
H200, 2026-12-02). The model runs under bf16 autocast with fp32 parameters; the batch is a
``random_batch`` (log-normal history lengths). Per-block shares come from torch.profiler: the script
(not the model) opens a profiler range around each block's forward and its backward, through module
hooks, and sums the GPU kernel time launched inside each range.

Usage (H200; PYTHONPATH must hold packages/*/src):
    python packages/gem-model/benchmarks/bench_model.py --config base --batch-size 512 --out $OUT
On a CPU (a smoke test of the script itself): --device cpu --config tiny --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import gem_model as gm

H200_BF16_PEAK = 794e12


def _block_of(name: str, model: gm.GemModel) -> str | None:
    """Block label for a module name, or None for modules we do not annotate."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) == 3:
        kind = {"x_summary": "x_summary", "s_summary": "seq_summary (PMA+recent)", "mixer": "wukong experts",
                "cross": "cross_attention (GDPA)", "ffn": "ffn (SwiGLU)"}.get(parts[2])  # fmt: skip
        if parts[2] == "attn":
            kind = f"self_attention ({model.config.attention_kind(int(parts[1]))})"
        return kind
    if name in ("final_x", "final_s", "heads"):
        return "final summaries + heads"
    if name == "embeddings":
        return "embeddings (forward)"
    return None


def annotate(model: gm.GemModel) -> list:
    """Profiler ranges around each block's forward and backward (hooks; returns the handles)."""
    handles = []
    for name, module in model.named_modules():
        label = _block_of(name, model)
        if hasattr(module, "_orig_mod"):  # a compiled layer: one range for the whole layer
            label = "layers (compiled, all blocks)"
        elif "._orig_mod" in name:
            label = None
        if label is None:
            continue
        stack: list = []

        def enter(stack=stack, label=label):
            rf = torch.autograd.profiler.record_function(f"block::{label}")
            rf.__enter__()
            stack.append(rf)

        def leave(stack=stack):
            if stack:
                stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(lambda m, a, enter=enter: enter()))
        handles.append(module.register_forward_hook(lambda m, a, o, leave=leave: leave()))
        if name != "embeddings":  # its inputs need no gradient: a backward hook would never fire
            handles.append(module.register_full_backward_pre_hook(lambda m, g, enter=enter: enter()))
            handles.append(module.register_full_backward_hook(lambda m, gi, go, leave=leave: leave()))
    return handles


def step(model: gm.GemModel, batch: gm.GemBatch, device: str) -> torch.Tensor:
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = model(batch)
    loss, _ = gm.multitask_loss(logits, batch)
    loss.backward()
    return loss


def _device_time(evt) -> float:
    return getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)


def _self_device_time(evt) -> float:
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)


def run(args: argparse.Namespace) -> dict:
    device = args.device
    config = gm.get_config(args.config)
    # Meta build + init on the device: no host allocation of the tables.
    model = gm.GemModel(config, device="meta")
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    if args.compile:
        # Per-layer compilation (torchtitan style): fuses the norms, gates and residual adds of a layer.
        for name, layer in model.layers.items():
            model.layers[name] = torch.compile(layer)
    counts = gm.parameter_counts(config)
    batch_size = args.batch_size
    while True:
        batch = gm.random_batch(config.features, batch_size, seed=1).to(device)
        try:
            for _ in range(args.warmup):  # includes Triton autotuning of every attention variant
                model.zero_grad(set_to_none=True)
                loss = step(model, batch, device)
            if device == "cuda":
                torch.cuda.synchronize()
            break
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            batch_size //= 2
            print(f"OOM: retrying with batch {batch_size}", flush=True)
            torch.cuda.empty_cache()
    n_flops = gm.flops(config, batch)
    by_block_flops = gm.flops_by_block(config, batch)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(model, batch, device)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0

    # Per-block time shares from the profiler (hooks add a little host overhead; shares only).
    handles = annotate(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    model.zero_grad(set_to_none=True)
    with profile(activities=activities) as prof:
        step(model, batch, device)
        if device == "cuda":
            torch.cuda.synchronize()
    for h in handles:
        h.remove()
    events = prof.events()
    timer = _device_time if device == "cuda" else (lambda e: e.cpu_time_total)
    self_timer = _self_device_time if device == "cuda" else (lambda e: e.self_cpu_time_total)
    total = sum(self_timer(e) for e in events if not e.name.startswith("block::"))
    shares: dict[str, float] = defaultdict(float)
    for e in events:
        if e.name.startswith("block::"):
            shares[e.name[len("block::") :]] += timer(e)
    shares["other (norms, residuals, embedding bwd, loss)"] = max(total - sum(shares.values()), 0.0)
    top = prof.key_averages().table(
        sort_by="self_cuda_time_total" if device == "cuda" else "self_cpu_time_total", row_limit=25
    )

    tokens = sum(s.item_ids.numel() for s in batch.sequences.values())
    result = {
        "config": args.config,
        "compile": args.compile,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch_size": batch_size,
        "history_tokens": tokens,
        "mean_history_len": tokens / batch_size,
        "step_ms_median": step_s * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "model_tflop_per_step": n_flops / 1e12,
        "achieved_tflops": n_flops / step_s / 1e12,
        "mfu": n_flops / step_s / args.peak,
        "peak_memory_gib": peak_mem,
        "params": counts,
        "loss": float(loss),
        "time_share": {k: v / total for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
        "flop_share": {k: v / n_flops for k, v in by_block_flops.items()},
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"model_{args.config}_b{batch_size}.json").write_text(json.dumps(result, indent=2))
        (out / f"model_{args.config}_b{batch_size}_profile.txt").write_text(top)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="base", choices=gm.CONFIG_NAMES)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak", type=float, default=H200_BF16_PEAK)
    p.add_argument("--out", default="")
    p.add_argument("--compile", action="store_true", help="torch.compile each layer")
    args = p.parse_args()
    r = run(args)
    print(f"\n{args.config} on {r['device']}: batch {r['batch_size']}, {r['history_tokens']} history tokens "
          f"(mean {r['mean_history_len']:.0f}), peak memory {r['peak_memory_gib']:.1f} GiB")  # fmt: skip
    print(f"step {r['step_ms_median']:.1f} ms (fwd+bwd, median of {args.steps}), "
          f"{r['model_tflop_per_step']:.2f} TFLOP/step, {r['achieved_tflops']:.0f} TFLOP/s, "
          f"MFU {100 * r['mfu']:.1f}%")  # fmt: skip
    print(f"params: dense {r['params']['dense'] / 1e6:.1f}M, sparse {r['params']['sparse'] / 1e6:.1f}M")
    print("\nshare of GPU time per block (profiler):")
    for k, v in r["time_share"].items():
        print(f"  {k:<48} {100 * v:5.1f}%")
    agg: dict[str, float] = defaultdict(float)
    for k, v in r["flop_share"].items():
        agg[k.split(".")[-1] if k.startswith("layers.") else k] += v
    print("share of model FLOPs per block kind:")
    for k, v in sorted(agg.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<48} {100 * v:5.1f}%")


if __name__ == "__main__":
    main()
