"""benchmarks/bench_speed.py end to end on the CPU (tiny config, dynamo-only backend): the JSON it writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_scripts import load_benchmark


def test_kernel_kinds():
    kind = load_benchmark("bench_speed").kernel_kind
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kind("_rowwise_kernel") == "fp8 / mx quantization"
    assert kind("_tile_quant_kernel") == kind("_tile_amax_kernel") == "fp8 / mx quantization"
    assert kind("_fwd_kernel") == "attention (gem_kernels)"
    assert kind("triton_poi_fused_add_mul_0") == "inductor fused"
    assert kind("_rotary_kernel") == "jagged / rotary (gem_kernels)"
    assert kind("Memcpy HtoD (Pinned -> Device)") == "copies / memset"
    assert kind("something_new") == "other"


@pytest.mark.slow
def test_bench_speed_tiny_cpu(tmp_path):
    """Two recipes, compiled (dynamo's eager backend, to keep it short), 2 steps: every field is there, no
    graph compiled in the steady state, and the table prints (90 s on the loaded 2-core machine)."""
    rc = load_benchmark("bench_speed").main(
        ["--config", "tiny", "--steps", "2", "--distinct", "3", "--backend", "eager", "--out", str(tmp_path)]
    )
    assert rc == 0
    data = json.loads((tmp_path / "bench_speed.json").read_text())
    assert set(data["recipes"]) == {"bf16", "fp8_rowwise"}
    assert len(set(data["batch_events"])) == 3  # the warm-up batches differ in size
    for r in data["recipes"].values():
        assert r["compiled"] and r["graphs_compiled_in_warmup"] >= 1
        assert r["graphs_compiled_in_steady"] == 0 and r["graph_breaks"] == 0
        assert r["step_ms_mean"] > 0 and r["warmup_s"] >= r["first_step_s"] > 0
        assert r["step_ms_prefetched"] > 0  # the steps fed by DevicePrefetcher ran too
    assert "bf16" in data["mfu_basis"] and data["gemm_ceiling_tflops"]["bf16"] > 0
