"""When an FP8 row-wise GEMM pays: a stated roofline of one GEMM in bf16 and in ``fp8_rowwise``.

A GEMM ``C [M, N] = A [M, K] @ B [N, K].T`` of a linear layer takes, on a device with the rates of
:class:`DeviceRates`:

- bf16: ``2 M K N / bf16_flops`` (cuBLAS; the operands are bf16 already under autocast);
- fp8_rowwise: ``2 M K N / fp8_rate`` (``torch._scaled_mm``) plus the casts of both operands, each one
  read of bf16 and one write of FP8 per element at a measured share of the copy rate: row-wise
  (``quantize_rowwise``: ``row_cast_bytes`` per element at ``row_cast_efficiency``; its second read comes
  from L2) for an operand stored ``[rows, K]``, column-wise transposed (the tiled two-pass kernel:
  ``col_cast_bytes`` at ``col_cast_efficiency``) for one stored ``[K, rows]`` (the weight gradient's
  ``dy.T`` and ``x.T``, and the weight in dgrad), plus ``cast_kernel_s`` of fixed cost per cast kernel
  (two per row-wise cast pair, three with a column-wise one). ``fp8_rate`` is not the peak: it is
  ``fp8_flops * K / (K + fp8_k_overhead) * waves`` — each output tile's epilogue (scaling and writing bf16)
  costs what ``fp8_k_overhead`` more K-steps of its main loop would, which is why a 512-deep FP8 GEMM runs at
  bf16's speed (0.89x at base-h200's 182000 x 512 x 4096 on an H100), and ``waves`` is the share of the SMs
  the ``128 x 128`` output tiles keep busy in their last wave (``_scaled_mm`` does not split K: a weight
  gradient's ``1536 x 512`` output is 48 tiles on 132 SMs). cuBLAS's bf16 GEMMs lose little to either
  (split-K, a short epilogue against a slower main loop), so ``bf16_flops`` stays one rate.

The speed-up is the ratio of the two. A layer's three GEMMs are forward ``[T, in] @ [out, in].T`` (A = x
row-wise, B = w row-wise), dgrad ``[T, out] @ [in, out].T`` (A = dy row-wise, B = w column-wise) and wgrad
``[out, T] @ [in, T].T`` (A = dy column-wise, B = x column-wise) for T tokens (see
:meth:`gem_precision.Recipe.for_layer`). At base-h200's widths (512) the casts cost more than the FP8
tensor cores save in most GEMMs; at widths of several thousand they pay (gem-precision BENCHMARKS.md:
1.57x at 65536 x 4096 x 4096, 0.13-0.89x at base's layers, up to 1.45x at large-h200's).

Rates are measured numbers (``benchmarks/bench_fp8_layers.py`` on an H100, 2026-12-07: bf16 747, FP8 1,272
(990 precise) TF/s, copy 2.98 TB/s, casts at 97% / 70% of it, 3.8 us per cast kernel; ``fp8_k_overhead``
fitted to its 42 GEMMs of base-h200 and large-h200: 256, the value with the smallest error among those that
pick no losing GEMM). :data:`H200` takes the same compute (the same GH100 chip) and its own copy rate (4.2
TB/s measured, 2026-12-03). Other devices and the CPU (where FP8 GEMMs are emulated) use the H100's rates.
``benchmarks/bench_fp8_layers.py`` measures a device's rates and prints them as a :class:`DeviceRates`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

__all__ = [
    "AUTO_MIN_SPEEDUP",
    "H100",
    "H200",
    "DeviceRates",
    "fp8_gemm_speedup",
    "gemm_times",
    "layer_rates",
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
        fp8_k_overhead: K-steps an FP8 output tile's epilogue costs (see the module docstring).
        sms: streaming multiprocessors (the tiles of one wave).
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
    fp8_k_overhead: int = 256
    sms: int = 132

    def fp8_rate(self, m: int, k: int, n: int, *, precise: bool) -> float:
        """FLOP/s of ``torch._scaled_mm`` on ``[M, K] @ [N, K].T``: the peak, less the epilogue's share at
        this K and the idle SMs of the last wave of ``128 x 128`` output tiles."""
        tiles = math.ceil(m / 128) * math.ceil(n / 128)
        waves = tiles / (math.ceil(tiles / self.sms) * self.sms)
        peak = self.fp8_flops_precise if precise else self.fp8_flops
        return peak * k / (k + self.fp8_k_overhead) * waves

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


# H100 (benchmarks/bench_fp8_layers.py, 2026-12-07, torch 2.11, triton 3.6): bf16 746.6 TF/s, _scaled_mm
# row-wise 1,272 (fast accumulation) / 990 (precise) TF/s, copy 2.98 TB/s, the row-wise cast at 97% of it
# (3 B/element), the tiled column cast at 70% (5 B), 3.76 us per cast kernel. Over its 42 GEMMs of base-h200
# and large-h200 the model's speed-ups have an rms log error of 0.20 and pick FP8 for no GEMM that loses.
H100 = DeviceRates(
    "H100", bf16_flops=747e12, fp8_flops=1272e12, fp8_flops_precise=990e12, copy_bytes=2.98e12,
    row_cast_efficiency=0.97, col_cast_efficiency=0.70, cast_kernel_s=3.8e-6,
)  # fmt: skip
# H200: the same GH100 compute and casts; its copy rate measured 4.12-4.23 TB/s (2026-12-03).
H200 = replace(H100, name="H200", copy_bytes=4.2e12)
# A GEMM runs in FP8 under Recipe.fp8_rowwise(auto_fallback=True) only where the roofline predicts at least
# this speed-up: the rates are medians, the model's error is ~20%, and a cast's fixed costs vary.
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


def layer_rates() -> DeviceRates:
    """The rates a layer's once-for-all choice uses (:meth:`gem_precision.Recipe.for_layer`), made before its
    inputs' device is known: this process's current GPU's where there is one (:func:`use_rates` overrides),
    else the H200's, the most favourable known device (a GEMM that cannot pay there cannot pay anywhere)."""
    if _override or torch.cuda.is_available():
        return rates_for("cuda")
    return H200


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
    fp8 = flops / rates.fp8_rate(m, k, n, precise=precise)
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
