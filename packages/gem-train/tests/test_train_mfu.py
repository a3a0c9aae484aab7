"""MFU against the datasheet dense bf16 peak by device name, and the measured GEMM ceiling."""

from __future__ import annotations

import pytest
import torch

from gem_train.loop import mfu as m


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),  # the longest matching key wins
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Some Future GPU", None),
    ],
)
def test_peak_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert m.device_peak_flops(torch.device("cuda", 0)) == peak
    assert m.device_peak_flops(torch.device("cuda", 0), override=5e14) == 5e14  # train.peak_flops wins


def test_cpu_has_no_peak_and_mfu_needs_one():
    assert m.device_peak_flops(torch.device("cpu")) is None
    assert m.mfu(1e12, 1.0, None) is None
    assert m.mfu(989e12 * 0.35, 1.0, 989e12) == pytest.approx(0.35)
    assert "bf16" in m.MFU_BASIS


def test_gemm_ceiling_on_cpu():
    flops = m.measure_gemm_ceiling(torch.device("cpu"), size=64, iters=3)
    assert 1e6 < flops < 1e14  # a 64^3 GEMM on any CPU
