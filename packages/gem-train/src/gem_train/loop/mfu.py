"""Model FLOPs utilization: achieved model FLOP/s over the device's datasheet dense bf16 peak.

As torchtitan does, the denominator is the datasheet's dense (no sparsity) bf16 tensor-core peak of the
device, looked up by name (``PEAK_FLOPS``; ``train.peak_flops`` overrides it). Every recipe is reported
against that same bf16 peak, FP8 runs included, so recipes compare on one scale (an FP8 run's MFU can exceed
what a bf16 run could reach; ``MFU_BASIS`` says so in the outputs). What a GEMM actually reaches on the device
is a separate number, :func:`measure_gemm_ceiling` (on our H200: 794 TFLOP/s for an 8192^3 bf16 GEMM,
shared/notes/platform.md), reported beside the MFU by the benchmarks.
"""

from __future__ import annotations

import time

import torch

__all__ = ["MFU_BASIS", "PEAK_FLOPS", "device_peak_flops", "measure_gemm_ceiling", "mfu"]

MFU_BASIS = "datasheet dense bf16 peak (FP8 recipes too)"

# Substring of torch.cuda.get_device_name() -> datasheet dense bf16 FLOP/s (without sparsity). The longest
# matching key wins, so "H100 PCIe" beats "H100".
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,  # H200 SXM (the NVL part: 835e12)
    "H200 NVL": 835e12,
    "H100": 989e12,  # H100 SXM ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def device_peak_flops(device: torch.device, override: float = 0.0) -> float | None:
    """Datasheet dense bf16 FLOP/s of ``device`` (``override`` if > 0); None on the CPU or an unknown GPU."""
    if override > 0:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key]
    return None


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """``flops / seconds / peak``, or None without a peak."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak


def measure_gemm_ceiling(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 8192, iters: int = 20
) -> float:
    """FLOP/s of a square ``size``^3 GEMM on ``device`` (the best of ``iters`` timed runs after a warm-up).

    ``dtype`` bf16 times ``torch.mm``; ``torch.float8_e4m3fn`` times ``torch._scaled_mm`` with row-wise
    fp32 scales and fast accumulation (the FP8 recipe's GEMM; CUDA sm89+ only). On the CPU pass a small
    ``size``; the number is only for reference there.
    """
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g)
    b = torch.randn(size, size, device=device, generator=g)
    if dtype == torch.float8_e4m3fn:
        qa, qb = a.to(dtype), b.to(dtype)
        sa = torch.ones(size, 1, device=device)
        sb = torch.ones(1, size, device=device)

        def gemm() -> torch.Tensor:
            return torch._scaled_mm(
                qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True
            )
    else:
        a, b = a.to(dtype), b.to(dtype)

        def gemm() -> torch.Tensor:
            return a @ b

    del g
    for _ in range(3):
        gemm()
    best = float("inf")
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gemm()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            gemm()
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2.0 * size**3 / best
