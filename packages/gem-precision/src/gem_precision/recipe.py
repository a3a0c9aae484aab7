"""``Recipe``: how each of the three GEMMs of a linear layer is computed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gem_precision.formats import SCALE_MODES, check_block_size, elem_format
from gem_precision.roofline import AUTO_MIN_SPEEDUP, fp8_gemm_speedup, layer_rates
from gem_precision.rowwise import MIN_FP8_DIM, rowwise_fallback

# for_layer's token count for "can this GEMM ever pay": the roofline's speed-up grows with the tokens (the
# casts' fixed costs amortize), so this is its limit for any batch a GPU holds.
_MANY_TOKENS = 1 << 24

GEMM_FORMATS = ("mxfp8", "fp8_rowwise", "bf16")


@dataclass(frozen=True)
class Recipe:
    """Precision recipe of a linear layer ``y = x @ w.T + b``.

    The three GEMMs are ``forward`` (``y = x @ w.T``, K = in_features), ``dgrad`` (``dx = dy @ w``,
    K = out_features) and ``wgrad`` (``dw = dy.T @ x``, K = the tokens). Each is one of

    * ``"mxfp8"``: both operands quantized to MX along that GEMM's K (32-element blocks, E8M0 scales),
      multiplied exactly by :func:`gem_precision.mx_mm`;
    * ``"fp8_rowwise"``: both operands quantized to FP8 with one fp32 scale per row along K, multiplied by
      ``torch._scaled_mm`` on CUDA (sm89+) or an emulation of the same numerics elsewhere;
    * ``"bf16"``: not quantized; computed in the dtype of the inputs (bf16 in mixed-precision training).

    Attributes:
        forward, dgrad, wgrad: format of each GEMM (see above).
        elem_dtype: FP8 element type of activations and weights.
        grad_elem_dtype: FP8 element type of the output gradient (E4M3 by default, as in NVIDIA's and
            torchao's MXFP8 recipes: E5M2 gradients diverged in Megatron).
        scale_mode: MX scale rounding, ``"rceil"`` (nothing saturates) or ``"floor"``.
        stochastic_rounding: round the output gradient stochastically in MXFP8 GEMMs (unbiased with
            ``"rceil"``); activations and weights are always rounded to nearest.
        hadamard: apply a random Hadamard transform (seeded by ``hadamard_seed``) to every 32-element K
            block of both operands of MXFP8 GEMMs (it cancels in the product and spreads outliers). A GEMM
            whose K is not a multiple of 32 runs without it.
        square_blocks: quantize x, w and dy once in 32x32 tiles and reuse them transposed in backward,
            instead of re-quantizing along each GEMM's K in 1x32 blocks (less work, coarser scales).
        fp8_fast_accum: ``use_fast_accum`` of ``torch._scaled_mm`` for the forward fp8_rowwise GEMM (K =
            in_features).
        fp8_fast_accum_backward: the same for the dgrad and wgrad fp8_rowwise GEMMs. Off by default, as in
            torchao's ``Float8LinearConfig`` (fast accumulation for the output GEMM only): Hopper's fast
            mode keeps the whole K sum in the tensor cores' reduced-precision accumulator (about 14 bits,
            DeepSeek-V3 report) instead of promoting to fp32, and wgrad's K is the token count (~10^5 on
            base-h200). With it on for all three GEMMs, base-h200's 2,000-step test CTR NE was 3.1% worse
            than bf16's (gem-train BENCHMARKS.md).
        fp8_min_speedup: 0 (default): every ``fp8_rowwise`` GEMM whose shape FP8 can take runs in FP8.
            > 0: only those the stated roofline (:mod:`gem_precision.roofline`) predicts at least this much
            faster than bf16, decided per GEMM: once per layer for any token count (:meth:`for_layer`, on
            this process's GPU's rates, or the H200's, the most favourable known device, without one: a
            GEMM that cannot pay at any token count runs bf16 from the start, and a layer none of whose
            GEMMs pays stays a plain ``F.linear``), and per call on the device's rates with the call's token
            count (``fp8_rowwise_mm``'s ``min_speedup``). ``Recipe.fp8_rowwise(auto_fallback=True)`` sets
            :data:`gem_precision.roofline.AUTO_MIN_SPEEDUP`.
        block_size: MX block size.
    """

    forward: str = "mxfp8"
    dgrad: str = "mxfp8"
    wgrad: str = "bf16"
    elem_dtype: torch.dtype = torch.float8_e4m3fn
    grad_elem_dtype: torch.dtype = torch.float8_e4m3fn
    scale_mode: str = "rceil"
    stochastic_rounding: bool = False
    hadamard: bool = False
    hadamard_seed: int = 0
    square_blocks: bool = False
    fp8_fast_accum: bool = True
    fp8_fast_accum_backward: bool = False
    fp8_min_speedup: float = 0.0
    block_size: int = 32

    def __post_init__(self) -> None:
        for name in ("forward", "dgrad", "wgrad"):
            if getattr(self, name) not in GEMM_FORMATS:
                raise ValueError(f"Recipe.{name} must be one of {GEMM_FORMATS}, got {getattr(self, name)!r}")
        elem_format(self.elem_dtype)
        elem_format(self.grad_elem_dtype)
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"Recipe.scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        check_block_size("Recipe", self.block_size)
        if self.hadamard and self.square_blocks:
            raise ValueError("Recipe: hadamard and square_blocks cannot be combined")
        s = self.fp8_min_speedup
        if isinstance(s, bool) or not isinstance(s, int | float) or not s >= 0:
            raise ValueError(f"Recipe.fp8_min_speedup must be a number >= 0, got {s!r}")

    @property
    def gemms(self) -> tuple[str, str, str]:
        return (self.forward, self.dgrad, self.wgrad)

    def for_layer(self, in_features: int, out_features: int) -> Recipe:
        """This recipe with each ``fp8_rowwise`` GEMM that a layer of this shape cannot take set to ``bf16``.

        The layer's GEMMs are forward ``[T, in] @ [in, out]``, dgrad ``[T, out] @ [out, in]`` and wgrad
        ``[out, T] @ [T, in]`` (T tokens, known only per call: :func:`~gem_precision.rowwise.fp8_rowwise_mm`
        decides on it then). See :func:`~gem_precision.rowwise.rowwise_fallback` for the rule; with
        ``fp8_min_speedup`` also the GEMMs no token count makes pay (:meth:`gemm_speedups`), and every
        GEMM of a layer whose three GEMMs together would not gain ``fp8_min_speedup`` (:meth:`layer_speedup`):
        an FP8 layer's autograd function costs its three GEMMs the fusions, the per-call choice and the
        launches of a plain ``F.linear`` (large-h200 on an H100: 0.91x the bf16 step with the FP8 layers
        the per-GEMM rule kept, when the best choice per GEMM gains 1.05x of the GEMMs' time).
        """
        t = MIN_FP8_DIM  # any token count the per-call rule accepts
        shapes = {
            "forward": (t, in_features, out_features),
            "dgrad": (t, out_features, in_features),
            "wgrad": (out_features, t, in_features),
        }
        best = self.gemm_speedups(in_features, out_features) if self.fp8_min_speedup > 0 else {}
        changes: dict[str, Any] = {
            name: "bf16"
            for name, (m, k, n) in shapes.items()
            if getattr(self, name) == "fp8_rowwise"
            and (rowwise_fallback(m, k, n) is not None or best.get(name, 1e9) < self.fp8_min_speedup)
        }
        if best:
            kept = [
                g
                for g in ("forward", "dgrad", "wgrad")
                if getattr(self, g) == "fp8_rowwise" and g not in changes
            ]
            if kept and self.layer_speedup(best, kept) < self.fp8_min_speedup:
                changes.update(dict.fromkeys(kept, "bf16"))
        return dataclasses.replace(self, **changes) if changes else self

    @staticmethod
    def layer_speedup(speedups: dict[str, float], fp8_gemms: list[str]) -> float:
        """A layer's predicted speed-up over its three GEMMs with ``fp8_gemms`` in FP8 at ``speedups`` (per
        GEMM, from :meth:`gemm_speedups`): the three have the same FLOPs, so the same bf16 time."""
        return 3.0 / sum(1.0 / speedups[g] if g in fp8_gemms else 1.0 for g in ("forward", "dgrad", "wgrad"))

    def gemm_speedups(
        self, in_features: int, out_features: int, tokens: int = _MANY_TOKENS
    ) -> dict[str, float]:
        """The roofline's predicted fp8_rowwise speed-up of each GEMM of a layer at ``tokens`` tokens on the
        rates of this process's GPU, else the H200's (:func:`gem_precision.roofline.fp8_gemm_speedup`;
        default: the limit for large batches). Forward casts x and w row-wise; dgrad dy row-wise and w
        column-wise; wgrad dy and x column-wise; dgrad and wgrad accumulate precisely unless
        ``fp8_fast_accum_backward``."""
        i, o, t = in_features, out_features, tokens
        p = not self.fp8_fast_accum_backward
        rates = layer_rates()
        return {
            "forward": fp8_gemm_speedup(t, i, o, precise=not self.fp8_fast_accum, rates=rates),
            "dgrad": fp8_gemm_speedup(t, o, i, b_col=True, precise=p, rates=rates),
            "wgrad": fp8_gemm_speedup(o, t, i, a_col=True, b_col=True, precise=p, rates=rates),
        }

    @classmethod
    def mxfp8(cls, **overrides: Any) -> Recipe:
        """The default: MXFP8 forward and dgrad, wgrad in bf16 (weight gradients have the worst outliers:
        GEM keeps them in higher precision)."""
        return cls(**overrides)

    @classmethod
    def mxfp8_all(cls, **overrides: Any) -> Recipe:
        """All three GEMMs in MXFP8."""
        return cls(**{"wgrad": "mxfp8", **overrides})

    @classmethod
    def fp8_rowwise(cls, auto_fallback: bool = False, **overrides: Any) -> Recipe:
        """All three GEMMs in FP8 with per-row scales (the Hopper-speed recipe); ``auto_fallback``: each
        only where the roofline predicts it pays (``fp8_min_speedup`` = ``AUTO_MIN_SPEEDUP``), bf16
        elsewhere, so the recipe never runs a GEMM it expects to lose on."""
        auto = {"fp8_min_speedup": AUTO_MIN_SPEEDUP} if auto_fallback else {}
        return cls(
            **{"forward": "fp8_rowwise", "dgrad": "fp8_rowwise", "wgrad": "fp8_rowwise", **auto, **overrides}
        )

    @classmethod
    def bf16(cls) -> Recipe:
        """No quantization (a reference point)."""
        return cls(forward="bf16", dgrad="bf16", wgrad="bf16")
