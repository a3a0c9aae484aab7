"""benchmarks/loop_profile.py's host breakdown: launches and top-level time per host thread."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_scripts import load_benchmark


def _event(name, thread, start, end, self_us=None, parent=None, device=DeviceType.CPU):
    return SimpleNamespace(
        name=name, thread=thread, device_type=device, cpu_parent=parent,
        time_range=SimpleNamespace(start=start, end=end),
        self_cpu_time_total=(end - start) if self_us is None else self_us,
    )  # fmt: skip


def test_host_regions():
    region = load_benchmark("loop_profile").host_region
    assert region("Torch-Compiled Region: 3/0") == region("CompiledFunctionBackward") != "other"
    assert region("gem_kernels::jagged_attention_fwd") == "gem custom ops (eager)"
    assert region("Optimizer.step#AdamW.step") == "optimizer"
    assert region("autograd::engine::evaluate_function: MulBackward0").startswith("autograd engine")
    assert region("fbgemm::split_embedding_codegen_lookup_rowwise_adagrad_function").startswith("embeddings")
    assert region("cudaLaunchKernel") == "CUDA API"
    assert region("aten::add") == "eager aten ops"
    assert region("something") == "other"


def test_host_breakdown_per_thread_launches_and_regions():
    lp = load_benchmark("loop_profile")
    region = _event("Torch-Compiled Region: 0/0", 1, 0, 1000)
    engine = _event("autograd::engine::evaluate_function: CompiledFunctionBackward", 2, 1000, 3000)
    events = [
        region,
        _event("cudaLaunchKernel", 1, 100, 110, parent=region),
        _event("cudaLaunchKernel", 1, 200, 220, parent=region),
        _event("aten::mm", 1, 1500, 1600),
        engine,
        _event("cudaLaunchKernel", 2, 1100, 1130, parent=engine),
        _event("kernel", 0, 0, 500, device=DeviceType.CUDA),  # GPU events are not host threads
    ]
    out = lp.host_breakdown(events, steps=2, main_thread=1)
    assert set(out) == {"main", "autograd"}
    main, bwd = out["main"], out["autograd"]
    assert main["launches_per_step"] == 1.0 and bwd["launches_per_step"] == 0.5
    assert abs(main["launch_api_ms_per_step"] - 0.015) < 1e-9
    assert main["top_level_ms_per_step_by_region"] == {
        "compiled graphs (inductor wrappers, guards)": 0.5, "eager aten ops": 0.05,
    }  # fmt: skip
    assert bwd["top_level_ms_per_step_by_region"] == {"autograd engine (eager backward nodes)": 1.0}


def test_host_breakdown_of_a_real_cpu_profile():
    """A small model's steps under torch.profiler on the CPU: the optimizer and the eager ops show, the
    top-level time fits in the window, and a CPU run launches nothing."""
    lp = load_benchmark("loop_profile")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    events = list(prof.events())
    out = lp.host_breakdown(events, steps=3, main_thread=lp.main_thread_of(events))
    main = out["main"]
    assert main["launches_per_step"] == 0
    regions = main["top_level_ms_per_step_by_region"]
    assert regions.get("optimizer", 0) > 0 and regions.get("eager aten ops", 0) > 0
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    wall_ms = (max(e.time_range.end for e in cpu) - min(e.time_range.start for e in cpu)) / 1e3
    assert (
        sum(regions.values()) * 3 <= wall_ms * 1.001 + 1e-6
    )  # top-level events of one thread do not overlap
