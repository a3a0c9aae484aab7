"""``MXFP8Linear``: a drop-in ``nn.Linear`` whose three GEMMs run in MXFP8, FP8 row-wise or bf16."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gem_precision.formats import check_float_tensor
from gem_precision.mx import MXTensor, mx_mm, random_hadamard, to_mx
from gem_precision.recipe import Recipe
from gem_precision.rowwise import fp8_rowwise_dgrad_wgrad, fp8_rowwise_mm
from gem_precision.rowwise.ops import speedup_arg

# fp8_rowwise backward: True = both GEMMs in one op that quantizes dy's two FP8 copies in one pass
# (fp8_rowwise_dgrad_wgrad); False = two fp8_rowwise_mm calls. False by default: on the H200 (2026-12-03,
# bench_fp8_quant.py, 180,001 tokens) the one pass took 0.80-0.96x the time of the row-wise plus the tiled
# column-wise quantizer run apart (0.360 vs 0.346 ms at 512 columns, 1.332 vs 1.071 ms at 2,048). (Until
# issue 37 the backward took the one-pass op whatever this said.)
FUSED_BACKWARD = False

# MX operands memoized per GEMM call: by tensor name (square tiles) or by (name, K axis).
MXCache = dict[str | tuple[str, int], MXTensor]
# MXFP8Linear's buffers of the cached weight casts (gem_precision.weight_cache).
_CAST_BUFFERS = ("fp8_w_row", "fp8_w_row_scale", "fp8_w_colt", "fp8_w_colt_scale")


@functools.lru_cache(maxsize=16)
def _hadamard(block_size: int, seed: int, device: torch.device) -> torch.Tensor:
    return random_hadamard(block_size, seed=seed, device=device)


class _Quantizer:
    """Quantizes the operands of one layer's GEMMs per the recipe (the Hadamard matrix is built once)."""

    def __init__(self, recipe: Recipe, device: torch.device) -> None:
        self.recipe = recipe
        self.hadamard = (
            _hadamard(recipe.block_size, recipe.hadamard_seed, device) if recipe.hadamard else None
        )

    def mx(self, t: torch.Tensor, axis: int, *, grad: bool = False) -> MXTensor:
        """``t`` (2-D) quantized along ``axis`` (the K of the GEMM it feeds)."""
        r = self.recipe
        had = self.hadamard if self.hadamard is not None and t.shape[axis] % r.block_size == 0 else None
        return to_mx(
            t,
            axis=axis,
            block_size=r.block_size,
            elem_dtype=r.grad_elem_dtype if grad else r.elem_dtype,
            scale_mode=r.scale_mode,
            rounding="stochastic" if grad and r.stochastic_rounding else "nearest",
            square=r.square_blocks,
            hadamard=had,
        )


def _gemm(
    fmt: str,
    q: _Quantizer,
    cache: MXCache,
    a: tuple[str, torch.Tensor, bool],
    b: tuple[str, torch.Tensor, bool],
    *,
    a_grad: bool,
    out_dtype: torch.dtype,
    b_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    min_speedup: str = "0.0",
) -> torch.Tensor:
    """``A @ B.T`` for ``A [M, K]`` and ``B [N, K]`` given as ``(name, stored, transposed)``: the stored
    tensor is ``A`` (``B``), or its transpose when ``transposed``.

    ``a_grad`` marks ``A`` as the output gradient (gradient element type, stochastic rounding; for
    fp8_rowwise also the backward's accumulation mode, ``Recipe.fp8_fast_accum_backward``). MX
    operands are memoized in ``cache`` by name (and K axis unless square), so a tensor quantized in
    forward is reused in backward. ``b_quantized``: B's cached fp8_rowwise cast (``weight_cache``);
    ``min_speedup``: ``Recipe.fp8_min_speedup`` as the custom ops take it (``speedup_arg``).
    """
    (a_name, a_st, a_t), (b_name, b_st, b_t) = a, b
    r = q.recipe
    if fmt == "bf16":
        aa = a_st.t() if a_t else a_st
        bb = b_st.t() if b_t else b_st
        return aa.to(out_dtype) @ bb.to(out_dtype).t()
    if fmt == "fp8_rowwise":
        return fp8_rowwise_mm(
            a_st,
            b_st,
            a_t=a_t,
            b_t=b_t,
            elem_dtype=r.grad_elem_dtype if a_grad else r.elem_dtype,
            b_elem_dtype=r.elem_dtype,
            out_dtype=out_dtype,
            use_fast_accum=r.fp8_fast_accum_backward if a_grad else r.fp8_fast_accum,
            min_speedup=min_speedup,
            b_quantized=b_quantized,
        )
    # mxfp8: quantize each stored tensor along K (axis 1 if it is stored [., K], else 0) and take the
    # transposed MXTensor view where needed: no copies.
    qa = mx_operand(q, cache, a_name, a_st, 0 if a_t else 1, grad=a_grad)
    qb = mx_operand(q, cache, b_name, b_st, 0 if b_t else 1, grad=False)
    return mx_mm(qa.t() if a_t else qa, qb if b_t else qb.t(), out_dtype=out_dtype)


def mx_operand(
    q: _Quantizer, cache: MXCache, name: str, t: torch.Tensor, axis: int, *, grad: bool
) -> MXTensor:
    key: str | tuple[str, int] = name if q.recipe.square_blocks else (name, axis)
    if key not in cache:
        cache[key] = q.mx(t, axis, grad=grad)
    return cache[key]


WeightCasts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class _MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: Recipe,
        min_speedup: str = "0.0",
        w_row: torch.Tensor | None = None,
        w_row_scale: torch.Tensor | None = None,
        w_colt: torch.Tensor | None = None,
        w_colt_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # The four w_*: the weight's cached fp8_rowwise casts (weight_cache), or None.
        casts = None
        if w_row is not None and w_row_scale is not None and w_colt is not None and w_colt_scale is not None:
            casts = (w_row, w_row_scale, w_colt, w_colt_scale)
        with torch.autocast(x.device.type, enabled=False):  # our GEMMs choose their own precision
            return _MXLinearFn._forward(ctx, x, weight, bias, recipe, min_speedup, casts)

    @staticmethod
    def _forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: Recipe,
        min_speedup: str,
        casts: WeightCasts | None,
    ) -> torch.Tensor:
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        w = weight.to(dtype)
        q = _Quantizer(recipe, x.device)
        cache: MXCache = {}
        # y [M, N] = x [M, K] @ w.T (B = w [N, K]).
        y = _gemm(
            recipe.forward, q, cache, ("x", x2, False), ("w", w, False), a_grad=False, out_dtype=dtype,
            b_quantized=casts[:2] if casts is not None else None, min_speedup=min_speedup,
        )  # fmt: skip
        if bias is not None:
            y = y + bias.to(dtype)
        if recipe.wgrad == "mxfp8":
            # Keep x only as FP8 blocked along M (the wgrad K): half the saved bytes of bf16.
            mx_operand(q, cache, "x", x2, 0, grad=False)
            saved_x = None
        else:
            saved_x = x2
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        # Backward reuses the FP8 x along M (wgrad) and, with square tiles, the tiles of w (dgrad).
        if recipe.square_blocks:
            keep: set[str | tuple[str, int]] = {"w", "x"} if recipe.wgrad == "mxfp8" else {"w"}
        else:
            keep = {("x", 0)}
        ctx.mx_cache = {k: v for k, v in cache.items() if k in keep}
        ctx.has_casts = casts is not None
        ctx.min_speedup = min_speedup
        ctx.save_for_backward(saved_x, weight, *(casts[2:] if casts is not None else ()))
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.autocast(dy.device.type, enabled=False):
            return _MXLinearFn._backward(ctx, dy)

    @staticmethod
    def _backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recipe: Recipe = ctx.recipe
        x2, weight, *colt = ctx.saved_tensors
        w_colt = (colt[0], colt[1]) if ctx.has_casts else None
        dtype = dy.dtype
        dy2 = dy.reshape(-1, dy.shape[-1])
        w = weight.to(dtype)
        q = _Quantizer(recipe, dy.device)
        cache: MXCache = ctx.mx_cache
        ctx.mx_cache = None
        dx = dw = db = None
        if (
            FUSED_BACKWARD
            and recipe.dgrad == recipe.wgrad == "fp8_rowwise"
            and ctx.needs_input_grad[0]
            and ctx.needs_input_grad[1]
        ):
            # One op for both: dy's two FP8 copies (along N and along the tokens) from one read of dy.
            dx, dw = fp8_rowwise_dgrad_wgrad(
                dy2,
                w,
                x2,
                grad_elem_dtype=recipe.grad_elem_dtype,
                elem_dtype=recipe.elem_dtype,
                out_dtype=dtype,
                use_fast_accum=recipe.fp8_fast_accum_backward,
                min_speedup=ctx.min_speedup,
            )
            dx, dw = dx.reshape(ctx.x_shape), dw.to(weight.dtype)
        if dx is None and ctx.needs_input_grad[0]:
            # dx [M, K] = dy [M, N] @ w [N, K]: this GEMM's K is N; B = w.T, stored as w.
            dx = _gemm(
                recipe.dgrad, q, cache, ("dy", dy2, False), ("w", w, True), a_grad=True, out_dtype=dtype,
                b_quantized=w_colt, min_speedup=ctx.min_speedup,
            )  # fmt: skip
            dx = dx.reshape(ctx.x_shape)
        if dw is None and ctx.needs_input_grad[1]:
            # dw [N, K] = dy.T [N, M] @ x [M, K]: this GEMM's K is M; A = dy.T, B = x.T stored as x.
            dw = _gemm(
                recipe.wgrad, q, cache, ("dy", dy2, True), ("x", x2, True), a_grad=True, out_dtype=dtype,
                min_speedup=ctx.min_speedup,
            )  # fmt: skip
            dw = dw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None, None, None, None


class MXFP8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs follow a :class:`Recipe` (MXFP8 forward and dgrad, bf16 wgrad by default).

    Input ``[..., in_features]`` of any float dtype; the GEMMs produce that dtype (bf16 in training), and
    parameters are cast to it. Numerics per GEMM: see :class:`Recipe`.

    ``recipe`` is the recipe asked for; ``layer_recipe`` the one the layer runs, with every ``fp8_rowwise``
    GEMM that this layer's shape cannot take set to ``bf16`` (:meth:`Recipe.for_layer`, decided when the
    recipe is set). GEMMs whose token count is too small run unquantized per call.
    """

    _recipe: Recipe
    layer_recipe: Recipe
    # The cached fp8_rowwise casts of the weight (gem_precision.weight_cache; non-persistent buffers, None
    # when not cached) and the GEMM dtype they are for.
    fp8_w_row: torch.Tensor | None
    fp8_w_row_scale: torch.Tensor | None
    fp8_w_colt: torch.Tensor | None
    fp8_w_colt_scale: torch.Tensor | None
    fp8_cache_dtype: torch.dtype | None = None
    fp8_cache_key: Any = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: Recipe | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe or Recipe()
        for name in _CAST_BUFFERS:
            self.register_buffer(name, None, persistent=False)

    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Recipe) -> None:
        self._recipe = recipe
        self.layer_recipe = recipe.for_layer(self.in_features, self.out_features)
        self.fp8_min_speedup_arg = speedup_arg(self.layer_recipe.fp8_min_speedup)

    def set_fp8_weight_cache(self, *casts: torch.Tensor) -> None:
        """Store the weight's casts ``(row, row_scale, colt, colt_scale)`` (in place where the buffers
        already have their shape, so compiled graphs and CUDA graphs keep reading the same memory)."""
        for name, t in zip(_CAST_BUFFERS, casts, strict=True):
            old = getattr(self, name)
            if old is not None and old.shape == t.shape and old.dtype == t.dtype and old.device == t.device:
                old.copy_(t)
            else:
                setattr(self, name, t)

    def drop_fp8_weight_cache(self) -> None:
        for name in _CAST_BUFFERS:
            setattr(self, name, None)
        self.fp8_cache_key = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | None = None) -> MXFP8Linear:
        """Wrap an existing ``nn.Linear``; the new module shares its weight and bias Parameters."""
        new = cls(
            linear.in_features, linear.out_features, linear.bias is not None, device="meta", recipe=recipe
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_float_tensor("MXFP8Linear", "input", x)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self.layer_recipe.gemms == ("bf16", "bf16", "bf16"):
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        casts: tuple[torch.Tensor | None, ...] = (None,) * 4
        if self.fp8_cache_dtype == x.dtype and self.fp8_w_row is not None:
            casts = (self.fp8_w_row, self.fp8_w_row_scale, self.fp8_w_colt, self.fp8_w_colt_scale)
        # torch's Function.apply is unannotated (torch/autograd/function.py).
        y: torch.Tensor = _MXLinearFn.apply(  # type: ignore[no-untyped-call]
            x, self.weight, self.bias, self.layer_recipe, self.fp8_min_speedup_arg, *casts
        )
        return y

    def extra_repr(self) -> str:
        r = self.layer_recipe
        return f"{super().extra_repr()}, forward={r.forward}, dgrad={r.dgrad}, wgrad={r.wgrad}"
