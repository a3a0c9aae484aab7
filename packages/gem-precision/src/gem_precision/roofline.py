"""When an FP8 row-wise GEMM pays: a stated roofline of one GEMM in bf16 and in ``fp8_rowwise``.

A GEMM ``C [M, N] = A [M, K] @ B [N, K].T`` of a linear layer takes, on a device with the rates of
:class:`DeviceRates`:

- bf16: ``2 M K N / bf16_flops`` (cuBLAS; the operands are bf16 already under autocast);
- fp8_rowwise: ``2 M K N / fp8_flops`` (``torch._scaled_mm``) plus the casts of both operands, each one
  read of bf16 and one write of FP8 per element at a measured share of the copy rate: row-wise
  (``quantize_rowwise``: ``row_cast_bytes`` per element at ``row_cast_efficiency``; its second read comes
  from L2) for an operand stored ``[rows, K]``, column-wise transposed (the tiled two-pass kernel:
  ``col_cast_bytes`` at ``col_cast_efficiency``) for one stored ``[K, rows]`` (the weight gradient's
  ``dy.T`` and ``x.T``, and the weight in dgrad), plus ``cast_kernel_s`` of fixed cost per cast kernel
  (two per row-wise cast pair, three with a column-wise one).

The speed-up is the ratio of the two. A layer's three GEMMs are forward ``[T, in] @ [out, in].T`` (A = x
row-wise, B = w row-wise), dgrad ``[T, out] @ [in, out].T`` (A = dy row-wise, B = w column-wise) and wgrad
``[out, T] @ [in, T].T`` (A = dy column-wise, B = x column-wise) for T tokens (see
:meth:`gem_precision.Recipe.for_layer`). At base-h200's widths (512) the casts cost more than the FP8
tensor cores save in most GEMMs; at widths of several thousand they pay (gem-precision BENCHMARKS.md:
1.57x at 65536 x 4096 x 4096, 0.18-0.64x at base's layers).

Rates are measured numbers (gem-precision BENCHMARKS.md, H200 2026-12-03): :data:`H200`; :data:`H100` takes
the same compute and the H100's lower copy rate (3.0 TB/s measured, against 4.2). Other devices and the CPU
(where FP8 GEMMs are emulated) use the H100's rates, so CPU tests see the decisions of an H100 (the
conservative of the two: casts cost more there). ``benchmarks/bench_fp8_layers.py`` measures a device's
rates and prints them as a :class:`DeviceRates` to put here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "AUTO_MIN_SPEEDUP",
    "H100",
    "H200",
    "DeviceRates",
    "fp8_gemm_speedup",
    "gemm_times",
    "rates_for",
    "use_rates",
]


@dataclass(frozen=True)
class DeviceRates:
    """Measured rates of one GPU kind (per second), and the fixed cost of a cast kernel.

    Attributes:
        bf16_flops: cuBLAS bf16 GEMM rate at the layers' shapes (FLOP/s).
        fp8_flops: ``torch._scaled_mm`` row-wise FP8 rate with fast accumulation (the forward GEMM).
        fp8_flops_precise: the same without fast accumulation (dgrad and wgrad: ``fp8_fast_accum_backward``
            off by default).
        copy_bytes: device memory copy rate (bytes read + written per second).
        row_cast_bytes / col_cast_bytes: bytes each row-wise / column-wise (transposed) cast moves per
            element (bf16 read(s) from device memory + the FP8 write).
        row_cast_efficiency / col_cast_efficiency: the share of ``copy_bytes`` those casts reach.
        cast_kernel_s: fixed time per cast kernel launch (a small tensor's cast is all of it).
    """

    name: str
    bf16_flops: float
    fp8_flops: float
    fp8_flops_precise: float
    copy_bytes: float
    row_cast_bytes: float = 3.0
    col_cast_bytes: float = 5.0
    row_cast_efficiency: float = 0.6
    col_cast_efficiency: float = 0.5
    cast_kernel_s: float = 5e-6

    def cast_s(self, rows: int, k: int, *, column: bool) -> float:
        """Seconds to cast a bf16 operand of ``rows x k`` elements to row-wise FP8 along ``k`` (``column``:
        stored ``[k, rows]``, quantized per column and transposed: the tiled two-pass kernel)."""
        n = rows * k
        if column:
            return (
                n * self.col_cast_bytes / (self.col_cast_efficiency * self.copy_bytes)
                + 3 * self.cast_kernel_s
            )
        return n * self.row_cast_bytes / (self.row_cast_efficiency * self.copy_bytes) + 2 * self.cast_kernel_s


# H200 (gem-precision BENCHMARKS.md, 2026-12-03): bf16 GEMMs of the layers 645-742 TF/s, bf16 matmul
# 65536x1024x1024 647 TF/s; _scaled_mm row-wise 1,145 TF/s at 65536x1024x1024 (1,345 at 8192^3); without
# fast accumulation the 4096-wide layer took 6.69 ms against 6.15 (~10% slower GEMMs); copy 4.12-4.23 TB/s;
# the row-wise cast at 55-75% of the copy rate (3 B/element), the tiled column cast at 48-55% (5 B).
H200 = DeviceRates("H200", bf16_flops=680e12, fp8_flops=1150e12, fp8_flops_precise=1000e12, copy_bytes=4.2e12)
H100 = DeviceRates("H100", bf16_flops=680e12, fp8_flops=1150e12, fp8_flops_precise=1000e12, copy_bytes=3.0e12)
# A GEMM runs in FP8 under Recipe.fp8_rowwise(auto_fallback=True) only where the roofline predicts at least
# this speed-up: the rates are medians, and a cast's fixed costs vary with the shape.
AUTO_MIN_SPEEDUP = 1.1


_override: list[DeviceRates] = []


@contextlib.contextmanager
def use_rates(rates: DeviceRates) -> Iterator[None]:
    """Inside the block every device's per-call decisions use ``rates`` (measured rates of this GPU, from
    ``benchmarks/bench_fp8_layers.py``; or made-up ones in a test)."""
    _override.append(rates)
    try:
        yield
    finally:
        _override.pop()


def rates_for(device: torch.device | str | None = None) -> DeviceRates:
    """The rates of ``device``'s GPU by name (H200, else H100's); the CPU gets the H100's (:func:`use_rates`
    overrides both)."""
    if _override:
        return _override[-1]
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return H100
    return _cuda_rates(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _cuda_rates(index: int) -> DeviceRates:
    return H200 if "H200" in torch.cuda.get_device_name(index) else H100


def gemm_times(
    m: int, k: int, n: int, *, a_col: bool, b_col: bool, precise: bool, rates: DeviceRates,
    b_cached: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """``(bf16 seconds, fp8_rowwise seconds)`` of ``[M, K] @ [N, K].T``; ``a_col`` / ``b_col``: that operand
    is stored transposed (``[K, M]`` / ``[K, N]``) and cast column-wise; ``precise``: no fast
    accumulation; ``b_cached``: B's FP8 copy is already made (a cached weight cast: no cast per call)."""
    flops = 2.0 * m * k * n
    fp8 = flops / (rates.fp8_flops_precise if precise else rates.fp8_flops)
    fp8 += rates.cast_s(m, k, column=a_col) + (0.0 if b_cached else rates.cast_s(n, k, column=b_col))
    return flops / rates.bf16_flops, fp8


def fp8_gemm_speedup(
    m: int, k: int, n: int, *, a_col: bool = False, b_col: bool = False, precise: bool = False,
    rates: DeviceRates | None = None, b_cached: bool = False,
) -> float:  # fmt: skip
    """Predicted bf16 time / fp8_rowwise time of the GEMM (see :func:`gemm_times`; > 1: FP8 pays)."""
    if min(m, k, n) <= 0:
        return 0.0
    t_bf16, t_fp8 = gemm_times(
        m, k, n, a_col=a_col, b_col=b_col, precise=precise, rates=rates or H100, b_cached=b_cached
    )
    return t_bf16 / t_fp8
