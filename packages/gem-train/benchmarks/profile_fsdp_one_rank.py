"""Where FSDP2's one-rank overhead goes on ``base``: step time, peak memory, GPU busy time and top kernels.

Variants (comma-separated first argument): ``unwrapped``, ``fsdp`` (every unit), ``fsdp_no_reshard``
(``reshard_after_forward=False``), ``fsdp_emb_ignored`` (embedding tables outside FSDP) and
``fsdp_emb_ignored_no_reshard``. GPU only::

    python3 packages/gem-train/benchmarks/profile_fsdp_one_rank.py unwrapped,fsdp --out DIR

It measures gem-parallel's mechanisms on GEM, so it lives with gem-train (which may import every package);
it was ``packages/gem-parallel/benchmarks/profile_fsdp_one_rank.py``.
Results: ``packages/gem-parallel/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import bench_parallel as bp

import gem_model as gm
from gem_parallel import FSDPConfig
from gem_parallel.fsdp import apply_fsdp

VARIANTS = ("unwrapped", "fsdp", "fsdp_no_reshard", "fsdp_emb_ignored", "fsdp_emb_ignored_no_reshard")


def build(name: str, config: gm.GemConfig, args: SimpleNamespace, dims, mesh) -> nn.Module:
    if name == "unwrapped":
        return bp.parallel_model(config, args, dims, mesh, fsdp=False)
    model = bp.new_model(config, "cuda")
    fsdp = FSDPConfig(reshard_after_forward="no_reshard" not in name, wrap_single_rank=True)
    ignored = set(model.embeddings.parameters()) if "emb_ignored" in name else None
    return apply_fsdp(model, mesh, dims, fsdp, ignored_params=ignored)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("variants", default=",".join(VARIANTS), nargs="?")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--out", default="")
    cli = p.parse_args()
    args = SimpleNamespace(device="cuda", memory_budget=0.5, all_gather_min_numel=16384, warmup=3, steps=7)
    config = gm.get_config("base")
    dims, mesh = bp.init_one_rank("cuda")
    batch = bp.make_batch(config, cli.batch_size, "cuda")
    out = {}
    for name in cli.variants.split(","):
        model = build(name, config, args, dims, mesh)
        r = bp.timed(model, batch, args)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                bp.step(model, batch, "cuda")
            torch.cuda.synchronize()
        averages = prof.key_averages()
        # Summed self device time counts an aten op and its kernel both: only differences are meaningful.
        busy_ms = sum(e.self_device_time_total for e in averages) / 2 / 1e3
        print(f"=== {name}: step {r['step_ms']:.1f} ms, peak {r['peak_gib']:.1f} GiB, "
              f"GPU busy {busy_ms:.1f} ms/step", flush=True)  # fmt: skip
        print(averages.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
        out[name] = {"step_ms": r["step_ms"], "peak_gib": r["peak_gib"], "gpu_busy_ms": busy_ms}
        del model
        torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))
    if cli.out:
        Path(cli.out).mkdir(parents=True, exist_ok=True)
        (Path(cli.out) / "prof_fsdp.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
