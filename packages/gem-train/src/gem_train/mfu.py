"""Model FLOPs utilization: achieved model FLOP/s over the device's peak.

Peaks are dense bf16 FLOP/s without sparsity. The H200 entry is the bf16 GEMM ceiling measured on our H200
(8192^3 GEMM: 794 TFLOP/s, see shared/notes/platform.md), not the datasheet's 989 TFLOP/s, so MFU on it
reads as a share of what a GEMM actually reaches there; the others are datasheet values. A config value
(``train.peak_flops``) overrides the table.
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_FLOPS", "device_peak_flops", "mfu"]

# Substring of torch.cuda.get_device_name() -> dense bf16 peak FLOP/s. First match wins (longest first).
PEAK_FLOPS: dict[str, float] = {
    "H200": 794e12,  # measured bf16 GEMM ceiling here (datasheet: 989e12)
    "H100": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "GH200": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def device_peak_flops(device: torch.device, override: float = 0.0) -> float | None:
    """Peak bf16 FLOP/s of ``device`` (``override`` if > 0); None on the CPU or an unknown GPU."""
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
