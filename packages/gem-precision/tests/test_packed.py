"""Packed 8-bit rows (``gem_precision.packed``): the reference against the quantizers it packs and an
independent reading of the layout, the face's checks, and the Triton kernels (``_triton_packed_checks.py``:
under ``TRITON_INTERPRET=1`` in a subprocess on the CPU, natively on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gem_precision import quantize_rowwise, to_mx
from gem_precision.packed import dequantize_packed, packed_width, quantize_packed, quantize_packed_many

SCRIPT = Path(__file__).with_name("_triton_packed_checks.py")


def _weights(r: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, k, generator=g) * 10.0 ** (torch.rand(r, 1, generator=g) * 8 - 4)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
@pytest.mark.parametrize(("r", "k"), [(1, 1), (7, 33), (16, 96), (5, 100)])
def test_layout_read_independently(fmt, r, k):
    """Element bytes are the quantizer's data, the tail its scales: read back field by field."""
    x = _weights(r, k, r + k)
    packed = quantize_packed(x, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (r, packed_width(k, fmt))
    if fmt == "fp8":
        data, scale = quantize_rowwise(x)
        assert torch.equal(packed[:, :k], data.view(torch.uint8))
        tail = [int.from_bytes(bytes(row.tolist()), "little") for row in packed[:, k:]]
        assert torch.equal(torch.tensor(tail, dtype=torch.int64).to(torch.int32).view(torch.float32),
                           scale.reshape(-1))  # fmt: skip
        assert packed.shape[1] == k + 4
    else:
        mx = to_mx(x, axis=-1, block_size=32, scale_mode="rceil")
        assert torch.equal(packed[:, :k], mx.data.view(torch.uint8))
        assert torch.equal(packed[:, k:], mx.scale)
        assert packed.shape[1] == k + -(-k // 32)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_fp8_error(fmt, dtype):
    """dequantize(quantize(x)) is x up to E4M3's rounding: half a unit in the last of 3 mantissa bits
    (2^-4 relative) above each row's (block's) smallest normal; exact zeros stay zeros."""
    x = _weights(40, 96, 3)
    x[0] = 0.0
    w = dequantize_packed(quantize_packed(x, fmt), 96, fmt, dtype).float()
    assert torch.equal(w[0], torch.zeros(96))
    big = x.abs() > x.abs().amax(dim=1, keepdim=True) * 2**-6  # normal E4M3 range of the row's scale
    rel = ((w - x).abs() / x.abs())[big]
    bound = 2**-4 + (2**-8 if dtype == torch.bfloat16 else 0.0)  # bf16's own rounding on top
    assert float(rel.max()) <= bound


def test_dequantize_into_out_and_dtype():
    x = _weights(8, 64, 1)
    packed = quantize_packed(x, "fp8")
    out = torch.full((64, 8), 3.0).t()  # a strided buffer
    ret = dequantize_packed(packed, 64, "fp8", out=out)
    assert ret is out and torch.equal(out, dequantize_packed(packed, 64, "fp8", torch.float32))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_many_is_each_shard_packed_alone(fmt):
    """The round op gives, per shard and in order, what quantizing that shard alone gives (mixed shapes,
    dtypes, strides and empty shards); no shards, no results."""
    xs = [
        _weights(8, 64, 1),
        _weights(3, 40, 2).to(torch.bfloat16),
        _weights(40, 12, 3).t(),
        torch.zeros(0, 32),
    ]
    got = quantize_packed_many(xs, fmt)
    assert len(got) == len(xs)
    for x, g in zip(xs, got):
        assert torch.equal(g, quantize_packed(x, fmt))
    assert quantize_packed_many([], fmt) == []


def test_many_rejects_bad_input():
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_packed_many([torch.randn(2, 2)], "int8")
    with pytest.raises(ValueError, match=r"xs\[1\] has shape \(4,\)"):
        quantize_packed_many([torch.randn(2, 2), torch.randn(4)], "fp8")
    with pytest.raises(TypeError, match="floating-point"):
        quantize_packed_many([torch.ones(2, 2, dtype=torch.int64)], "fp8")
    meta = torch.empty(2, 2, device="meta")
    with pytest.raises(ValueError, match=r"xs\[1\] is on meta"):
        quantize_packed_many([torch.randn(2, 2), meta], "fp8")


def test_face_rejects_bad_input():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_packed(x, "fp4")
    with pytest.raises(ValueError, match="2-D"):
        quantize_packed(x[None], "fp8")
    with pytest.raises(TypeError, match="floating-point"):
        quantize_packed(x.to(torch.int32), "fp8")
    packed = quantize_packed(x, "mxfp8")
    with pytest.raises(ValueError, match="do not hold k=31"):
        dequantize_packed(packed, 31, "mxfp8")
    with pytest.raises(TypeError, match="uint8"):
        dequantize_packed(packed.float(), 32, "mxfp8")
    with pytest.raises(ValueError, match="out must be"):
        dequantize_packed(packed, 32, "mxfp8", out=torch.empty(4, 33))
    with pytest.raises(ValueError, match="k must be >= 0"):
        packed_width(-1, "fp8")


def _run(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=280
    )


def test_packed_kernels_under_interpreter():
    pytest.importorskip("triton")
    proc = _run({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAILED: none" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_kernels_on_gpu():
    proc = _run({}, "--big")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
